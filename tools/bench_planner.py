"""Planner decision time in microseconds: cold (the full model) and cached.

    python tools/bench_planner.py [--json out.json] [--cli-runs N]

Three planner configurations, each on the three models (B=4, S=4096, TP2, D=2, p90-like
routing, every expert local):
  * a100-paper: the paper's preset, partition placement (16 candidates of C);
  * h200 op: what the op plans every launch with on an H200 (ops.Planner for the H200):
    the shipped calibration (overlap factor f included), GPU_TILES' shared placement
    (KernelSpec.shared_sms: C = 1..132) with the tail helpers, each L's own comm tile
    (TileConfig.comm_shape), local_topk = k (TP), at the L the op ranks best;
  * h200 op ranking: the wave model the op ranks L with (ranking_calibration, no tail
    helpers; on the H200 the op takes the max of it and the splits' roofline).
The two h200 configurations run at the L the op plans (`Planner.plan`).
Cold: `plan()` on a validated Workload (the solver, as the CLI's `solver_us`), and end
to end from a list of per-expert counts (validation + tile reduction + solve). Cached:
`PlanCache.decide_tiles` (the look-up the op does once it holds the row-tile count) and
`PlanCache.decide` from raw counts (adds the O(E) reduction of the counts). h200 op only,
the op's own planner (`ops.Planner.plan`) (on this CPU: the interpreter's backend, GPU_TILES'
shared placement, the shipped h200 calibration, and the H200's DeviceSpec in place of the
interpreter's virtual device), each call a launch whose every decision cache misses:
op_miss, a routing not seen before (row_tiles new each call) at sizes seen before, what
the op pays when its routing changes (ranking its candidates of L, L = 1, 2, 4, 8 with
the splits' roofline, then the chosen L); op_new_sizes, also M not seen before (a new
token count each call, as batches of varying length give: the shape's predictors are
kept without M, so each call recomputes what reads M at every L). Kernel families and
plan caches persist, as in the op.
Each figure is the median over 21 batches of 2000 calls (500 for the op's launches; min
in brackets): this machine is shared and noisy, so the median of batch means is the
stable number. Before timing, each configuration's curve is checked against the literal
recurrence (`makespan`).

Then the CLI: `solver_us` as `python -m megatron_overlap plan ... --json` reports it, one
fresh interpreter per run (median [min] over --cli-runs runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from megatron_overlap.ops import GPU_TILES, OverlapConfig, Planner, PlanRequest
from megatron_overlap.planner import (A100_PAPER, Calibration, DeviceSpec, KernelSpec,
                                      PlanCache, Workload, compute_slots, expert_row_tiles,
                                      get_preset, makespan, plan, ranking_calibration,
                                      tail_ctas)
from megatron_overlap.routing import expert_counts, route
from megatron_overlap.shapes import MODELS

TOKENS, WORLD, TP = 4 * 4096, 2, 2


@dataclass(frozen=True)
class Config:
    """One planner configuration; `op` builds the kernel per L as the op does."""

    name: str
    kernel: KernelSpec
    device: DeviceSpec
    calib: Calibration
    op: bool = False  # comm tile per L from GPU_TILES, shared placement

    @functools.lru_cache(maxsize=None)  # (the op's buffer keeps one spec per kernel)
    def kernel_at(self, hidden: int, topk: int, splits: int) -> KernelSpec:
        if not self.op:
            return self.kernel
        comm_tm, comm_tn = GPU_TILES.comm_shape(topk, -(-hidden // splits))
        return KernelSpec(GPU_TILES.block_m, GPU_TILES.block_n, comm_tm, comm_tn,
                          self.kernel.o_comp, self.kernel.o_comm, self.kernel.tail_helpers,
                          shared_sms=True)


#: the op's planner, as a session holds it (its caches are what `op_miss` times)
OP_PLANNER = Planner(for_device=get_preset("h200").device)  # (the H200's plans, here)

def configs() -> list[Config]:
    h200 = get_preset("h200")
    op = dataclasses.replace(h200.kernel, tail_helpers=True)
    return [
        Config("a100-paper", A100_PAPER.kernel, A100_PAPER.device, A100_PAPER.calibration),
        Config("h200 op", op, h200.device, h200.calibration, op=True),
        Config("h200 op ranking", h200.kernel, h200.device,
               ranking_calibration(h200.calibration), op=True),
    ]


def per_call_us(fn, calls: int = 2000, batches: int = 21) -> tuple[float, float]:
    samples = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples), min(samples)


def check_against_recurrence(w: Workload, kernel: KernelSpec, device: DeviceSpec,
                             calib: Calibration) -> None:
    """The plan's T(C) against `makespan` at every C (1e-12), C* among its least."""
    d = plan(w, kernel, device, calib)
    top = max(calib.c_max, device.available_sms) if kernel.shared_sms else calib.c_max
    ref = {c: makespan(d.w_comp, d.w_comm, compute_slots(c, kernel, device), c, w.splits,
                       d.rho, calib.c_sat, tail_ctas(c, kernel, device, top),
                       calib.overlap_factor) for c, _ in d.curve}
    assert all(abs(t - ref[c]) <= 1e-12 * ref[c] for c, t in d.curve), "curve != recurrence"
    t_min = min(ref.values())
    assert ref[d.comm_ctas] - t_min <= 1e-9 * t_min and d.predicted == dict(d.curve)[d.comm_ctas]


def bench_row(cfg: Config, shape) -> dict:
    """One configuration on one model, at the L the op plans where `cfg` is the op's."""
    counts = expert_counts(route(TOKENS, shape.experts, shape.topk, "p90"), shape.experts)
    counts = counts.tolist()
    k, topk, local_topk = shape.ffn_per_rank(TP), shape.topk, float(shape.topk)

    def workload(splits: int) -> Workload:
        return Workload(TOKENS, shape.hidden, k, WORLD, splits, counts, topk=topk,
                        local_topk=local_topk)

    row_tiles = expert_row_tiles(counts, GPU_TILES.block_m)
    # the op's own L (its ranking: the wave model and, on the H200, the splits' roofline)
    splits = OP_PLANNER.plan(op_request(shape, row_tiles)).splits if cfg.op else shape.default_splits
    kernel, device, calib = cfg.kernel_at(shape.hidden, topk, splits), cfg.device, cfg.calib
    w = workload(splits)
    check_against_recurrence(w, kernel, device, calib)
    cache = PlanCache(kernel, device, calib)
    tiles = expert_row_tiles(counts, kernel.tile_m)
    decide = dict(topk=topk, local_topk=local_topk)
    cache.decide(TOKENS, shape.hidden, k, WORLD, splits, counts, **decide)
    row = {
        "config": cfg.name, "model": shape.name, "experts": len(counts), "splits": splits,
        "C*": plan(w, kernel, device, calib).comm_ctas,
        "cold_solver_us": per_call_us(lambda: plan(w, kernel, device, calib)),
        "cold_from_counts_us": per_call_us(lambda: plan(workload(splits), kernel, device,
                                                        calib)),
        "cached_tiles_us": per_call_us(lambda: cache.decide_tiles(
            tiles, TOKENS, shape.hidden, k, WORLD, splits, len(counts), **decide)),
        "cached_from_counts_us": per_call_us(lambda: cache.decide(
            TOKENS, shape.hidden, k, WORLD, splits, counts, **decide)),
    }
    if cfg.name == "h200 op":
        for name, new_sizes in (("op_miss_us", False), ("op_new_sizes_us", True)):
            launches = iter(op_requests(shape, row_tiles, new_sizes))
            row[name] = per_call_us(lambda: OP_PLANNER.plan(next(launches)), calls=500)
    return row


def op_request(shape, row_tiles: int, tokens: int = TOKENS) -> PlanRequest:
    """The op's PlanRequest for a launch of `shape` (TP2, every expert local) on the H200:
    the interpreter's backend with the H200's DeviceSpec and the shipped h200 preset."""
    k = shape.topk
    return PlanRequest(OverlapConfig(preset="h200"), GPU_TILES, torch.device("cpu"),
                       "interpret", row_tiles, shape.experts, tokens, shape.hidden,
                       shape.ffn_per_rank(TP), WORLD, k, float(k), None, None)


def op_requests(shape, row_tiles: int, new_sizes: bool, count: int = 21 * 500 + 1):
    """The op's PlanRequests for `count` launches of `shape`, each with a row_tiles not
    planned before (and a new M where `new_sizes`), after one launch that plans the
    shape's kernels and caches."""
    OP_PLANNER.plan(op_request(shape, 0))
    return [op_request(shape, row_tiles + 1 + i, TOKENS + WORLD * (i + 1 if new_sizes else 0))
            for i in range(count)]


CLI_CASES = {  # the README's example, and the h200 preset with the op's tail helpers
    "a100-paper": ["--preset", "a100-paper", "--world", "4", "--splits", "2"],
    "h200 --tail-helpers": ["--preset", "h200", "--world", "2", "--topk", "4",
                            "--tail-helpers"],
}


def cli_solver_us(extra: list[str], runs: int) -> dict[str, tuple[float, float]]:
    """solver_us and solver_first_us (the fresh interpreter's first call) of the CLI."""
    cmd = [sys.executable, "-m", "megatron_overlap", "plan", "--tokens", "16384", "--hidden",
           "2048", "--ffn", "704", "--expert-counts", "120,0,77,1000,3000", "--json", *extra]
    outs = [json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
            for _ in range(runs)]
    return {key: (statistics.median(o[key] for o in outs), min(o[key] for o in outs))
            for key in ("solver_us", "solver_first_us") if key in outs[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--cli-runs", type=int, default=11, help="fresh CLI processes per case")
    args = ap.parse_args()
    cfgs = configs()
    rows = [bench_row(cfg, shape) for cfg in cfgs for shape in MODELS.values()]
    cli = {name: cli_solver_us(extra, args.cli_runs) for name, extra in CLI_CASES.items()}
    cpu = platform.processor() or platform.machine()
    print(f"python {sys.version.split()[0]} on {cpu}; median [min] us per decision")
    cols = ["cold_solver_us", "cold_from_counts_us", "cached_tiles_us",
            "cached_from_counts_us", "op_miss_us", "op_new_sizes_us"]
    print("| config | model | E | L | C* | " + " | ".join(c.removesuffix("_us") for c in cols)
          + " |")
    print("|---|---|---|---|---|" + "---|" * len(cols))
    for r in rows:
        cells = " | ".join(f"{r[c][0]:.2f} [{r[c][1]:.2f}]" if c in r else "" for c in cols)
        print(f"| {r['config']} | {r['model']} | {r['experts']} | {r['splits']} | {r['C*']} "
              f"| {cells} |")
    print(f"\nCLI `plan --json` (one fresh interpreter per run, {args.cli_runs} runs)")
    print("| case | solver_us | solver_first_us |\n|---|---|---|")
    for name, found in cli.items():
        cells = " | ".join(f"{found[key][0]:.1f} [{found[key][1]:.1f}]" if key in found else ""
                           for key in ("solver_us", "solver_first_us"))
        print(f"| {name} | {cells} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"python": sys.version, "rows": rows, "cli_solver_us": cli}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
