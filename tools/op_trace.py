"""GatherRS's timeline inside the op: per program and split, when it arrived at the split,
when its wait for the split's readiness ended and when its items were done (the kernel's
TRACE stores, on the GPU's global timer), and what that says about the op's tail.

    torchrun --nproc-per-node 1 tools/op_trace.py --model granite,qwen,deepseek \
        --layout TP1EP1 --seqs 4096,16384 --json out/trace.json --png-dir out/trace

Per workload, at the planner's C and L (or `--splits`), the prepared launch is captured
into a CUDA graph (`--eager`: launched) and replayed `--runs` times after `--warmup`;
each replay rewrites the trace. Per run, in us from GatherRS's first arrival:
  * per split: `ready`, the earliest end of a wait that spun >= 1 us (the split's
    readiness; None where every program came after it), `done`, its last item done,
    `waited` and `worked`, the programs' time waiting on it and on its items (program-us);
  * `gemm_end`: the tail helpers' first arrival (they are queued behind GEMM2 on its
    stream, so they start when its SMs fall idle; with claimed items they may arrive at
    an earlier split first), else the last split's readiness;
  * `tail`: the last item done after gemm_end, and `backlog`: the program-us of earlier
    splits' items still being combined after gemm_end (what an earlier readiness of the
    last split cannot hide).
The JSON holds the medians over runs and the last run's raw trace; with --png-dir, a
chart per workload (a row per program: waits light, items dark, one colour per split).
Each row also holds `op_us`, the traced launch's time per run (CUDA events around the
replay; the trace's stores included, so compare rows of one run).

Variants (`Variant`), each traced after the op's own plan, a row per workload and
variant: `--tile-arms dynamic_items` each GatherRS variant of `workloads.TILE_ARMS`;
`--helper-scale 1,2` that many tail helpers per SM GEMM2 leaves (the op launches one);
`--last-split-tiles 0,1` the last split narrowed to that many GEMM2 column tiles, the
others sharing the rest in whole tiles (`narrowed_width`; 0: the even split; skipped,
with a line, where the case's L cannot). Measured with the fixed stride, a narrower last
split was slower, the split before it then exposed (docs/RESULTS.md, "Kernel choices
measured"); with claimed items the helpers share that backlog.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from benchlib import add_run_args, env_info, smoke_setup, write_json  # noqa: E402
from workloads import TILE_ARMS, OpCase, add_case_args, cases, rank_inputs, tile_arms  # noqa: E402

from megatron_overlap.kernels import gemm2  # noqa: E402
from megatron_overlap.ops import OverlapConfig, launcher  # noqa: E402
from megatron_overlap.ops.capture import CapturedCall  # noqa: E402
from megatron_overlap.ops.config import TileConfig  # noqa: E402
from megatron_overlap.ops.op import prepare  # noqa: E402
from megatron_overlap.ops.planning import default_tiles  # noqa: E402

SPIN_NS = 1000  # a wait this long or longer was a real wait for readiness, not a poll


def summarize_trace(trace: list, comm_programs: int, spin_ns: int = SPIN_NS) -> dict:
    """One run's summary (module doc) from trace[pid][split] = [arrived, wait ended, done]
    in ns (-1: the program had no item in that split); pids >= `comm_programs` are the
    tail helpers."""
    entries = [(pid, s, e) for pid, row in enumerate(trace) for s, e in enumerate(row)
               if e[0] >= 0]
    if not entries:
        raise ValueError("the trace holds no entry: was the kernel launched with it?")
    if any(not e[0] <= e[1] <= e[2] for _, _, e in entries):
        raise ValueError("a trace entry is out of order (arrived <= wait ended <= done)")
    t0, splits = min(e[0] for _, _, e in entries), len(trace[0])
    us = lambda ns: (ns - t0) / 1e3  # noqa: E731
    per_split = []
    for s in range(splits):
        mine = [e for _, k, e in entries if k == s]
        spun = [e[1] for e in mine if e[1] - e[0] >= spin_ns]
        per_split.append(dict(
            ready=us(min(spun)) if spun else None, done=us(max(e[2] for e in mine)),
            waited=sum(e[1] - e[0] for e in mine) / 1e3,
            worked=sum(e[2] - e[1] for e in mine) / 1e3, programs=len(mine)))
    helpers = [e[0] for pid, _, e in entries if pid >= comm_programs]
    gemm_end = us(min(helpers)) if helpers else per_split[-1]["ready"]
    out = dict(splits=per_split, gemm_end=gemm_end, end=us(max(e[2] for _, _, e in entries)))
    if gemm_end is not None:
        end_ns = t0 + gemm_end * 1e3
        out["tail"] = out["end"] - gemm_end
        out["backlog"] = sum(max(0.0, e[2] - max(e[1], end_ns)) for _, s, e in entries
                             if s < splits - 1) / 1e3
    return out


def median_summary(runs: list[dict]) -> dict:
    """The medians over runs of every number of `summarize_trace` (None where any run has
    none)."""
    def med(values):
        return None if any(v is None for v in values) else statistics.median(values)
    keys = [k for k in runs[0] if k != "splits"]
    out = {k: med([r.get(k) for r in runs]) for k in keys}
    out["splits"] = [{k: med([r["splits"][s][k] for r in runs]) for k in runs[0]["splits"][s]}
                     for s in range(len(runs[0]["splits"]))]
    return out


def plot(trace: list, comm_programs: int, summary: dict, title: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(e[0] for row in trace for e in row if e[0] >= 0)
    fig, ax = plt.subplots(figsize=(9, 5))
    colours = plt.get_cmap("tab10")
    for pid, row in enumerate(trace):
        for s, (a, r, d) in enumerate(row):
            if a >= 0:
                ax.barh(pid, (r - a) / 1e3, left=(a - t0) / 1e3, height=1.0,
                        color=colours(s), alpha=0.25, linewidth=0)
                ax.barh(pid, (d - r) / 1e3, left=(r - t0) / 1e3, height=1.0,
                        color=colours(s), linewidth=0, label=f"split {s}" if pid == 0 else None)
    if summary.get("gemm_end") is not None:
        ax.axvline(summary["gemm_end"], color="k", linestyle="--", label="GEMM2 ends")
    ax.axhline(comm_programs - 0.5, color="grey", linewidth=0.5)
    ax.set(xlabel="us from GatherRS's first arrival", ylabel="GatherRS program (helpers above the line)",
           title=title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass(frozen=True)
class Variant:
    """What a traced launch changes from the op's own plan: GatherRS's tiles (`arm`, one of
    `workloads.TILE_ARMS`; None: the default), the tail helpers per SM GEMM2 leaves (the
    op launches one) and the GEMM2 column tiles of the last split (0: the even split)."""

    arm: str = "default"
    tiles: TileConfig | None = None
    helper_scale: int = 1
    last_split_tiles: int = 0


class NotNarrowable(ValueError):
    """A last split that a launch's L or N cannot narrow to the asked tiles."""


def narrowed_width(hidden: int, splits: int, last_tiles: int, block_n: int) -> int | None:
    """The split width that leaves `last_tiles` GEMM2 column tiles to the last split and
    shares the rest among the others in whole tiles (Granite, N = 1024, L = 2, 1 tile:
    896 and 128 columns); None for 0 (the even split, ceil(N/L))."""
    if not last_tiles:
        return None
    if splits < 2:
        raise NotNarrowable(f"L = {splits} has no last split to narrow")
    rest_tiles = -(-(hidden - last_tiles * block_n) // block_n)
    width = -(-rest_tiles // (splits - 1)) * block_n
    try:
        gemm2.split_col_tiles(hidden, splits, width, block_n)
    except ValueError as err:  # nothing, or more than a split's width, left to the last
        raise NotNarrowable(str(err)) from err
    return width


def trace_case(case: OpCase, args, backend: str, device: str, group,
               variant: Variant = Variant()) -> dict:
    """The case's traced runs under `variant`: medians (with the op's time per run, `op_us`,
    the traced kernels replayed), the last raw trace, its plan."""
    inp = rank_inputs(case, dist.get_rank(), device)
    cfg = OverlapConfig.from_env(backend=backend, preset=args.preset)
    if variant.tiles is not None:
        cfg = dataclasses.replace(cfg, tiles=variant.tiles)
    launch = prepare(inp["x"], inp["weight"], inp["counts_list"], inp["token_index"],
                     inp["tokens"], inp["topk"], None, group, splits=args.splits, config=cfg)
    lp = launch.launch_plan
    lp = dataclasses.replace(lp, helpers=lp.helpers * variant.helper_scale)
    width = narrowed_width(inp["hidden"], lp.splits, variant.last_split_tiles,
                           lp.tiles.block_n)
    trace = torch.full((lp.plan.comm_ctas + lp.helpers, lp.splits, 3), -1, dtype=torch.int64,
                       device=device)
    out = torch.empty(inp["tokens"] // launch.world, inp["hidden"], dtype=inp["x"].dtype,
                      device=device)

    def traced():
        trace.fill_(-1)
        launcher.launch(launch.buffer, inp["x"], inp["weight"], launch.routing, lp, None, out,
                        width=width, trace=trace)
        return out
    run = traced
    if device == "cuda" and not args.eager:
        captured = CapturedCall(traced, inp["x"].device)
        if captured.error is not None:
            raise RuntimeError(f"{case.label()}: not captured ({captured.error})")
        run = captured.replay
    for _ in range(args.warmup):
        run()
    runs = []
    for _ in range(args.runs):
        op_us = timed_us(run, device)
        raw = trace.tolist()  # (a device sync)
        runs.append(dict(summarize_trace(raw, lp.plan.comm_ctas), op_us=op_us))
    return dict(case=case.label(), arm=variant.arm, helper_scale=variant.helper_scale,
                last_split_tiles=variant.last_split_tiles, split_width=width,
                model=case.model, layout=case.layout, seq=case.seq,
                routing=case.routing, comm_ctas=lp.plan.comm_ctas, helpers=lp.helpers,
                splits=lp.splits, graph=run is not traced, runs=len(runs),
                median=median_summary(runs), last_trace=raw)


def timed_us(fn, device: str) -> float:
    """One call's time in us: CUDA events around it on the GPU, the host's clock else."""
    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def int_list(text: str, lowest: int) -> list[int]:
    """A comma list of ints >= `lowest`, or ValueError."""
    values = [int(v) for v in text.split(",")]
    if min(values) < lowest:
        raise ValueError(f"{min(values)} < {lowest}")
    return values


def variants(args, backend: str) -> list[Variant]:
    """Every arm x helper scale x last-split width of the flags (the default first)."""
    base = OverlapConfig.from_env(backend=backend).tiles or default_tiles(
        backend, OverlapConfig.from_env().placement)
    arms = {"default": None, **tile_arms(args.tile_arms, base)}
    return [Variant(arm, tiles, scale, last) for (arm, tiles), scale, last in itertools.product(
        arms.items(), int_list(args.helper_scale, 1), int_list(args.last_split_tiles, 0))]


def report(row: dict, png_dir: str) -> None:
    """One line per traced row, and its chart in `png_dir` (where given)."""
    m = row["median"]
    tag = (f"{row['arm']}, helpers x{row['helper_scale']}, last split "
           f"{row['last_split_tiles'] or 'even'}")
    print(f"{row['case']} [{tag}] C={row['comm_ctas']} H={row['helpers']} L={row['splits']}: "
          f"op {m['op_us']:.1f} us, gemm_end {m['gemm_end']} us, tail {m.get('tail')} us, "
          f"backlog {m.get('backlog')} program-us; "
          + " | ".join(f"split {s}: ready {x['ready']} done {x['done']}"
                       for s, x in enumerate(m["splits"])), flush=True)
    if png_dir:
        os.makedirs(png_dir, exist_ok=True)
        name = "_".join([row["case"].replace("/", "_").replace("=", ""), row["arm"],
                         f"h{row['helper_scale']}", f"last{row['last_split_tiles']}"])
        plot(row["last_trace"], row["comm_ctas"], m, f"{row['case']} [{tag}]",
             os.path.join(png_dir, f"{name}.png"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_args(ap, model="granite", layout="TP1EP1", seqs="4096", routing="uniform")
    ap.add_argument("--splits", type=int, default=None, help="L (default: the planner's)")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--preset", default=None)
    ap.add_argument("--eager", action="store_true", help="launch instead of graph replays")
    ap.add_argument("--png-dir", default="", help="a chart per workload here (rank 0)")
    ap.add_argument("--helper-scale", default="1",
                    help="comma list: tail helpers per SM GEMM2 leaves (the op's: 1)")
    ap.add_argument("--last-split-tiles", default="0",
                    help="comma list: GEMM2 column tiles of the last split (0: the even split)")
    ap.add_argument("--tile-arms", default="",
                    help=f"comma list of GatherRS variants also traced ({', '.join(TILE_ARMS)})")
    add_run_args(ap)
    args = ap.parse_args()
    if args.runs < 1 or args.warmup < 0 or (args.splits is not None and args.splits < 1):
        ap.error("--runs must be >= 1, --warmup >= 0 and --splits >= 1")
    try:  # (checked before any process starts)
        variants(args, "interpret")
    except ValueError as err:
        ap.error(f"--helper-scale (ints >= 1), --last-split-tiles (ints >= 0), --tile-arms: "
                 f"{err}")
    backend, device = smoke_setup(args)
    results = []
    for case, variant in itertools.product(cases(args), variants(args, backend)):
        try:
            row = trace_case(case, args, backend, device, dist.group.WORLD, variant)
        except NotNarrowable as err:
            print(f"{case.label()} [{variant.arm}, last split {variant.last_split_tiles}]: "
                  f"skipped ({err})", flush=True)
            continue
        results.append(row)
        if dist.get_rank() == 0:
            report(row, args.png_dir)
    if dist.get_rank() == 0:
        write_json(args.json, dict(env=env_info(), command=" ".join(sys.argv), results=results))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
