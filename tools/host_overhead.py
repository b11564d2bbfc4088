"""Host (CPU) microseconds per call of each step of one operator launch.

    torchrun --nproc-per-node 1 tools/host_overhead.py --json out/host.json

In a Megatron forward the host syncs once per MoE layer (the dispatcher's expert
counts), so every microsecond the operator spends on the host after that point is a
microsecond the GPU waits. Each step is called `--reps` times without synchronizing
(the GPU work queues up) and the median host time per call is reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from benchlib import env_info, smoke_setup, write_json  # noqa: E402
from workloads import OpCase, op_kwargs, rank_inputs  # noqa: E402

from megatron_overlap.kernels import routing_table as rt  # noqa: E402
from megatron_overlap.kernels import sum_partials as sp  # noqa: E402
from megatron_overlap.kernels import gemm2  # noqa: E402
from megatron_overlap.ops import OverlapConfig, gemm2_gather_rs  # noqa: E402
from megatron_overlap.ops import launcher  # noqa: E402
from megatron_overlap.ops.op import prepare  # noqa: E402


def host_us(fn, reps: int, synced: bool = False) -> float:
    """Median host us per call: back to back (the GPU work queues up) or, `synced`, each
    call right after a synchronize, as the benchmarks time it."""
    ts = []
    for _ in range(reps):
        if synced and torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return round(statistics.median(ts), 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default="")
    ap.add_argument("--cprofile", type=int, default=0, metavar="CALLS",
                    help="also profile CALLS whole-op calls with cProfile (rank 0 prints "
                         "the functions with the most own time)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    backend, device = smoke_setup(args)
    group = dist.group.WORLD
    inp = rank_inputs(OpCase(args.model, "TP2EP1", args.seq, "uniform"), dist.get_rank(), device)
    run = op_kwargs(inp, group)
    cfg = OverlapConfig.from_env(backend=backend)
    ref = OverlapConfig(backend="reference")
    launch = prepare(**run, config=cfg)
    for _ in range(3):
        gemm2_gather_rs(**run, config=cfg)
        gemm2_gather_rs(**run, config=ref)
    buf, lp, routing = launch.buffer, launch.launch_plan, launch.routing
    out = torch.empty(inp["tokens"] // launch.world, inp["hidden"], dtype=inp["x"].dtype,
                      device=device)
    counts = inp["counts_list"]
    y = torch.randn(inp["x"].shape[0], inp["hidden"], device=device).to(inp["x"].dtype)
    on_device = dict(run, tokens_per_expert=torch.as_tensor(counts, device=device))
    gemm2_gather_rs(**on_device, config=cfg)  # (its own kernel specialization, compiled)
    steps = {
        "whole op (ours)": lambda: gemm2_gather_rs(**run, config=cfg),
        # the counts as a layer with every expert local hands them over: never on the host
        "whole op (ours), counts on the device": lambda: gemm2_gather_rs(**on_device,
                                                                         config=cfg),
        "whole op (reference)": lambda: gemm2_gather_rs(**run, config=ref),
        "prepare": lambda: prepare(**run, config=cfg),
        "combine_table (torch, the reference's)": lambda: rt.combine_table(
            inp["token_index"], inp["tokens"], inp["topk"]),
        "routing_table kernel": lambda: rt.launch_routing_table(
            inp["token_index"], routing.row_start, inp["tokens"], inp["topk"], buf.error),
        "expert_offsets_host": lambda: gemm2.expert_offsets_host(counts, 128, device),
        "launcher.launch (3 kernels)": lambda: launcher.launch(
            buf, inp["x"], inp["weight"], routing, lp, None, out),
        "launcher.launch_gemm2_alone": lambda: launcher.launch_gemm2_alone(
            buf, inp["x"], inp["weight"], routing, lp, y),
        "launcher.launch_comm_alone": lambda: launcher.launch_comm_alone(
            buf, y, routing, lp, None, out),
        "torch.empty": lambda: torch.empty(inp["x"].shape[0], inp["hidden"], device=device),
    }
    if backend == "triton":
        triton_steps(steps, inp, launch, out, y)
    res = {name: host_us(fn, args.reps) for name, fn in steps.items()}
    res.update({f"{name} (after a sync)": host_us(fn, args.reps, synced=True)
                for name, fn in steps.items()})
    if args.cprofile:  # every rank calls (the op is collective), rank 0 prints
        profile_calls(steps["whole op (ours)"], args.cprofile, dist.get_rank() == 0)
    if dist.get_rank() == 0:
        for name, us in res.items():
            print(f"host {name:<28} {us:9.1f} us")
        write_json(args.json, dict(env=env_info(), command=" ".join(sys.argv), host_us=res))
    dist.destroy_process_group()
    return 0


def profile_calls(fn, calls: int, show: bool) -> None:
    """Python functions by own time over `calls` calls (cProfile's overhead included)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    if not show:
        return
    print(f"cProfile of {calls} whole-op calls (us per call):")
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:30]
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in rows:
        print(f"  prof {tottime / calls * 1e6:8.1f} own {cumtime / calls * 1e6:8.1f} cum "
              f"{ncalls / calls:5.1f}x  {name} ({os.path.basename(path)}:{line})")


def triton_steps(steps, inp, launch, out, y) -> None:
    """Triton's per-call cost: its JIT path up to (not including) the launch, and a small
    kernel launched through the JIT path and through the compiled kernel directly."""
    buf, lp = launch.buffer, launch.launch_plan
    t, routing = lp.tiles, launch.routing
    gemm_kw = dict(splits=lp.splits, programs=launch.plan.compute_slots, block_m=t.block_m,
                   block_n=t.block_n, block_k=t.block_k, num_warps=t.gemm_warps,
                   num_stages=t.gemm_stages)
    steps["GEMM2 JIT path, no launch"] = lambda: gemm2.launch_grouped_gemm2(
        inp["x"], inp["weight"], y, routing.row_start, routing.tile_start, buf.ready,
        warmup=True, **gemm_kw)
    recv = torch.zeros(launch.world, out.shape[0], out.shape[1], dtype=out.dtype,
                       device=out.device)
    steps["sum_partials JIT launch"] = lambda: sp.launch_sum_partials(recv, out, launch.world)
    compiled = sp.launch_sum_partials(recv, out, launch.world)
    grid = (-(-out.numel() // 2048), 1, 1)
    steps["sum_partials compiled launch"] = lambda: compiled[grid](
        recv, out, out.numel(), recv.stride(0), launch.world, 2048)


if __name__ == "__main__":
    sys.exit(main())
