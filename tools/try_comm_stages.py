"""Experiment: GatherRS with its item loop software-pipelined (cp.async into shared memory).

    torchrun --nproc-per-node 2 tools/try_comm_stages.py --models qwen,deepseek,granite \
        --json out/exp_comm_pipeline.json

For each GatherRS variant of `tune_tiles.COMM_CANDIDATES` (rows per item, TN, warps,
slot loop, pipeline stages) and each model (TP2EP1, uniform routing): GatherRS alone at
C = 8, 16, 32 and the overlapped operator at fixed C = 12, 16, 20, 24 (L from the
planner), every policy of one model in the same interleaved rounds. The compiled
resources of each variant (registers, spills, shared memory, CTAs per SM) are recorded.
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
from tune_tiles import COMM_CANDIDATES, comm_name, phase  # noqa: E402
from workloads import OpCase, rank_inputs  # noqa: E402

from megatron_overlap.ops import OverlapConfig, gemm2_gather_rs  # noqa: E402
# (this experiment is of the partition placement)
from megatron_overlap.ops.config import INTERPRET_TILES  # noqa: E402
from megatron_overlap.ops.config import PARTITION_TILES as GPU_TILES  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen")
    ap.add_argument("--layout", default="TP2EP1")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--comm-cset", default="8,16,32")
    ap.add_argument("--op-cset", default="12,16,20,24")
    ap.add_argument("--json", default="")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    backend, device = smoke_setup(args)
    group = dist.group.WORLD
    base = INTERPRET_TILES if backend == "interpret" else GPU_TILES
    variants = [dataclasses.replace(base, comm_rows=r, comm_tn=tn, comm_warps=w,
                                    comm_slot_loop=sl, comm_stages=st)
                for r, tn, w, sl, st in COMM_CANDIDATES]
    if backend == "interpret":  # a CPU check of the tool itself
        variants = [dataclasses.replace(base, comm_stages=s) for s in (1, 3)]
        args.models, args.comm_cset, args.op_cset = "tiny", "2", "2"
    comm_cset = [int(c) for c in args.comm_cset.split(",")]
    op_cset = [int(c) for c in args.op_cset.split(",")]
    results = {}
    for model in args.models.split(","):
        inp = rank_inputs(OpCase(model, args.layout, args.seq, "uniform"), dist.get_rank(),
                          device)
        pol, info = {}, {}
        for t in variants:
            name = comm_name(t)
            try:
                for c in comm_cset:
                    pol[f"{name} alone C={c}"], info[name] = phase(inp, group, t, backend, c,
                                                                   ("comm",))
                cfg = OverlapConfig(backend=backend, tiles=t)
                for c in op_cset:
                    pol[f"{name} op C={c}"] = (lambda cfg=cfg, c=c: gemm2_gather_rs(
                        inp["x"], inp["weight"], inp["counts_list"], inp["token_index"],
                        inp["tokens"], inp["topk"], None, group, comm_ctas=c, config=cfg))
            except Exception as err:  # noqa: BLE001 - a variant that does not compile or fit
                info[name] = {"error": repr(err)[:300]}
                for key in [k for k in pol if k.startswith(name + " ")]:
                    del pol[key]
        stats = summarize(abba(pol, args.samples, 2, group, progress=model))
        results[model] = dict(info=info, stats=without_samples(stats))
        if dist.get_rank() == 0:
            for t in variants:
                name = comm_name(t)
                row = [f"{stats[k]['median']:.3f}" if k in stats else "-"
                       for k in [f"{name} alone C={c}" for c in comm_cset]
                       + [f"{name} op C={c}" for c in op_cset]]
                print(f"{model:<9} {name:<34} alone {' '.join(row[:len(comm_cset)])} | "
                      f"op {' '.join(row[len(comm_cset):])} | {info.get(name, {})}")
    if dist.get_rank() == 0:
        write_json(args.json, dict(env=env_info(), command=" ".join(sys.argv),
                                   comm_cset=comm_cset, op_cset=op_cset, results=results))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
