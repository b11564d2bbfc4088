"""Experiment: a token-major y (GEMM2 scatters, GatherRS streams) against GEMM2's row order.

    python tools/try_token_major.py --json out/exp_token_major.json        # one GPU
    torchrun --nproc-per-node 2 tools/try_token_major.py --json ...         # a group

GatherRS alone keeps too few rows in flight (docs/RESULTS.md, "What limits us now"):
with y in GEMM2's row order each top-k slot is a gather whose addresses come from the
routing table, so every item waits for a table read before its y loads can issue.
Token-major (`TileConfig.token_major`), GEMM2 stores row j at y[t*k + s], so slot s of
a block of tokens sits at rows GatherRS computes, strided by k rows: no table read in
front (the op does this where every token has its k rows here, as under TP), and
cp.async pipelining on affine addresses. (Session 6's runs, docs/data/exp_token_major_s6
and _s6b.json, also timed bulk tensor copies (TMA), and EP layouts with the table read
for empty slots or every slot loaded: the code of commit 47c6002 and the next; TMA
slower, EP no faster, removed.)

Per case (model x layout x S, uniform routing, rank 0's workload of the layout, this
process group; one GPU: the whole gather, pushes local): every variant's output must
equal the shipped variant's bit for bit, with the output poisoned first, and the
reference path's within bf16 error. Then ABBA-interleaved rounds of, per variant:
GatherRS alone at each C (flags preset), GEMM2 alone on all SMs, the overlapped
kernels at each C and at the planner's C (host work done once, outside the timing),
and the whole op as a caller sees it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from benchlib import abba, env_info, summarize, without_samples, write_json  # noqa: E402
from workloads import OpCase, rank_inputs  # noqa: E402

from megatron_overlap.ops import OverlapConfig, gemm2_gather_rs  # noqa: E402
# (these experiments and recorded runs are of the partition placement)
from megatron_overlap.ops.config import PARTITION_TILES as GPU_TILES  # noqa: E402
from megatron_overlap.ops.op import prepare  # noqa: E402
from megatron_overlap.ops.planning import plan_cache_of  # noqa: E402

R = dataclasses.replace
TRITON_TILES = R(GPU_TILES, gemm_impl="triton")  # GEMM2 by the Triton kernel
VARIANTS = {
    "rows": R(TRITON_TILES, token_major=False),  # GEMM2's row order (shipped until session 6)
    "tokens": TRITON_TILES,  # (shipped in session 6)
    "tokens w16": R(TRITON_TILES, comm_warps=16),
    "tokens cp.async s2": R(TRITON_TILES, comm_rows=128, comm_stages=2),
    # GEMM2 by the warp-specialized Gluon kernel (kernels/gemm2_ws.py; session 7, the
    # default on Hopper: gemm_impl "auto")
    "tokens+gluon": R(GPU_TILES, gemm_impl="gluon"),
    "tokens+gluon_inline": R(GPU_TILES, gemm_impl="gluon_inline_publish"),
    "rows+gluon": R(GPU_TILES, token_major=False, gemm_impl="gluon"),
}
CASES = ["qwen/TP2EP1/16384", "qwen/TP2EP1/4096", "deepseek/TP2EP1/16384",
         "granite/TP2EP1/16384"]  # (EP layouts keep GEMM2's row order: the op's rule)


def variants_for(names, base) -> dict:
    """The named variants, on `base` (the interpreter's tiles under --smoke)."""
    if base is GPU_TILES:
        return {n: VARIANTS[n] for n in names}
    return {n: R(base, token_major=VARIANTS[n].token_major,
                 comm_stages=VARIANTS[n].comm_stages) for n in names
            if VARIANTS[n].gemm_impl == "triton"}  # (Gluon: no interpreter path)


def launch_counts(launch):
    return launch.counts_dev


def policies(inp, group, tiles, cset, backend, splits=None) -> tuple[dict, dict, tuple]:
    args = (inp["x"], inp["weight"], inp["counts_list"], inp["token_index"], inp["tokens"],
            inp["topk"], None, group)
    cfg = OverlapConfig(tiles=tiles, backend=backend)
    auto = prepare(*args, splits=splits, config=cfg)
    buf = auto.buffer
    out = torch.empty(inp["tokens"] // auto.world, inp["hidden"], dtype=inp["x"].dtype,
                      device=inp["x"].device)
    y = torch.randn(inp["x"].shape[0], inp["hidden"], device=out.device).to(out.dtype)
    cache = plan_cache_of(auto)
    all_sms = auto.plan._replace(compute_slots=cache.kernel.o_comp * cache.device.available_sms)

    def run(launch, plan=None, **kw):
        plan = plan or launch.plan
        return lambda: buf.launch(inp["x"], inp["weight"], launch.counts_dev, launch.table,
                                  None, out, plan=plan, **launch.kwargs, **kw)

    pol = {"gemm2 alone": run(auto, plan=all_sms, phases=("gemm2",)),
           f"overlap planner C={auto.plan.comm_ctas}": run(auto),
           "whole op": lambda: gemm2_gather_rs(*args, splits=splits, config=cfg)}
    for c in cset:
        at_c = prepare(*args, comm_ctas=c, splits=splits, config=cfg)
        pol[f"comm alone C={c}"] = run(at_c, phases=("comm",), y=y)
        pol[f"overlap C={c}"] = run(at_c)
    # bytes GatherRS moves: every row of y it reads once, its partials written once
    present = inp["x"].shape[0]
    if backend == "triton":  # torch's grouped GEMM2 alone, the reference's first step
        from megatron_overlap.ops.reference import grouped_mm

        w_t = inp["weight"].transpose(1, 2)
        pol["torch gemm2 alone"] = lambda: grouped_mm(inp["x"], w_t, launch_counts(auto),
                                                      inp["counts_list"])
    facts = dict(planner_c=auto.plan.comm_ctas, splits=auto.plan.splits,
                 o_comp=cache.kernel.o_comp, gemm2=(getattr(buf, "compiled_resources", None) or {}).get("gemm2"),
                 token_major=auto.kwargs.get("dest") is not None,
                 comm_tile=(auto.kwargs["comm_tm"], auto.kwargs["comm_tn"]),
                 comm_bytes=(present + inp["tokens"]) * inp["hidden"] * out.element_size())
    check = run(auto)
    return pol, facts, (check, out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help="model/layout/S, comma separated")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--splits", default="", help="comma list of L to cross the variants "
                    "with (default: the op's own L)")
    ap.add_argument("--cset", default="8,16,32")
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU check: interpreter, tiny shape")
    args = ap.parse_args()
    backend, device, base = "triton", "cuda", GPU_TILES
    if args.smoke:
        from megatron_overlap.ops.config import INTERPRET_TILES

        backend, device, base = "interpret", "cpu", INTERPRET_TILES
        if args.cases == ",".join(CASES):
            args.cases = "tiny/TP2EP1/16,tiny/TP1EP2/16"
        args.cset, args.samples, args.warmup = "2,3", 2, 1
    elif not torch.cuda.is_available():
        print("try_token_major: needs a CUDA GPU (or --smoke)")
        return 2
    group = None
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
        group = dist.group.WORLD
    rank = dist.get_rank() if group is not None else 0
    cset = [int(c) for c in args.cset.split(",")]
    results = []
    for spec in args.cases.split(","):
        model, layout, seq = spec.split("/")
        inp = rank_inputs(OpCase(model, layout, int(seq), "uniform"), rank, device)
        full = inp["x"].shape[0] == inp["tokens"] * inp["topk"]
        ref = gemm2_gather_rs(inp["x"], inp["weight"], inp["counts_list"], inp["token_index"],
                              inp["tokens"], inp["topk"], None, group,
                              config=OverlapConfig(backend="reference")).float()
        pol, facts, first = {}, {}, None
        runs = [(name, tiles, None) for name, tiles in
                variants_for(args.variants.split(","), base).items()]
        if args.splits:
            runs = [(f"{name} L={l}", tiles, int(l)) for name, tiles, _ in runs
                    for l in args.splits.split(",")]
        for name, tiles, splits in runs:
            p, f, (check, out) = policies(inp, group, tiles, cset, backend, splits)
            out.fill_(float("nan"))  # poisoned: every element must be written
            check()
            if device == "cuda":
                torch.cuda.synchronize()
            got = out.clone()
            first = got if first is None else first
            f.update(bitwise_as_shipped=bool(torch.equal(got, first)),
                     unwritten=int(torch.isnan(got).sum()),
                     rel_err=float((got.float() - ref).norm() / ref.norm()))
            facts[name] = f
            pol.update({f"{name} | {k}": v for k, v in p.items()})
        stats = summarize(abba(pol, args.samples, args.warmup, group, progress=spec))
        results.append(dict(case=spec, full=full, facts=facts, stats=without_samples(stats)))
        if rank == 0:
            report(spec, facts, stats, cset)
    if rank == 0:
        write_json(args.json, dict(env=env_info(), command=" ".join(sys.argv),
                                   results=results))
    if group is not None:
        dist.destroy_process_group()
    return 0


def report(spec, facts, stats, cset) -> None:
    med = {k: v["median"] for k, v in stats.items()}
    print(f"\n{spec}: GatherRS alone GB/s per CTA at C={cset}; ms for the rest")
    print(f"{'variant':24} {'ok':>4} " + " ".join(f"{'C=' + str(c):>7}" for c in cset)
          + f" {'gemm2':>7} " + " ".join(f"{'ov' + str(c):>7}" for c in cset)
          + f" {'ov C*':>7} {'whole':>7}")
    for name, f in facts.items():
        gbs = [f["comm_bytes"] / (med[f"{name} | comm alone C={c}"] * 1e-3) / c / 1e9 for c in cset]
        ov = [med[f"{name} | overlap C={c}"] for c in cset]
        star = med[f"{name} | overlap planner C={f['planner_c']}"]
        ok = "yes" if f["bitwise_as_shipped"] and not f["unwritten"] and f["rel_err"] < 1e-2 else (
            "~" if not f["unwritten"] and f["rel_err"] < 1e-2 else "NO")  # ~: close, other bits
        print(f"{name:24} {ok:>4} " + " ".join(f"{g:7.1f}" for g in gbs)
              + f" {med[f'{name} | gemm2 alone']:7.3f} " + " ".join(f"{t:7.3f}" for t in ov)
              + f" {star:7.3f} {med[f'{name} | whole op']:7.3f}  P/SM {f['o_comp']}")
    torch_key = next((k for k in med if k.endswith("| torch gemm2 alone")), None)
    if torch_key:
        print(f"torch._grouped_mm GEMM2 alone: {med[torch_key]:.3f} ms")


if __name__ == "__main__":
    sys.exit(main())
