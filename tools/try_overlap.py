"""Experiment: where does the overlapped operator lose its time? (GatherRS variants)

    torchrun --nproc-per-node 2 tools/try_overlap.py --json out/exp_overlap.json

For Qwen and Granite (TP2EP1, S = 4096, uniform), ABBA-interleaved in one run:
  * the operator at C in --cset for each GatherRS variant (gather mode, tile, warps),
    the planner choosing L;
  * the same kernels back to back instead of overlapped (GEMM2 on P(C) programs, then
    GatherRS alone with its flags preset): the sum of the two medians shows how much
    co-residence costs;
  * the same overlapped kernels of a launch prepared once (no host work timed);
  * the reference (torch grouped GEMM + combine + NCCL reduce-scatter);
  and the host time of `prepare` and of a whole call.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from benchlib import (abba, env_info, smoke_setup,  # noqa: E402
                      summarize, without_samples, write_json)
from tune_tiles import comm_name, phase  # noqa: E402
from workloads import OpCase, op_kwargs, rank_inputs  # noqa: E402

from megatron_overlap.ops import OverlapConfig, gemm2_gather_rs  # noqa: E402
# (this experiment is of the partition placement)
from megatron_overlap.ops.config import INTERPRET_TILES  # noqa: E402
from megatron_overlap.ops.config import PARTITION_TILES as GPU_TILES  # noqa: E402

# (rows, TNc, warps, slot loop); the run recorded in docs/data/exp_overlap.json also had
# a 400 ns nanosleep between readiness polls (no gain; the option was removed)
VARIANTS = [(64, 1024, 32, False), (256, 1024, 32, True), (128, 1024, 32, True)]


def variant_name(t) -> str:
    return comm_name(t)


def host_times(run, cfg, c, reps=20) -> dict:
    """Median wall time on the host of `prepare` and of a whole op call (after a sync)."""
    import statistics
    import time

    import torch

    from megatron_overlap.ops.op import prepare

    import cProfile
    import io
    import pstats

    for _ in range(5):  # compile, buffers, plan caches
        gemm2_gather_rs(**run, comm_ctas=c, config=cfg)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if dist.get_rank() == 0 and os.environ.get("PROFILE_HOST"):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(reps):
            gemm2_gather_rs(**run, comm_ctas=c, config=cfg)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
        print(text.getvalue())
    else:
        for _ in range(reps):
            gemm2_gather_rs(**run, comm_ctas=c, config=cfg)
    out = {}
    for name, fn in (("prepare", lambda: prepare(**run, comm_ctas=c, config=cfg)),
                     ("op call", lambda: gemm2_gather_rs(**run, comm_ctas=c, config=cfg))):
        ts = []
        for _ in range(reps):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
        out[name] = round(statistics.median(ts), 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen,granite")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--cset", default="12,20,32")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--json", default="")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    backend, device = smoke_setup(args)
    group = dist.group.WORLD
    base = INTERPRET_TILES if backend == "interpret" else GPU_TILES
    variants = [dataclasses.replace(base, comm_rows=r, comm_tn=tn, comm_warps=w,
                                    comm_slot_loop=sl)
                for r, tn, w, sl in VARIANTS]
    cset = [int(c) for c in args.cset.split(",")]
    models = args.models.split(",")
    if backend == "interpret":
        variants, cset, models = variants[:2], [2], ["tiny"]
    pol = {}
    for model in models:
        inp = rank_inputs(OpCase(model, "TP2EP1", args.seq, "uniform"), dist.get_rank(), device)
        run = op_kwargs(inp, group)
        ref = OverlapConfig(backend="reference" if backend == "triton" else backend)
        pol[f"{model} reference"] = lambda run=run, ref=ref: gemm2_gather_rs(**run, config=ref)
        for t in variants:
            cfg = OverlapConfig(backend=backend, tiles=t)
            for c in cset:
                pol[f"{model} {variant_name(t)} C={c} overlapped"] = (
                    lambda run=run, cfg=cfg, c=c: gemm2_gather_rs(**run, comm_ctas=c, config=cfg))
            c = cset[len(cset) // 2]
            gemm_fn = phase(inp, group, t, backend, c, ("gemm2",), all_sms=False)[0]
            comm_fn = phase(inp, group, t, backend, c, ("comm",))[0]
            pol[f"{model} {variant_name(t)} C={c} gemm2 alone"] = gemm_fn
            pol[f"{model} {variant_name(t)} C={c} comm alone"] = comm_fn
            pol[f"{model} {variant_name(t)} C={c} back to back"] = (
                lambda g=gemm_fn, f=comm_fn: (g(), f()))
            # the overlapped kernels of a launch prepared once: no host-side planning,
            # routing table or copies in the timed region
            pol[f"{model} {variant_name(t)} C={c} prepared overlapped"] = phase(
                inp, group, t, backend, c, ("gemm2", "comm"))[0]
        host = host_times(run, OverlapConfig(backend=backend, tiles=variants[-1]), cset[0])
        if dist.get_rank() == 0:
            print(f"{model} host time per call (us): {host}")
    stats = summarize(abba(pol, args.samples, 3, group, progress="overlap"))
    if dist.get_rank() == 0:
        for n, s in stats.items():
            print(f"{n:<58} {s['median']:.3f} ms [{s['ci_low']:.3f}, {s['ci_high']:.3f}]")
        write_json(args.json, dict(env=env_info(), command=" ".join(sys.argv),
                                   stats=without_samples(stats)))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
