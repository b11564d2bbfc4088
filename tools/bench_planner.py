"""Planner decision time in microseconds: cold (the full model) and cached.

    python tools/bench_planner.py [--json out.json]

Cold: `plan()` on a validated Workload (the solver, as the CLI's `solver_us`), and
end to end from a list of per-expert counts (validation + tile reduction + solve).
Cached: `PlanCache.decide_tiles` (the look-up the op does once it holds the row-tile
count) and `PlanCache.decide` from raw counts (adds the O(E) reduction of the counts).
Each figure is the median over 21 batches of 2000 calls (min in brackets): this machine
is shared and noisy, so the median of batch means is the stable number.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

from megatron_overlap.planner import A100_PAPER, PlanCache, Workload, expert_row_tiles, plan
from megatron_overlap.routing import expert_counts, route
from megatron_overlap.shapes import MODELS


def per_call_us(fn, calls: int = 2000, batches: int = 21) -> tuple[float, float]:
    samples = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples), min(samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    pr = A100_PAPER
    rows = []
    for key, shape in MODELS.items():
        tokens, world, tp = 4 * 4096, 2, 2
        counts = expert_counts(route(tokens, shape.experts, shape.topk, "p90"), shape.experts)
        counts = counts.tolist()
        k = shape.ffn_per_rank(tp)
        w = Workload(tokens, shape.hidden, k, world, shape.default_splits, counts)
        cache = PlanCache(pr.kernel, pr.device, pr.calibration)
        tiles = expert_row_tiles(counts, pr.kernel.tile_m)
        cache.decide(tokens, shape.hidden, k, world, shape.default_splits, counts)
        r = {
            "model": shape.name, "experts": len(counts), "splits": shape.default_splits,
            "cold_solver_us": per_call_us(lambda: plan(w, pr.kernel, pr.device, pr.calibration)),
            "cold_from_counts_us": per_call_us(lambda: plan(
                Workload(tokens, shape.hidden, k, world, shape.default_splits, counts),
                pr.kernel, pr.device, pr.calibration)),
            "cached_tiles_us": per_call_us(lambda: cache.decide_tiles(
                tiles, tokens, shape.hidden, k, world, shape.default_splits, len(counts))),
            "cached_from_counts_us": per_call_us(lambda: cache.decide(
                tokens, shape.hidden, k, world, shape.default_splits, counts)),
        }
        rows.append(r)
    cpu = platform.processor() or platform.machine()
    print(f"python {sys.version.split()[0]} on {cpu}, preset {pr.name} (C_max="
          f"{pr.calibration.c_max}); median [min] us per decision")
    cols = ["cold_solver_us", "cold_from_counts_us", "cached_tiles_us", "cached_from_counts_us"]
    print("| model | E | L | " + " | ".join(c.removesuffix("_us") for c in cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    for r in rows:
        cells = " | ".join(f"{r[c][0]:.2f} [{r[c][1]:.2f}]" for c in cols)
        print(f"| {r['model']} | {r['experts']} | {r['splits']} | {cells} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"python": sys.version, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
