"""The planner's L against a captured sweep of L: regret, and predicted against measured.

    python tools/split_sweep.py docs/data/op_h200_lsweep_*.json \
        --png docs/figures/operator_h200_split_sweep.png

Reads `tools/bench_op.py --cuda-graph --graph-sweep --lset 1,2,4,8` JSON (one or more
files). Per workload: the op replayed at each swept L ("graph L=l"), the planner's own
choice replayed ("planner(graph)"), torch's GEMM2 alone replayed, and the model that ranks
L at each L (`predicted_by_splits`, compute waves). Regret = (T(planner) - T(best swept
L)) / T(best swept L), both captured in the same run: the planner's L is captured twice
(as "planner(graph)" and as its "graph L=l"), and the spread between the two is the
replays' noise, which the regret can fall below zero by; the regret within the sweep
compares the sweep's own capture of the planner's L with its best (never below zero);
`beyond_ci`: the sweep's capture of the planner's L is slower than its best with the two
medians' 95% CIs apart (bench_op's bootstrap), a loss the replays' noise cannot explain.
The figure puts each workload's
measured T(L) / T(L*) beside the ranking model's T(L) / T(L*), L* the planner's choice;
the candidates the op ranks are marked (`ops.split_candidates`).

`--replan PRESET` re-plans each workload's L with the planner of today (`Planner.plan` at
that calibration preset, on one GPU of the preset's device), its request rebuilt from the
capture's sizes and row tiles, and scores that L within the sweep's own captures (no
capture of a new L sits beside them): what a model change does to the captured
decisions before a fresh capture confirms it. Summaries come per size class too (S =
512, S >= 1024), as the targets are read.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

from megatron_overlap.ops import split_candidates
from megatron_overlap.shapes import LAYOUTS, MODELS

OP, GEMM2 = "planner(graph)", "gemm2_alone(torch,graph)"


def sweep_row(result: dict) -> dict:
    """One workload of a bench_op JSON: measured ms per swept L, predicted waves per L."""
    med = {name: s["median"] for name, s in result["stats"].items()}
    measured = {int(name.split("=")[1]): ms for name, ms in med.items()
                if name.startswith("graph L=")}
    if not measured or OP not in med:
        raise ValueError(f"{result['case']}: no captured L sweep (run bench_op.py with "
                         f"--cuda-graph --graph-sweep --lset ...)")
    predicted = {int(l): t for l, t in result.get("predicted_by_splits", {}).items()}
    best = min(measured, key=measured.get)
    op = med[OP]
    ci = {int(name.split("=")[1]): (s.get("ci_low"), s.get("ci_high"))
          for name, s in result["stats"].items() if name.startswith("graph L=")}
    chosen_low, best_high = ci.get(result["splits"], (None,))[0], ci[best][1]
    return dict(case=result["case"], chosen=result["splits"], best=best, op_ms=op,
                gemm2_ms=med.get(GEMM2), measured=measured, predicted=predicted,
                regret=(op - measured[best]) / measured[best],
                # the planner's L against the best within the sweep's own captures (>= 0)
                sweep_regret=(measured[result["splits"]] - measured[best]) / measured[best]
                if result["splits"] in measured else None,
                beyond_ci=None if chosen_low is None or best_high is None
                else chosen_low > best_high, ci=ci, seq=result.get("seq"),
                candidates=split_candidates(MODELS[result["model"]].hidden))


def replanned(result: dict, preset: str) -> tuple[int, dict[int, float]]:
    """(the L the op's planner gives a captured workload now at calibration `preset`, the
    ranking model's T at each candidate L): the request rebuilt from the capture (M = B S,
    the rank's rows from GEMM2's FLOPs, row tiles from W_comp at the captured L; B = 4,
    the benchmarks')."""
    import torch

    from megatron_overlap.ops import (GPU_TILES, ROOFLINE_CANDIDATES, OverlapConfig,
                                      Planner, PlanRequest)
    from megatron_overlap.planner import get_preset

    shape = MODELS[result["model"]]
    tp, ep = {**LAYOUTS, "TP1EP1": (1, 1)}[result["layout"]]
    n, k, tokens = shape.hidden, shape.ffn_per_rank(tp), 4 * result["seq"]
    rows = result["gemm_flops"] // (2 * n * k)
    row_tiles = result["w_comp"] // math.ceil(math.ceil(n / result["splits"]) / 128)
    request = PlanRequest(
        OverlapConfig(preset=preset), GPU_TILES, torch.device("cpu"), "interpret", row_tiles,
        shape.local_experts(ep), tokens, n, k, result["world"], shape.topk,
        round(4 * rows / tokens) / 4, None, None)
    planner = Planner(for_device=get_preset(preset).device)  # (one GPU of it, planned here)
    return (planner.plan(request).splits,
            planner.split_predictions(request, tuple(ROOFLINE_CANDIDATES)))


def replanned_row(row: dict, splits: int, predicted: dict | None = None) -> dict:
    """`sweep_row` with the planner's L (and its model's T(L)) replaced: regret within the
    sweep's captures."""
    regret = row["measured"][splits] / row["measured"][row["best"]] - 1
    ci = row["ci"]
    return dict(row, chosen=splits, regret=regret, sweep_regret=regret,
                beyond_ci=ci[splits][0] > ci[row["best"]][1],
                predicted=row["predicted"] if predicted is None else predicted)


def summary(rows: list[dict]) -> dict:
    regrets = [r["regret"] for r in rows]
    within = [r["sweep_regret"] for r in rows if r["sweep_regret"] is not None]
    return dict(workloads=len(rows), mean_regret=statistics.fmean(regrets),
                max_regret=max(regrets),
                mean_sweep_regret=statistics.fmean(within) if within else None,
                max_sweep_regret=max(within) if within else None,
                chosen_is_best=sum(r["chosen"] == r["best"] for r in rows),
                slower_beyond_ci=sum(r["beyond_ci"] is True for r in rows))


def table(rows: list[dict]) -> list[str]:
    ls = sorted({l for r in rows for l in r["measured"]})
    out = ["| workload | L* (best swept) | op / torch GEMM2 | regret (within the sweep) | "
           "measured ms at L = " + ", ".join(map(str, ls)) + " | model T(L) / T(L*) |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['op_ms'] / r['gemm2_ms']:.2f}" if r["gemm2_ms"] else ""
        ms = " / ".join(f"{r['measured'][l]:.3f}" if l in r["measured"] else "-" for l in ls)
        t_star = r["predicted"].get(r["chosen"])
        model = " / ".join(f"{r['predicted'][l] / t_star:.3f}" for l in ls
                           if l in r["predicted"]) if t_star else ""
        out.append(f"| {r['case']} | {r['chosen']} ({r['best']}) | {ratio} | "
                   f"{100 * r['regret']:+.1f}% ({100 * (r['sweep_regret'] or 0):.1f}%) | "
                   f"{ms} | {model} |")
    return out


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for r in rows:
        ls = sorted(r["measured"])
        m_star = r["measured"][r["chosen"]]
        line, = ax.plot(ls, [r["measured"][l] / m_star for l in ls], "o-", lw=1, alpha=0.7)
        t_star = r["predicted"].get(r["chosen"])
        if t_star:
            pl = [l for l in ls if l in r["predicted"]]
            ax.plot(pl, [r["predicted"][l] / t_star for l in pl], "x--", lw=0.8,
                    color=line.get_color(), alpha=0.7)
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xlabel("splits L")
    ax.set_ylabel("T(L) / T(planner's L)")
    ax.set_title("measured (o, replayed) and the ranking model (x) over L, per workload")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _print_summary(label: str, rows: list[dict]) -> None:
    s = summary(rows)
    print(f"{label}: {s['workloads']} workloads: regret mean {100 * s['mean_regret']:.2f}%, "
          f"max {100 * s['max_regret']:.2f}% (within the sweep's captures: mean "
          f"{100 * (s['mean_sweep_regret'] or 0):.2f}%, max "
          f"{100 * (s['max_sweep_regret'] or 0):.2f}%); the planner's L the fastest swept "
          f"in {s['chosen_is_best']}, slower than the best beyond both 95% CIs in "
          f"{s['slower_beyond_ci']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", help="bench_op.py JSON files")
    ap.add_argument("--png", help="write the figure here")
    ap.add_argument("--replan", metavar="PRESET",
                    help="score the L the planner of today gives each capture instead")
    args = ap.parse_args(argv)
    results = []
    for path in args.json:
        with open(path) as f:
            results += json.load(f)["results"]
    rows = [sweep_row(r) for r in results]
    if args.replan:
        rows = [replanned_row(row, *replanned(r, args.replan))
                for row, r in zip(rows, results)]
    print("\n".join(table(rows)))
    print()
    sized = [r for r in rows if r["seq"] is not None]
    for label, part in (("S = 512", [r for r in sized if r["seq"] < 1024]),
                        ("S >= 1024", [r for r in sized if r["seq"] >= 1024]), ("all", rows)):
        if part:
            _print_summary(label, part)
    if args.png:
        plot(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
