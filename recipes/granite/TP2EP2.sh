#!/usr/bin/env bash
# Granite-3.1-1B-A400M, TP2EP2 on 4 GPUs: B x S prefill, Megatron-Core's stock MoE layer
# against --moe-overlap (GEMM2 + combine + reduce-scatter overlapped), ABBA-interleaved on
# the same random weights; prints the median of the slowest rank's latency and each layer's C / L.
# MoE per layer: N = 1024, K = 512/2 = 256 per rank, 16 of 32 experts per rank,
# top-8, D = 4 ranks in the reduce-scatter group.
# Environment: SEQ (4096), BATCH (4), ITERS (10), LAYERS (published depth).
# Extra arguments go to the launcher, e.g. --moe-overlap-comm-ctas 8,
# --moe-overlap-calibration h200.json, --experts sequential, --json out.json.
set -euo pipefail
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0  # NVLink multicast stays off
exec torchrun --nproc-per-node 4 -m megatron_overlap.mcore.prefill \
    --model granite --tp 2 --ep 2 --batch "${BATCH:-4}" --seq "${SEQ:-4096}" \
    --iters "${ITERS:-10}" --warmup 2 ${LAYERS:+--layers "$LAYERS"} \
    --abba --moe-overlap-backend triton "$@"
