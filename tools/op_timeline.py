"""Where the one-GPU operator's time goes: its kernels' start and end times under the
PyTorch profiler (CUPTI), the op against GEMM2 alone and GatherRS alone, one process.

    python tools/op_timeline.py --models granite,qwen --layout TP1EP1 --seq 4096 \
        --json out/timeline.json

For each workload it runs, after a warm-up, `--reps` launches of each of: the prepared
op (GEMM2 and GatherRS overlapped, the planner's C and L), our GEMM2 alone on every SM,
GatherRS alone on a ready y (C as planned), torch's grouped GEMM2. From the kernel
records it prints the medians of: GEMM2's duration inside the op against alone (what
sharing the SMs costs it), GatherRS's duration inside the op and alone, the tail
(GatherRS's and the helpers' end after GEMM2's end: the combine not hidden), and the
op's span (first kernel start to last kernel end) against torch's GEMM2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from workloads import OpCase, on_every_sm, rank_inputs  # noqa: E402

from megatron_overlap.ops import OverlapConfig, launcher  # noqa: E402
from megatron_overlap.ops.op import prepare  # noqa: E402
from megatron_overlap.ops.reference import grouped_mm  # noqa: E402


def arms(inp: dict, config: OverlapConfig) -> dict:
    """name -> callable: the op prepared once, and each side alone."""
    args = (inp["x"], inp["weight"], inp["counts_list"], inp["token_index"], inp["tokens"],
            inp["topk"], None, None)
    launch = prepare(*args, config=config)
    buf, routing, lp = launch.buffer, launch.routing, launch.launch_plan
    all_sms = on_every_sm(launch)
    out = torch.empty(inp["tokens"], inp["hidden"], dtype=inp["x"].dtype, device="cuda")
    y = torch.randn(inp["x"].shape[0], inp["hidden"], device="cuda").to(inp["x"].dtype)
    counts = inp["counts"].to("cuda")
    w_t = inp["weight"].transpose(1, 2)
    return dict(
        op=lambda: launcher.launch(buf, inp["x"], inp["weight"], routing, lp, None, out),
        gemm2_alone=lambda: launcher.launch_gemm2_alone(buf, inp["x"], inp["weight"], routing,
                                                        all_sms, y),
        comm_alone=lambda: launcher.launch_comm_alone(buf, y, routing, lp, None, out),
        torch_gemm2=lambda: grouped_mm(inp["x"], w_t, counts, inp["counts_list"]),
    ), dict(C=lp.plan.comm_ctas, L=lp.splits, P=lp.plan.compute_slots, helpers=lp.helpers)


def kernel_spans(fn, reps: int) -> list[list[tuple[str, float, float]]]:
    """Per launch of `fn` (separated by a device sync), its kernels as (name, start,
    end) in us relative to the launch's first kernel."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            with record_function(f"rep{i}"):
                fn()
                torch.cuda.synchronize()
    names = {f"rep{i}" for i in range(reps)}
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA
                      and e.name not in names),  # (the ranges' own GPU-side records)
                     key=lambda e: e.time_range.start)
    reps_cpu = sorted((e for e in prof.events() if e.name in names
                       and e.device_type == DeviceType.CPU), key=lambda e: e.time_range.start)
    out = []
    for r in reps_cpu:  # (a launch's kernels start after its host range begins)
        ks = [k for k in kernels if r.time_range.start <= k.time_range.start
              <= r.time_range.end + 1e6]
        nxt = [q for q in reps_cpu if q.time_range.start > r.time_range.start]
        if nxt:
            ks = [k for k in ks if k.time_range.start < nxt[0].time_range.start]
        if ks:
            t0 = ks[0].time_range.start
            out.append([(k.name, k.time_range.start - t0, k.time_range.end - t0) for k in ks])
    return out


def summarize(spans: dict) -> dict:
    """Medians over launches (us) of the quantities in the module docstring."""
    def med(values):
        return statistics.median(values) if values else float("nan")

    def pick(launch, word):
        return [(s, e) for n, s, e in launch if word in n]

    def dur(name, word):
        return med([e - s for launch in spans[name] for s, e in pick(launch, word)[:1]])

    def span(name):
        return med([max(e for _, _, e in launch) for launch in spans[name]])

    gemm_ends = [pick(lch, "gemm2")[0][1] for lch in spans["op"] if pick(lch, "gemm2")]
    comm_ends = [max(e for _, e in pick(lch, "gather_rs")) for lch in spans["op"]
                 if pick(lch, "gather_rs")]
    return dict(op_span=span("op"), torch_gemm2=span("torch_gemm2"),
                gemm2_in_op=dur("op", "gemm2"), gemm2_alone=dur("gemm2_alone", "gemm2"),
                comm_in_op=dur("op", "gather_rs"), comm_alone=dur("comm_alone", "gather_rs"),
                tail_after_gemm2=med([c - g for g, c in zip(gemm_ends, comm_ends)]),
                sum_partials=dur("op", "sum_partials"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="granite,qwen,deepseek")
    ap.add_argument("--layout", default="TP1EP1")
    ap.add_argument("--seqs", default="4096,16384")
    ap.add_argument("--routing", default="uniform")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    config = OverlapConfig.from_env(backend="triton", preset="h200")
    rows = []
    for model in args.models.split(","):
        for seq in map(int, args.seqs.split(",")):
            case = OpCase(model, args.layout, seq, args.routing)
            fns, plan = arms(rank_inputs(case, 0, "cuda"), config)
            for fn in fns.values():  # warm-up: compile, load, allocate
                fn()
            torch.cuda.synchronize()
            spans = {name: kernel_spans(fn, args.reps) for name, fn in fns.items()}
            row = dict(case=case.label(), plan=plan, **summarize(spans),
                       op_kernels=sorted({n for lch in spans["op"] for n, _, _ in lch}))
            rows.append(row)
            print("timeline " + case.label() + " " + " ".join(
                f"{k}={v:.1f}" for k, v in row.items() if isinstance(v, float))
                + f" plan={plan}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command=" ".join(sys.argv), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
