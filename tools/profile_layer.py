"""Where one MoE layer's time goes, stock and overlapped: GPU kernel time by kind.

    torchrun --nproc-per-node 1 tools/profile_layer.py --models qwen --tp 1 --ep 1 \
        --seqs 4096,16384 --json out/profile_layer_TP1EP1.json

The Amdahl bound in docs/RESULTS.md ("What limits us now") takes the layer minus the
operator as one block; this splits that block. Each arm runs `--calls` layer calls back
to back (as a prefill does: no sync between them) under torch.profiler, after a warm-up.
Per call: the wall time (from the host entering the first call to the last kernel's
end, over the calls), the time some kernel was running (the union of kernel
intervals: concurrent kernels count once), the kernel time of each kind (`KINDS`, by
kernel name; summed, so overlapped kernels count twice) and the kernels the GPU sat idle
before (waiting for the host to launch them, as after a host sync). The profiler adds
a few microseconds of host time per recorded call; kernel durations are the GPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from bench_layer import (add_input_layer_arg, add_fuse_arg, build_case,  # noqa: E402
                         routing_skew)
from benchlib import env_info, write_json  # noqa: E402

from megatron_overlap.mcore import prefill  # noqa: E402

MARK = "megatron_overlap.layer_call"
#: (kind, pattern on the kernel name), first match wins. Ours first: their names are ours.
KINDS = (
    ("ours: GEMM2", r"grouped_gemm2"),
    ("ours: GatherRS", r"gather_rs|sum_partials"),
    ("ours: routing table", r"routing_table"),
    ("ours: SwiGLU", r"weighted_swiglu"),
    ("ours: gated shared add", r"gated_add"),
    ("ours: bounded row gather", r"gather_rows"),
    ("grouped GEMM (torch._grouped_mm)", r"GroupProblemShape|grouped_mm|[Gg]rouped"),
    ("dense GEMM", r"gemm|Gemm|nvjet|cublas|xmma|cutlass"),
    ("NCCL", r"nccl"),
    ("sort / top-k / scan", r"[Ss]ort|topk|[Tt]opK|scan|[Cc]um"),
    ("index / gather / scatter", r"index|[Gg]ather|[Ss]catter|masked|nonzero|[Ee]mbedding"),
    ("reduction", r"[Rr]educe|softmax|[Ss]oftmax|norm"),
    ("elementwise", r"elementwise|[Vv]ectorized|unrolled|fill|triton_|fused"),
    ("copy / memset", r"^Memcpy|^Memset|[Cc]opy"),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


def _union_us(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def breakdown(trace: dict, calls: int, top: int = 15) -> dict:
    """Per-call milliseconds of one profiled block of `calls` marked layer calls."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    marks = [e for e in events if e.get("name") == MARK and e.get("cat") == "user_annotation"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if len(marks) != calls or not gpu:
        raise ValueError(f"expected {calls} marked calls and GPU work, found {len(marks)} "
                         f"marks and {len(gpu)} GPU events (was CUDA profiled?)")
    t0 = min(e["ts"] for e in marks)
    gpu = [e for e in gpu if e["ts"] >= t0]  # the warm-up's stragglers are not ours
    wall = max(e["ts"] + e["dur"] for e in gpu) - t0
    busy = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    kinds: dict[str, float] = {}
    names: dict[str, list[float]] = {}
    waits: dict[str, float] = {}  # idle GPU time before each kernel: it waited on the host
    end = t0
    for e in sorted(gpu, key=lambda e: e["ts"]):
        if e["ts"] > end:
            waits[e["name"]] = waits.get(e["name"], 0.0) + e["ts"] - end
        end = max(end, e["ts"] + e["dur"])
    for e in gpu:
        kinds[kind_of(e["name"])] = kinds.get(kind_of(e["name"]), 0.0) + e["dur"]
        names.setdefault(e["name"], []).append(e["dur"])
    per = 1e-3 / calls  # us over `calls` calls -> ms per call
    kernels = sorted(names.items(), key=lambda kv: -sum(kv[1]))[:top]
    return dict(
        wall_ms=wall * per, gpu_busy_ms=busy * per, gpu_idle_ms=(wall - busy) * per,
        kinds={k: v * per for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        top_kernels=[dict(name=n[:120], kind=kind_of(n), ms=sum(d) * per,
                          per_call=len(d) / calls) for n, d in kernels],
        idle_before=[dict(name=n[:120], kind=kind_of(n), ms=w * per)
                     for n, w in sorted(waits.items(), key=lambda kv: -kv[1])[:8]])


def _arm(layer, name: str):
    """A context manager that sets `layer` up as arm `name` (`ARMS`) and undoes it after."""
    import contextlib

    from megatron_overlap.mcore import fc2_operands as experts_module
    from megatron_overlap.mcore.experts import mlp_activation
    from megatron_overlap.mcore import layer as layer_module

    @contextlib.contextmanager
    def arm():
        enabled = layer.overlap_enabled
        saved = (experts_module.routed_activation, layer_module.deferred_postprocess,
                 layer_module.single_sync_postprocess)
        layer.overlap_enabled = name != "stock"
        if name == "overlap-megatron-swiglu":
            experts_module.routed_activation = mlp_activation
        if name in ("overlap-single-sync", "overlap-megatron-postprocess"):
            layer_module.deferred_postprocess = lambda *args, **kwargs: None
        if name == "overlap-megatron-postprocess":
            layer_module.single_sync_postprocess = (
                lambda disp, hidden, probs: disp.dispatch_postprocess(hidden, probs))
        if name == "overlap-megatron-shared-gate":
            layer._fuses_shared_gate = lambda hidden: False  # an instance attribute: undone below
        try:
            yield
        finally:
            layer.__dict__.pop("_fuses_shared_gate", None)
            layer.overlap_enabled = enabled
            (experts_module.routed_activation, layer_module.deferred_postprocess,
             layer_module.single_sync_postprocess) = saved
    return arm()


#: What each arm changes: the stock layer, the overlapped one, and the overlapped one
#: without one of its layer-level parts: the Triton SwiGLU, the postprocess deferred
#: past FC1 (one sync before it instead), both of those (Megatron's three syncs), or the
#: one-pass gated shared-expert add (Megatron's gate multiply and add instead).
ARMS = ("stock", "overlap", "overlap-megatron-swiglu", "overlap-single-sync",
        "overlap-megatron-postprocess", "overlap-megatron-shared-gate")


def profile_arm(fn, calls: int) -> dict:
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            with torch.profiler.record_function(MARK):
                fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return breakdown(json.load(f), calls)


def profile_case(name: str, seq: int, args, device) -> dict:
    layer, hidden = build_case(name, args.tp, args.ep, seq, args.batch, args, device)
    row = dict(model=name, tp=args.tp, ep=args.ep, seq=seq, batch=args.batch,
               arms=args.arms.split(","), input_layer=args.input_layer,
               routing=routing_skew(layer, hidden))

    def fn():
        with torch.no_grad():
            layer(hidden)

    for arm in row["arms"]:
        with _arm(layer, arm):
            for _ in range(3):  # compile, allocate, plan
                fn()
            row[arm] = profile_arm(fn, args.calls)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="granite,qwen,deepseek")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--seqs", default="4096,16384")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--arms", default="stock,overlap",
                    help=f"comma-separated, of: {'; '.join(ARMS)}")
    add_fuse_arg(ap)
    add_input_layer_arg(ap)
    ap.add_argument("--no-bias-swiglu-fusion", action="store_true",
                    help="eager SwiGLU (Megatron's flag of that name; fused by default)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if unknown := set(args.arms.split(",")) - set(ARMS):
        ap.error(f"unknown arms {sorted(unknown)}; known: {ARMS}")
    args.backend, args.tiny = "auto", False
    device = prefill._setup(argparse.Namespace(tp=args.tp, ep=args.ep, seed=0, preload=None))
    results = []
    for name in args.models.split(","):
        for seq in map(int, args.seqs.split(",")):
            row = profile_case(name, seq, args, device)
            torch.cuda.empty_cache()  # this case's layer is gone; hand its memory back
            results.append(row)
            if dist.get_rank() == 0:
                _print(row)
    if dist.get_rank() == 0:
        write_json(args.json, dict(env=env_info(), command=" ".join(sys.argv), results=results))
    return 0


def _print(row: dict) -> None:
    print(f"== {row['model']} TP{row['tp']}EP{row['ep']} S={row['seq']} B={row['batch']} "
          f"input layer {row['input_layer'] or 'random'}, max_e/mean "
          f"{row['routing']['max_over_mean']:.2f} (ms per layer call)")
    for arm in row["arms"]:
        r = row[arm]
        print(f"  {arm}: wall {r['wall_ms']:.3f}, GPU busy {r['gpu_busy_ms']:.3f}, "
              f"idle {r['gpu_idle_ms']:.3f}")
        for kind, ms in r["kinds"].items():
            print(f"    {kind:<34} {ms:8.3f}")
        for k in r["top_kernels"]:
            print(f"      {k['ms']:7.3f} x{k['per_call']:<4g} {k['name'][:90]}")
        print("    GPU idle before:")
        for k in r["idle_before"]:
            print(f"      {k['ms']:7.3f} {k['name'][:100]}")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
