"""The non-overlapped reference path: torch grouped GEMM, one-gather combine, reduce-scatter.

The `reference` backend of `gemm2_gather_rs` (and the fallback when a group spans
hosts), and the baseline the benchmarks compare the overlapped kernels with. Same
contract as the op: rows of token t summed in fp32 in row order, then this rank's
[M / D, N] share of the sum over ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .fp8 import reference_y
from .grouped import grouped_mm  # (re-exported: the tools' baseline GEMM2)

# torch 2.13 renames the two collectives; 2.11 (the GPU machines) has only the old names.
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def combine_rows(y: torch.Tensor, table: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    """[M, N] in y's dtype: the sum of each token's rows.

    An fp32 sum in a fixed order through one gather. On H200 this measured faster
    than `index_add_` in bf16 (Megatron's stock unpermute) for S >= 4096 and as fast at
    S = 1024 (docs/RESULTS.md), and it is deterministic.
    """
    rows = y if probs is None else y * probs.to(y.dtype)[:, None]
    padded = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])  # row -1 reads zeros
    return padded[table.long()].sum(dim=1, dtype=torch.float32).to(y.dtype)


def reference_forward(x, weight, counts_dev, counts, table, probs, group, world, scales=None):
    """(this rank's [M / D, N] output, y [T, N]): GEMM2, combine, then reduce-scatter.
    `scales`: FP8 x and weight, dequantized and multiplied in float64 (`fp8.reference_y`:
    the counts on the host, read from the device where only there)."""
    if scales is not None:
        y = reference_y(x, weight, counts if counts is not None else counts_dev.tolist(), scales)
    else:
        y = grouped_mm(x, weight.transpose(1, 2), counts_dev, counts)  # (any K: grouped.py pads)
    full = combine_rows(y, table, probs)
    if world == 1:
        return full, y
    out = full.new_empty(full.shape[0] // world, full.shape[1])
    if full.device.type == "cpu" and full.dtype != torch.float32:
        # gloo reduces in fp32 only for fp32 tensors; keep the sum exact like NCCL's.
        part = full.new_empty(out.shape, dtype=torch.float32)
        reduce_scatter(part, full.float(), group=group)
        return part.to(full.dtype), y
    reduce_scatter(out, full, group=group)
    return out, y
