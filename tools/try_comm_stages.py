"""One-off experiment: does software pipelining of GatherRS items (num_stages) help?

    torchrun --nproc-per-node 2 tools/try_comm_stages.py
GatherRS alone at C = 16 and 32, and the overlapped operator at C = 20, for
comm_stages 1, 2, 3 (Qwen TP2EP1, S = 4096, uniform).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from benchlib import (abba, add_run_args, smoke_setup,  # noqa: E402
                      summarize, without_samples, write_json)
from tune_tiles import phase  # noqa: E402
from workloads import OpCase, rank_inputs  # noqa: E402

from megatron_overlap.ops import OverlapConfig, gemm2_gather_rs  # noqa: E402
from megatron_overlap.ops.config import GPU_TILES, INTERPRET_TILES  # noqa: E402


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser()
    add_run_args(ap)
    args = ap.parse_args()
    args.model, args.seq = "qwen", 4096
    backend, device = smoke_setup(args)
    group = dist.group.WORLD
    inp = rank_inputs(OpCase(args.model, "TP2EP1", args.seq, "uniform"), dist.get_rank(), device)
    base = INTERPRET_TILES if backend == "interpret" else GPU_TILES
    pol = {}
    for stages in (1, 2, 3):
        t = dataclasses.replace(base, comm_stages=stages)
        for c in (16, 32):
            pol[f"comm alone s{stages} C={c}"] = phase(inp, group, t, backend, c, ("comm",))[0]
        cfg = OverlapConfig(backend=backend, tiles=t)
        pol[f"op s{stages} C=20"] = (lambda cfg=cfg: gemm2_gather_rs(
            inp["x"], inp["weight"], inp["counts_list"], inp["token_index"], inp["tokens"],
            inp["topk"], None, group, comm_ctas=20, config=cfg))
    stats = summarize(abba(pol, 12, 3, group))
    if dist.get_rank() == 0:
        for n, s in stats.items():
            print(f"{n:<28} {s['median']:.3f} ms [{s['ci_low']:.3f}, {s['ci_high']:.3f}]")
        write_json(args.json, without_samples(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
