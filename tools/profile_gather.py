"""One phase of the operator alone on one GPU, as a target for a hardware-counter
profile (Nsight Compute): GatherRS (`comm`), our GEMM2 (`gemm2`) or torch's (`torch_gemm2`).

    ncu --clock-control none -k regex:gather_rs_kernel -c 1 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats \
        python tools/profile_gather.py --model qwen --seq 4096 --comm-ctas 16

GatherRS runs with its readiness flags preset and GEMM2 does not run: under a
profiler's serialized replay, GatherRS waiting for a concurrent producer would wait for
one that cannot start (so its y is not the L2-warm y of the overlapped op). Our GEMM2
runs on every SM's compute slots, as `gemm2_alone(ours,P=all)` in tools/bench_op.py.
One rank (no process group): every push is local.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from tune_tiles import phase  # noqa: E402
from workloads import OpCase, rank_inputs  # noqa: E402

from megatron_overlap.ops import OverlapConfig  # noqa: E402
from megatron_overlap.ops.config import GPU_TILES  # noqa: E402
from megatron_overlap.ops.reference import grouped_mm  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen")
    ap.add_argument("--layout", default="TP2EP1", help="sets K and the local experts")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--comm-ctas", type=int, default=16)
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--phase", choices=("comm", "gemm2", "torch_gemm2"), default="comm")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("profile_gather: needs a CUDA GPU")
        return 2
    inp = rank_inputs(OpCase(args.model, args.layout, args.seq, "uniform"), 0, "cuda")
    tiles = OverlapConfig.from_env().tiles or GPU_TILES  # MEGATRON_OVERLAP_TILES's, if set
    if args.phase == "torch_gemm2":
        counts = inp["counts"].to("cuda")
        w_t = inp["weight"].transpose(1, 2)
        run, info = lambda: grouped_mm(inp["x"], w_t, counts, inp["counts_list"]), {}
    else:
        run, info = phase(inp, None, tiles, "triton", args.comm_ctas, (args.phase,))
    for _ in range(args.launches):
        run()
    torch.cuda.synchronize()
    print(f"profile_gather: {args.launches} {args.phase} launches, C={args.comm_ctas}, {info}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
