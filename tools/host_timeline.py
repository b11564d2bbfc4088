"""Where the host time of one op call goes, seen from the GPU: a profiler timeline.

    torchrun --nproc-per-node 2 tools/host_timeline.py --model qwen --seq 4096 \
        --json out/timeline.json

Each call is timed as the benchmarks time it (GPUs idle, ranks aligned by a barrier);
torch.profiler records the host's CUDA API calls and the GPU's kernels and copies on one
clock. Per call, relative to the moment the host entered the op: when each CUDA API
call was made (host) and when each kernel / copy started and ended on the GPU. Medians
over the calls, rank 0. The op's own numbers include the profiler's overhead (a few
microseconds per recorded call); the order and the gaps are what this is for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from benchlib import _sync, env_info, smoke_setup, write_json  # noqa: E402
from workloads import OpCase, rank_inputs  # noqa: E402

from megatron_overlap.ops import OverlapConfig, gemm2_gather_rs  # noqa: E402

MARK = "megatron_overlap.call"


def _events(trace: dict) -> list[dict]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]


def per_call(trace: dict) -> list[list[tuple[str, str, float, float]]]:
    """For each marked call: (kind, name, start, end) in us from the call's host start."""
    events = _events(trace)
    # the host's range only (the profiler also mirrors a record_function on the GPU)
    calls = sorted((e for e in events if e.get("name") == MARK
                    and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    out = []
    for i, call in enumerate(calls):
        t0 = call["ts"]
        t_next = calls[i + 1]["ts"] if i + 1 < len(calls) else float("inf")
        rows = [("host", "op call (host)", 0.0, call["dur"])]
        for e in events:
            cat = e.get("cat", "")
            if not t0 <= e["ts"] < t_next and cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
                continue
            if cat in ("cuda_runtime", "cuda_driver") and t0 <= e["ts"] < t0 + call["dur"]:
                rows.append(("api", e["name"], e["ts"] - t0, e["ts"] + e["dur"] - t0))
            elif cat in ("kernel", "gpu_memcpy", "gpu_memset") and t0 <= e["ts"] < t_next:
                rows.append(("gpu", e["name"][:60], e["ts"] - t0, e["ts"] + e["dur"] - t0))
        out.append(sorted(rows, key=lambda r: r[2]))
    return out


def summarize_calls(calls: list) -> list[dict]:
    """Median start/end of the i-th row of each kind and name across calls."""
    keyed: dict[tuple, list] = {}
    for rows in calls:
        seen: dict[tuple, int] = {}
        for kind, name, start, end in rows:
            n = seen[(kind, name)] = seen.get((kind, name), -1) + 1
            keyed.setdefault((kind, name, n), []).append((start, end))
    table = []
    for (kind, name, n), spans in keyed.items():
        if len(spans) < len(calls) // 2:
            continue
        table.append(dict(kind=kind, name=name, n=n, calls=len(spans),
                          start_us=statistics.median(s for s, _ in spans),
                          end_us=statistics.median(e for _, e in spans)))
    return sorted(table, key=lambda r: r["start_us"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen")
    ap.add_argument("--layout", default="TP2EP1")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--backend", default="auto", help="op backend: auto or reference")
    ap.add_argument("--json", default="")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    backend, device = smoke_setup(args)
    group = dist.group.WORLD
    inp = rank_inputs(OpCase(args.model, args.layout, args.seq, "uniform"), dist.get_rank(),
                      device)
    cfg = OverlapConfig.from_env(backend="reference" if args.backend == "reference" else backend)

    def call():
        with torch.profiler.record_function(MARK):
            return gemm2_gather_rs(inp["x"], inp["weight"], inp["counts_list"],
                                   inp["token_index"], inp["tokens"], inp["topk"], None, group,
                                   config=cfg)

    for _ in range(3):  # compile, allocate, plan
        call()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.calls):
            _sync(group)
            call()
        _sync(group)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    calls = per_call(trace)
    table = summarize_calls(calls)
    if dist.get_rank() == 0:
        print(f"{args.model} {args.layout} S={args.seq} backend={cfg.backend}: "
              f"median of {len(calls)} calls, us from the host entering the op")
        for r in table:
            print(f"  {r['kind']:<4} {r['name']:<60} {r['start_us']:9.1f} -> {r['end_us']:9.1f}")
        write_json(args.json, dict(env=env_info(), command=" ".join(sys.argv), table=table,
                                   calls=calls[:4]))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
