"""The fuse-or-not grid (stage `grid` of tools/device_run.sh) as a table and a figure.

    python tools/report_grid.py --data docs/data --device h200 --out build/grid

Reads grid_{device}_*_{prefill,train}_{model}_B{b}.json (one device's grid: the cards'
points are not one population) (megatron_overlap.mcore.prefill --abba
--json over several S); writes OUT/grid.md (one row per point: off = the stock path,
on = the planner's per-size choice, on / off measured, the decision with its predicted
saving, the host syncs per MoE layer call where the run counted them) and
OUT/grid_on_over_off.png (on / off across S per model, measured and as the model
predicts it: off / (off - the predicted saving of every MoE layer)). Where a run timed
Megatron's MoE fusions too (`--baselines default,fused`, stage `grid` with GRID_FUSED=1, files
`gridfused_{device}_*`: `--prefix gridfused`), each row adds on / off with both arms
under those flags, and the summary its geomean.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re

NAME = re.compile(r"_(prefill|train)_([a-z]+)_B(\d+)\.json$")


def load_points(data: str, device: str, prefix: str = "grid") -> list[dict]:
    """Every grid point of `device`'s grid files under `data` ({prefix}_{device}_*.json),
    sorted by mode, model, B, S."""
    points = []
    for path in glob.glob(os.path.join(data, f"{prefix}_{device}_*.json")):
        match = NAME.search(path)
        if not match:
            continue
        with open(path) as f:
            results = json.load(f)
        for r in results if isinstance(results, list) else [results]:
            if r.get("oom"):
                continue
            points.append(_point(match.group(1), r))
    return sorted(points, key=lambda p: (p["mode"], p["model"], p["batch"], p["seq"]))


def _point(mode: str, r: dict) -> dict:
    off = r["policies"]["stock"]["median_ms"]
    on = r["policies"]["overlap"]["median_ms"]
    layers = r.get("decisions_rank0", [])
    fused = [d for d in layers if d.get("fuse")]
    # (the model prices each layer's forward; a training step's backward is not priced)
    saved_ms = sum(d["unfused_us"] - d["fused_us"] for d in fused) / 1e3
    costs = r.get("host_costs", {})
    return dict(mode=mode, model=r["model"], batch=r["batch"], seq=r["seq"], off=off, on=on,
                ratio=off / on, fused=f"{len(fused)}/{len(layers)}",
                first=layers[0] if layers else None, predicted_saved_ms=saved_ms,
                predicted_ratio=off / (off - saved_ms) if off > saved_ms else math.inf,
                fused_ratio=r.get("speedups_by_baseline", {}).get("fused"),
                syncs={k: v["syncs_per_call"] for k, v in costs.items()},
                host_us={k: v["host_us_per_call"] for k, v in costs.items()})


def table(points: list[dict]) -> str:
    tuned = any(p["fused_ratio"] for p in points)  # (Megatron's MoE fusions timed too)
    head = ("| mode | model | B | S | off ms | on ms | on / off | fused layers | first layer "
            "predicted fused / unfused us | predicted saving ms (fwd) | measured saving ms "
            "| syncs per MoE call off / on |" + (" on / off, fused MoE flags |" if tuned else "")
            + "\n|" + "---|" * (13 if tuned else 12))
    rows = [head]
    for p in points:
        d = p["first"] or {}
        syncs = (f"{p['syncs']['stock']:.0f} / {p['syncs']['overlap']:.0f}"
                 if {"stock", "overlap"} <= set(p["syncs"]) else "")
        rows.append(f"| {p['mode']} | {p['model']} | {p['batch']} | {p['seq']} | "
                    f"{p['off']:.1f} | {p['on']:.1f} | {p['ratio']:.2f}x | {p['fused']} | "
                    f"{d.get('fused_us', '')} / {d.get('unfused_us', '')} | "
                    f"{p['predicted_saved_ms']:.1f} | {p['off'] - p['on']:.1f} | {syncs} |"
                    + (f" {p['fused_ratio'] or 0:.2f}x |" if tuned else ""))
    return "\n".join(rows)


def summary(points: list[dict]) -> str:
    lines = []
    for mode in sorted({p["mode"] for p in points}):
        sel = [p for p in points if p["mode"] == mode]
        big = [p["ratio"] for p in sel if p["seq"] >= 4096]
        geo = math.exp(sum(map(math.log, big)) / len(big)) if big else float("nan")
        lines.append(f"{mode}: min on/off {min(p['ratio'] for p in sel):.3f}x over {len(sel)} "
                     f"points; geomean at S >= 4096 {geo:.3f}x" + _fused_summary(sel))
    return "\n".join(lines)


def _fused_summary(sel: list[dict]) -> str:
    """The same min and geomean with both arms under Megatron's MoE fusions, where timed."""
    tuned = [p for p in sel if p["fused_ratio"]]
    if not tuned:
        return ""
    big = [p["fused_ratio"] for p in tuned if p["seq"] >= 4096]
    geo = math.exp(sum(map(math.log, big)) / len(big)) if big else float("nan")
    return (f"; fused MoE flags: min {min(p['fused_ratio'] for p in tuned):.3f}x over "
            f"{len(tuned)} points, geomean at S >= 4096 {geo:.3f}x")


def figure(points: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({p["mode"] for p in points})
    models = sorted({p["model"] for p in points})
    fig, axes = plt.subplots(len(modes), len(models), figsize=(4 * len(models), 3.2 * len(modes)),
                             squeeze=False, sharey=True)
    for i, mode in enumerate(modes):
        for j, model in enumerate(models):
            ax = axes[i][j]
            for b in sorted({p["batch"] for p in points}):
                sel = [p for p in points if (p["mode"], p["model"], p["batch"]) == (mode, model, b)]
                if not sel:
                    continue
                s = [p["seq"] for p in sel]
                line, = ax.plot(s, [p["ratio"] for p in sel], "o-", label=f"B={b} measured")
                ax.plot(s, [min(p["predicted_ratio"], 3) for p in sel], "x--",
                        color=line.get_color(), label=f"B={b} predicted (fwd)")
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{model}, {mode}")
            ax.set_xlabel("S (tokens per sequence)")
            if j == 0:
                ax.set_ylabel("on / off (x)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="docs/data")
    p.add_argument("--device", default="h200", help="the files' device tag (grid_DEVICE_*)")
    p.add_argument("--prefix", default="grid",
                   help="the files' prefix: grid (stage grid), gridfused (grid, GRID_FUSED=1)")
    p.add_argument("--out", default="build/grid")
    args = p.parse_args()
    points = load_points(args.data, args.device, args.prefix)
    if not points:
        raise SystemExit(f"no {args.prefix}_{args.device}_*_{{prefill,train}}_*_B*.json "
                         f"under {args.data}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "grid.md"), "w") as f:
        f.write(table(points) + "\n\n" + summary(points) + "\n")
    figure(points, os.path.join(args.out, "grid_on_over_off.png"))
    print(summary(points))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
