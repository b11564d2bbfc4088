"""Megatron-LM's own training loop, stock against `--moe-overlap`, from the recipes.

    python tools/train_loop.py --megatron-lm ~/Megatron-LM --json out/train_loop.json
    python tools/train_loop.py --report out/train_loop.json     # the table again, no GPU

For each model, `recipes/<model>.sh` runs Megatron-LM's `pretrain_gpt.py` (the hybrid
recipe: `pretrain_hybrid.py`) twice on the same line and seed, once with MOE_OVERLAP=0 (the
stock MoE layer, core-TE) and once with `--moe-overlap` alone, the order alternating from
model to model. From each run's log it reads what Megatron-LM prints: the lm loss and the
"elapsed time per iteration" at every logged iteration, and our build line ("megatron-overlap:
N of M MoE layers overlapped ..."). The verdict per model: every MoE layer overlapped, the
loss at every logged iteration within `--loss-rtol` of stock's (bf16 noise), and the median
iteration time after the first logged interval (compilation, warm-up) against stock's.
Each run is bounded (`--run-timeout-s`); a run that fails keeps its log tail in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODELS = ("granite", "qwen", "deepseek", "qwen_hybrid")
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): "
                       r"([\d.]+).*?lm loss: ([\d.E+-]+)")
BUILD_LINE = re.compile(r"megatron-overlap: (\d+) of (\d+) MoE layers overlapped.*")
#: TECudaGraphHelper's INFO line once it captured (`--cuda-graph-impl transformer_engine`)
GRAPH_CAPTURE = re.compile(r"Time spent in CUDA Graphs capture on rank \d+: ([\d.]+)s")


def parse_log(text: str) -> dict:
    """Megatron-LM's logged iterations {iteration: (ms, lm loss)}, our build lines and the
    seconds of each TE CUDA-graph capture."""
    iterations = {int(m[1]): (float(m[2]), float(m[3])) for m in ITERATION.finditer(text)}
    return dict(iterations=iterations, build=[m[0] for m in BUILD_LINE.finditer(text)],
                graph_captures=[float(m[1]) for m in GRAPH_CAPTURE.finditer(text)])


def run_recipe(model: str, overlap: bool, args) -> dict:
    env = dict(os.environ, MEGATRON_LM=str(args.megatron_lm), TP="1", EP="1",
               NUM_LAYERS=str(args.layers), SEQ=str(args.seq), MICRO_BATCH=str(args.micro_batch),
               TRAIN_ITERS=str(args.iters), LOG_INTERVAL=str(args.log_interval),
               MOE_OVERLAP="1" if overlap else "0", MASTER_PORT=str(args.port))
    cmd = ["bash", str(REPO / "recipes" / f"{model}.sh"), *args.extra]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.run_timeout_s)
        text, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        text, rc = f"{err.stdout or ''}{err.stderr or ''}\nTIMEOUT {args.run_timeout_s} s", 124
    found = parse_log(text if isinstance(text, str) else text.decode())
    return dict(rc=rc, **found, tail=None if rc == 0 else text[-3000:])


def asks_te_graphs(megatron_args: list[str]) -> bool:
    """Do these Megatron-LM arguments ask for TE CUDA graphs (`--cuda-graph-impl
    transformer_engine`, or with `=`)?"""
    joined = " ".join(megatron_args).replace("--cuda-graph-impl=", "--cuda-graph-impl ")
    return "--cuda-graph-impl transformer_engine" in joined


def compare(stock: dict, overlap: dict, rtol: float, log_interval: int,
            graphs: bool = False) -> dict:
    """The verdict of one model's pair of runs (module doc); with `graphs` (TE CUDA graphs
    asked for) both runs must have captured them."""
    common = sorted(set(stock["iterations"]) & set(overlap["iterations"]))
    loss_rel = [abs(overlap["iterations"][i][1] - stock["iterations"][i][1])
                / abs(stock["iterations"][i][1]) for i in common]
    timed = [i for i in common if i > log_interval]  # (the first interval compiles)
    ms = {arm: statistics.median(run["iterations"][i][0] for i in timed) if timed else None
          for arm, run in (("stock", stock), ("overlap", overlap))}
    counts = [tuple(map(int, BUILD_LINE.match(line).groups())) for line in overlap["build"]]
    every = bool(counts) and all(n == m and m > 0 for n, m in counts)
    captured = all(run.get("graph_captures") for run in (stock, overlap))
    return dict(
        logged=common, loss_max_rel=max(loss_rel) if loss_rel else None,
        loss_equal=bool(loss_rel) and max(loss_rel) <= rtol, stock_ms=ms["stock"],
        overlap_ms=ms["overlap"], speedup=(ms["stock"] / ms["overlap"]
                                           if ms["stock"] and ms["overlap"] else None),
        every_moe_layer_overlapped=every, stock_build_lines=len(stock["build"]),
        cuda_graphs_captured=captured if graphs else None,
        ok=stock["rc"] == 0 and overlap["rc"] == 0 and every and bool(loss_rel)
        and max(loss_rel) <= rtol and (captured or not graphs))


def table(data: dict) -> str:
    rows = ["| model | logged iterations | lm loss max rel. diff | stock ms/iter | "
            "--moe-overlap ms/iter | speedup | MoE layers overlapped |",
            "|---|---|---|---|---|---|---|"]
    for model, res in data["models"].items():
        v = res["verdict"]
        fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
        build = res["overlap"]["build"][0] if res["overlap"]["build"] else "none"
        rows.append(f"| {model} | {len(v['logged'])} | {fmt(v['loss_max_rel'], '.1e')} | "
                    f"{fmt(v['stock_ms'], '.1f')} | {fmt(v['overlap_ms'], '.1f')} | "
                    f"{fmt(v['speedup'], '.2f')}x | {build.split(' MoE')[0].split(': ')[-1]} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megatron-lm", type=Path, help="folder holding pretrain_gpt.py, "
                   "pretrain_hybrid.py and their builders (Megatron-LM core_r0.19.0)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--layers", type=int, default=4, help="GPT layers (NUM_LAYERS)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--loss-rtol", type=float, default=2e-3, help="bf16 noise bound")
    p.add_argument("--run-timeout-s", type=int, default=300)
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--json", type=Path)
    p.add_argument("--report", type=Path, help="print the table of a stored JSON and exit")
    p.add_argument("extra", nargs="*", help="after --: more Megatron-LM arguments")
    args = p.parse_args(argv)
    if args.report:
        print(table(json.loads(args.report.read_text())))
        return 0
    if args.megatron_lm is None:
        p.error("--megatron-lm is required to run (or --report FILE)")
    graphs = asks_te_graphs(args.extra)
    data = dict(argv=sys.argv, megatron_args=args.extra, layers=args.layers, seq=args.seq,
                micro_batch=args.micro_batch, iters=args.iters, models={})
    for index, model in enumerate(args.models.split(",")):
        arms = (False, True) if index % 2 == 0 else (True, False)
        runs = {("overlap" if on else "stock"): run_recipe(model, on, args) for on in arms}
        runs["verdict"] = compare(runs["stock"], runs["overlap"], args.loss_rtol,
                                  args.log_interval, graphs)
        data["models"][model] = runs
        print(model, json.dumps(runs["verdict"]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(data, indent=1))
    print(table(data))
    return 0 if all(r["verdict"]["ok"] for r in data["models"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
