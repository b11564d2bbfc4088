"""The fuse-or-not model's host terms for a device, fitted on recorded prefill runs (CPU
only, JSON in, text out): the calibration step `tools/calibrate.py` does not measure.

    python tools/fit_fusion.py fit --prefill h200-1gpu-overlap,h200x2-nothreshold --preset h200
    python tools/fit_fusion.py check --prefill h200x2-nothreshold --preset h200

Input: complete-model prefill runs with the overlap on at every size
(`python -m megatron_overlap.mcore.prefill ... --abba --json`, the layer's fuse-or-not
off: `--moe-overlap-fuse always`), one list of rows per file named `prefill_TAG_*.json`
under `--data` (the recorded runs of the shipped files are in tests/data/, README there).

fit: the step costs' host terms that decide the recorded workloads as measured. For each
workload (model, layout, S; the median speedup over its runs) the fused path's predicted
saving with no host term; a workload measured faster (slower) fused beyond `--noise`
bounds the host term from above (below). H_op (`op_host_us`) is fitted on the one-rank
workloads, then H_group (`group_host_us`) on the others; each is the midpoint of the
range that decides every workload as measured, or the two bounds that conflict.
check: per workload the measured speedup beside the decision `--preset`'s step costs give,
and the decisions the measurement contradicts.
The decision is rebuilt on the planner as the op plans on Hopper (the shared placement's
tiles with tail helpers, uniform routing, L ranked as the op ranks it).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import statistics
import sys

from megatron_overlap.ops import GPU_TILES, rank_splits
from megatron_overlap.planner import (DeviceSpec, KernelSpec, Workload, decide_fusion,
                                      get_preset, plan, ranking_calibration)
from megatron_overlap.shapes import MODELS

DATA = os.path.join(os.path.dirname(__file__), "..", "tests", "data")


def fusion_replay(r: dict, preset, stock_launches: int = 0):
    """The layer's fuse-or-not decision for one recorded prefill workload `r` (its
    model, tp, ep, tokens; `sms` where the run had fewer than the device)."""
    shape = MODELS[r["model"]]
    tp, ep = r["tp"], r["ep"]
    world, tokens, topk = tp * ep, r["tokens"], shape.topk
    local = shape.local_experts(ep)
    rows = tokens * topk * local // shape.experts
    ffn = shape.ffn_per_rank(tp)
    sms = preset.device.sms if r.get("sms") is None else r["sms"]
    device = DeviceSpec(preset.device.name, sms)
    tiles = GPU_TILES if ep == 1 else dataclasses.replace(GPU_TILES, token_major=False)

    def planned(splits: int, ranking: bool):
        comm_tm, comm_tn = tiles.comm_shape(topk, -(-shape.hidden // splits))
        kernel = KernelSpec(tiles.block_m, tiles.block_n, comm_tm, comm_tn, 2, 1,
                            not ranking, True)
        w = Workload.from_total(tokens=tokens, hidden=shape.hidden, ffn=ffn, world=world,
                                splits=splits, total_assignments=rows, local_experts=local)
        w = dataclasses.replace(w, topk=topk, local_topk=round(4 * rows / tokens) / 4)
        calib = ranking_calibration(preset.calibration) if ranking else preset.calibration
        return w, kernel, plan(w, kernel, device, calib)

    splits = rank_splits(shape.hidden, lambda cand: planned(cand, True)[2].predicted)
    w, kernel, chosen = planned(splits, False)
    return decide_fusion(w, chosen, kernel, device, preset.calibration, preset.step_costs,
                         element_bytes=2, stock_launches=stock_launches)


def workloads(tags: str, data: str, overlapped_only: bool = False) -> dict:
    """{(model, tp, ep, seq): [rows]} of the runs `prefill_TAG_*.json` under `data` that
    recorded a speedup (`overlapped_only`: and where a layer overlapped)."""
    runs: dict = {}
    for tag in tags.split(","):
        for path in sorted(glob.glob(os.path.join(data, f"prefill_{tag}_*.json"))):
            with open(path) as f:
                loaded = json.load(f)
            for r in (loaded if isinstance(loaded, list) else [loaded]):
                if r.get("speedup") and (not overlapped_only or any(
                        "C" in d for d in r.get("decisions_rank0", ()))):
                    runs.setdefault((r["model"], r["tp"], r["ep"], r["seq"]), []).append(r)
    if not runs:
        raise SystemExit(f"no prefill rows for {tags!r} under {data}")
    return runs


def check(runs: dict, preset, noise: float) -> int:
    """Prints each workload's measured speedup and decision; returns how many the
    measurement contradicts beyond `noise` (within it either decision agrees)."""
    wrong = 0
    for key in sorted(runs, key=lambda k: (k[0], k[3])):
        speedup = statistics.median(r["speedup"] for r in runs[key])
        d = fusion_replay(runs[key][0], preset)
        against = (speedup < 1 - noise) if d.fuse else (speedup > 1 + noise)
        wrong += against
        print(f"  {key[0]:9s} TP{key[1]}EP{key[2]} S={key[3]:5d}: measured "
              f"{speedup:.3f} over {len(runs[key])}, {'fuse ' if d.fuse else 'stock'} "
              f"(fused {d.fused_us:7.1f} us, unfused {d.unfused_us:7.1f} us)"
              f"{'  <- against the measurement' if against else ''}")
    print(f"{len(runs) - wrong} of {len(runs)} workloads decided as measured (within "
          f"{noise:.0%} of 1.0 either decision agrees)")
    return wrong


def fit(runs: dict, preset, noise: float) -> None:
    """Prints, per host term, the range that decides every workload as measured and its
    midpoint (H_group fitted with H_op at its midpoint), or the bounds that conflict."""
    bare = dataclasses.replace(preset, step_costs=dataclasses.replace(
        preset.step_costs, op_host_us=0.0, group_host_us=0.0))
    fitted = 0.0
    for multi in (False, True):
        lo, hi = 0.0, math.inf
        for key, rs in runs.items():
            if (key[1] * key[2] > 1) != multi:
                continue
            d = fusion_replay(rs[0], bare)
            saving = d.unfused_us - d.fused_us - (fitted if multi else 0.0)
            speedup = statistics.median(r["speedup"] for r in rs)
            if speedup > 1 + noise:
                hi = min(hi, saving)
            elif speedup < 1 - noise:
                lo = max(lo, saving)
        name = "group_host_us" if multi else "op_host_us"
        if hi == math.inf and lo == 0.0:
            print(f"{name}: no workload of this kind")
            continue
        mid = (lo + hi) / 2 if hi < math.inf else lo
        print(f"{name}: every decision as measured for values in ({lo:.1f}, {hi:.1f}); "
              f"midpoint {mid:.1f}" if lo < hi else
              f"{name}: no value decides every workload as measured (need > {lo:.1f} and "
              f"< {hi:.1f})")
        if not multi:
            fitted = mid


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("fit", "check"))
    ap.add_argument("--prefill", required=True, help="prefill run tags, comma-separated")
    ap.add_argument("--preset", default="h200")
    ap.add_argument("--noise", type=float, default=0.03,
                    help="speedups within this of 1.0 agree with either decision")
    ap.add_argument("--overlapped-only", action="store_true",
                    help="only the workloads where the overlap ran")
    ap.add_argument("--data", default=DATA)
    args = ap.parse_args()
    runs = workloads(args.prefill, args.data, args.overlapped_only)
    preset = get_preset(args.preset)
    if args.what == "fit":
        fit(runs, preset, args.noise)
    else:
        check(runs, preset, args.noise)
    return 0


if __name__ == "__main__":
    sys.exit(main())
