"""The one-GPU operator against its physical bounds: a table and a roofline-style figure
from a `tools/bench_op.py --cuda-graph` JSON (one rank: no reduce-scatter).

    python tools/roofline.py docs/data/op_h200_tp1ep1_graph_TP1EP1.json \
        --png docs/figures/operator_h200_tp1ep1_roofline.png

Per workload: GEMM2's FLOPs (2 T N K) and the fewest bytes the op must move (x, the
local weights and the output once each: y never leaving the chip), the bytes it moves
today (y written by GEMM2 and read back by the combine, the output written once), and
the time bound of each, max(FLOPs / tensor rate, bytes / copy bandwidth), at the rates
measured on the device (a large bf16 matmul 790 TFLOP/s, a device copy 4.3 TB/s on one
H200; `--tflops`, `--tbs` for another). Against them: the op and torch's GEMM2 alone,
both replayed from CUDA graphs (GPU work only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from workloads import LAYOUT_SIZES, SHAPES  # noqa: E402

from megatron_overlap.shapes import BATCH  # noqa: E402

OP, GEMM2 = "planner(graph)", "gemm2_alone(torch,graph)"


def op_bytes(row: dict, element_bytes: int = 2) -> dict:
    """The bytes of each tensor of a workload row (model, layout, seq, gemm_flops; bf16):
    x [T, K], the local weights w [E_local, N, K], y [T, N] and the output [M, N]."""
    shape = SHAPES[row["model"]]
    tp, ep = LAYOUT_SIZES[row["layout"]]
    tokens = row.get("batch", BATCH) * row["seq"]  # M
    k_rank, e_local, n = shape.ffn_per_rank(tp), shape.local_experts(ep), shape.hidden
    t_rows = row["gemm_flops"] // (2 * n * k_rank)  # T: rows of x
    e = element_bytes
    return dict(x=t_rows * k_rank * e, w=e_local * n * k_rank * e, y=t_rows * n * e,
                out=tokens * n * e)


def bounds(row: dict, tflops: float, tbs: float) -> dict:
    """FLOPs, bytes (fused: y on chip; today: y through HBM) and their time bounds (ms)."""
    b = op_bytes(row)
    fused = b["x"] + b["w"] + b["out"]
    today = fused + 2 * b["y"]  # + y written and read back
    flop_ms = row["gemm_flops"] / (tflops * 1e9)
    return dict(flops=row["gemm_flops"], bytes_fused=fused, bytes_today=today,
                bound_fused_ms=max(flop_ms, fused / (tbs * 1e9)),
                bound_today_ms=max(flop_ms, today / (tbs * 1e9)), flop_ms=flop_ms)


def table(rows: list[dict], tflops: float, tbs: float) -> list[str]:
    out = ["| workload | GEMM2 GFLOP | bytes fused / today (MB) | bound fused / today (ms) "
           "| torch GEMM2 (ms, TFLOP/s) | op (ms, TFLOP/s) | op / GEMM2 | op / bound today |",
           "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        b, med = bounds(row, tflops, tbs), {n: s["median"] for n, s in row["stats"].items()}
        g, op = med[GEMM2], med[OP]
        out.append(f"| {row['case']} | {b['flops'] / 1e9:.0f} | {b['bytes_fused'] / 1e6:.0f} / "
                   f"{b['bytes_today'] / 1e6:.0f} | {b['bound_fused_ms']:.3f} / "
                   f"{b['bound_today_ms']:.3f} | {g:.3f}, {b['flops'] / g / 1e9:.0f} | "
                   f"{op:.3f}, {b['flops'] / op / 1e9:.0f} | {op / g:.2f} | "
                   f"{op / b['bound_today_ms']:.2f} |")
    return out


def figure(rows: list[dict], tflops: float, tbs: float, path: str) -> None:
    """Achieved TFLOP/s of GEMM2's FLOPs against arithmetic intensity (FLOP per byte the
    op must move), under the roof min(tensor rate, intensity x bandwidth)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [2 ** (i / 4) for i in range(16, 44)]
    ax.plot(xs, [min(tflops, x * tbs) for x in xs], "k-", lw=1, label="roof (790 TFLOP/s, 4.3 TB/s)")
    for name, marker, key in (("torch GEMM2 alone", "s", GEMM2), ("op (fused combine)", "o", OP)):
        pts = [(bounds(r, tflops, tbs), r["stats"][key]["median"]) for r in rows]
        xs_, ys_ = ([b["flops"] / b["bytes_fused"] for b, _ in pts],
                    [b["flops"] / t / 1e9 for b, t in pts])
        ax.scatter(xs_, ys_, marker=marker, label=name)
        if key == OP:  # (which workload each pair is)
            for r, x, y in zip(rows, xs_, ys_):
                ax.annotate(f"{r['model']} {r['seq'] // 1024}k", (x, y), fontsize=7,
                            textcoords="offset points", xytext=(4, -10))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GEMM2 FLOP per byte the op must move (y on chip)")
    ax.set_ylabel("GEMM2 TFLOP/s achieved")
    ax.set_title("One H200, every expert on the GPU (TP1EP1), CUDA-graph replays")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("--png", default="")
    ap.add_argument("--tflops", type=float, default=790.0)
    ap.add_argument("--tbs", type=float, default=4.3)
    args = ap.parse_args()
    rows = [r for r in json.load(open(args.json))["results"] if r.get("world", 1) == 1]
    print("\n".join(table(rows, args.tflops, args.tbs)))
    if args.png:
        figure(rows, args.tflops, args.tbs, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
