"""The layer's one-pass kernels against what they replace, side by side (ABBA, one process).

    python tools/try_layer_kernels.py --json out/exp_layer_kernels.json     # one GPU
    python tools/try_layer_kernels.py --smoke                               # CPU check

At Qwen's MoE shapes (H = 2048, K = 1408, top-4 of 60) for B x S tokens:
  * gather: the deferred postprocess's permute under EP = 2 in inference. The rows are
    padded to their bound (M x top-k), half of them real: `index_select` over the bound
    (what padding would cost without a bounded copy), `gather_rows` bounded by the real
    count on the device, and `index_select` over the real rows only (the single-sync
    postprocess, which knows the count);
  * swiglu: the weighted SwiGLU over that bound, all rows or the real ones (`valid_rows`);
  * gated add: Megatron's gated shared expert join (`shared * sigmoid(logit)`, then the
    add into the routed output) against `add_gated_shared_` in place.
Each pair is checked for agreement before it is timed.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from benchlib import abba, env_info, summarize, without_samples, write_json  # noqa: E402

from megatron_overlap.kernels import gated_add, gather_rows, swiglu  # noqa: E402


def cases(tokens: int, hidden: int, k: int, topk: int, device, dtype):
    """{case: {arm: fn}} on one set of random inputs, after the arms were compared."""
    g = torch.Generator(device=device).manual_seed(0)
    bound, real = tokens * topk, tokens * topk // 2
    hidden_states = torch.randn(tokens, hidden, device=device, generator=g).to(dtype)
    index = torch.randint(0, tokens, (bound,), device=device, generator=g)
    valid = torch.tensor([real], device=device)
    assert torch.equal(gather_rows.gather_rows(hidden_states, index, valid)[:real],
                       hidden_states.index_select(0, index[:real]))
    inter = torch.randn(bound, 2 * k, device=device, generator=g).to(dtype)
    probs = torch.rand(bound, device=device, generator=g)
    act = torch.empty(bound, k, device=device, dtype=dtype)
    swiglu.weighted_swiglu(inter, probs, out=act, valid_rows=valid)
    want = swiglu.weighted_swiglu_reference(inter[:real], probs[:real]).float()
    assert (act[:real].float() - want).abs().max() <= 1e-2 * want.abs().max()
    routed = torch.randn(tokens, hidden, device=device, generator=g).to(dtype)
    shared = torch.randn(tokens, hidden, device=device, generator=g).to(dtype)
    logit = torch.randn(tokens, 1, device=device, generator=g).to(dtype)
    ref = gated_add.add_gated_shared_reference(routed, shared, logit).float()
    fused = gated_add.add_gated_shared_(routed.clone(), shared, logit).float()
    assert (fused - ref).abs().max() <= 1e-2 * ref.abs().max()
    return {
        "gather": {
            "index_select over the bound": lambda: hidden_states.index_select(0, index),
            "gather_rows to the real count": lambda: gather_rows.gather_rows(
                hidden_states, index, valid),
            "index_select of the real rows": lambda: hidden_states.index_select(
                0, index[:real]),
        },
        "swiglu": {
            "all bound rows": lambda: swiglu.weighted_swiglu(inter, probs, out=act),
            "real rows (valid_rows)": lambda: swiglu.weighted_swiglu(
                inter, probs, out=act, valid_rows=valid),
        },
        "gated add": {
            "Megatron: multiply, then add": lambda: routed + shared * torch.sigmoid(logit),
            "add_gated_shared_ in place": lambda: gated_add.add_gated_shared_(
                routed, shared, logit),
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="4096,16384")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU check: the interpreter, tiny")
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        shape, device, dtype = dict(hidden=64, k=48, topk=4), "cpu", torch.float32
        args.seqs, args.batch, args.samples, args.warmup = "8", 2, 2, 0
    else:
        shape, device, dtype = dict(hidden=2048, k=1408, topk=4), "cuda", torch.bfloat16
    results = []
    for seq in map(int, args.seqs.split(",")):
        tokens = args.batch * seq
        for case, arms in cases(tokens, **shape, device=device, dtype=dtype).items():
            stats = summarize(abba(arms, args.samples, args.warmup, progress=case))
            base = stats[next(iter(arms))]["median"]
            for arm, st in stats.items():
                print(f"S={seq} {case}: {arm}: {st['median']:.3f} ms "
                      f"[{st['ci_low']:.3f}, {st['ci_high']:.3f}], "
                      f"{base / st['median']:.2f}x of the first", flush=True)
            results.append(dict(seq=seq, batch=args.batch, tokens=tokens, case=case, **shape,
                                stats=without_samples(stats),
                                samples={a: s["samples"] for a, s in stats.items()}))
    write_json(args.json, dict(env=env_info(), command=" ".join(sys.argv), results=results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
