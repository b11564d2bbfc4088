"""The stock unpermute's rate, Megatron's and TE's fused, for the fuse-or-not's step costs.

    python tools/unpermute_rate.py --json out/unpermute_h100.json
    python tools/unpermute_rate.py --write-calibration megatron_overlap/planner/calibrations/h100.json

The planner prices the stock path's unpermute as B_comb / BW (`planner/fusion.py`:
B_comb = (T + M) N b, the T routed rows read and the M tokens written). Under
`--moe-permute-fusion` that step is TE's fused unpermute, whose rate
(`StepCosts.fused_combine_bytes_per_us`) this measures beside Megatron's own
(`combine_bytes_per_us`): for each model's shapes (TP1EP1, every expert on the GPU, B x S
tokens, uniform top-k routing) it permutes as the allgather dispatcher does, checks that
both unpermutes give the same tokens, then times each (CUDA events, median of
`--samples`, the two ABBA-interleaved). The rate written is the median over the cases of
B_comb / time. `--write-calibration FILE` sets both rates in that calibration's
`step_costs` (other fields untouched).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import SHAPES  # noqa: E402


def routed_case(tokens: int, hidden: int, experts: int, topk: int, dtype, device, seed=0):
    """(hidden states [M, N], routing map [M, E] bool): uniform top-k routing."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool)
    routing_map.scatter_(1, scores.topk(topk, dim=1).indices, True)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    return x.to(device), routing_map.to(device)


def _timed(fn, samples: int, device) -> list[float]:
    """Microseconds of each of `samples` calls of fn (CUDA events on a GPU)."""
    out = []
    for _ in range(samples):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
    return out


def measure_case(tokens: int, hidden: int, experts: int, topk: int, samples: int,
                 device, dtype=torch.bfloat16) -> dict:
    """Both unpermutes of one routing, checked equal, timed ABBA: {arm: median us}."""
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    x, routing_map = routed_case(tokens, hidden, experts, topk, dtype, device)
    arms = {}
    for fused in (False, True):
        rows, _, mapping, _, _ = permute(x, routing_map, num_out_tokens=tokens * topk,
                                         fused=fused)

        def run(rows=rows, mapping=mapping, fused=fused):
            return unpermute(rows, mapping, x.shape, routing_map=routing_map, fused=fused)
        arms["te_fused" if fused else "megatron"] = run
    first = {name: run() for name, run in arms.items()}
    if not torch.allclose(first["te_fused"].float(), first["megatron"].float(),
                          rtol=1e-2, atol=1e-2):
        raise RuntimeError(f"TE's fused unpermute differs from Megatron's at M={tokens}")
    times = {name: [] for name in arms}
    for i in range(samples):  # ABBA
        for name in (list(arms) if i % 2 == 0 else list(arms)[::-1]):
            times[name] += _timed(arms[name], 1, device)
    moved = (tokens * topk + tokens) * hidden * x.element_size()  # B_comb
    return dict(tokens=tokens, hidden=hidden, experts=experts, topk=topk, bytes=moved,
                us={k: statistics.median(v) for k, v in times.items()},
                bytes_per_us={k: moved / statistics.median(v) for k, v in times.items()})


def three_digits(value: float) -> float:
    return float(f"{value:.3g}")


def write_calibration(path: Path, rates: dict) -> None:
    """Set the measured rates in a calibration file's step costs (3 significant digits)."""
    data = json.loads(path.read_text())
    preset = data.get("preset", data)
    costs = preset["step_costs"]
    costs["combine_bytes_per_us"] = three_digits(rates["megatron"])
    costs["fused_combine_bytes_per_us"] = three_digits(rates["te_fused"])
    path.write_text(json.dumps(data, indent=1) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="granite,qwen,deepseek")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seqs", default="4096,16384")
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", type=Path)
    p.add_argument("--write-calibration", type=Path, metavar="FILE")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cases = []
    for name in args.models.split(","):
        m = SHAPES[name]
        for seq in map(int, args.seqs.split(",")):
            case = measure_case(args.batch * seq, m.hidden, m.experts, m.topk,
                                args.samples, device)
            cases.append(dict(model=name, seq=seq, **case))
            print(f"{name} M={case['tokens']}: " + ", ".join(
                f"{k} {case['us'][k]:.1f} us ({case['bytes_per_us'][k] / 1e3:.0f} kB/us)"
                for k in case["us"]), flush=True)
    rates = {k: statistics.median(c["bytes_per_us"][k] for c in cases)
             for k in ("megatron", "te_fused")}
    print(f"median rates: Megatron {rates['megatron'] / 1e3:.0f} kB/us, "
          f"TE fused {rates['te_fused'] / 1e3:.0f} kB/us")
    if args.json:
        args.json.write_text(json.dumps(dict(cases=cases, rates=rates, argv=sys.argv), indent=1))
    if args.write_calibration:
        write_calibration(args.write_calibration, rates)
    return 0


if __name__ == "__main__":
    sys.exit(main())
