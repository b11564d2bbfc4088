"""Grouped GEMM2 with split publication: the compute side of GEMM2+GatherRS.

    y[rows of expert e, :] = x[rows of expert e, :] @ W_e^T          (bf16 in, fp32 acc)

A persistent kernel: exactly P programs (the planner's compute slots) walk one global
tile sequence laid out in split order. Split s covers hidden columns
[s*sw, min(N, (s+1)*sw)) with sw = ceil(N/L); inside a split the tiles run over the
global row-tile index (all experts' row tiles back to back) and then the column tiles
of the split. Program b takes tiles b, b+P, b+2P, ... (paper section III-C), so
programs run ahead into later splits before every tile of an earlier one is done.

Readiness protocol (the consumer is `gather_rs.py`):
  * writer: every tile, after its stores, `debug_barrier` (all threads' stores issued and
    ordered within the CTA) then one `atomic_add(ready[s], 1, release, gpu)`;
  * reader: waits with acquire loads until ready[s] == expected, where
    expected = row_tiles * ceil(sw / BLOCK_N) is the same for every split (column tiles
    past N are empty tiles that only count);
  * reset: the consumer zeroes `ready` once it has seen every split; the host zeroes it
    after an error. Nothing here allocates, so CUDA-graph capture is safe.

Worked example: N=2048, L=2, BLOCK_N=128 -> sw=1024, 8 column tiles per split; experts
with 300 and 20 rows, BLOCK_M=128 -> row tiles 3 + 1 = 4; 32 tiles per split, 64 in
all; tile 37 is split 1, row tile 0 (expert 0, rows 0..127), columns 1664..1791.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_experts", "K", "N", "split_width", "num_splits"])
def grouped_gemm2_kernel(
    # pointers
    x_ptr, w_ptr, y_ptr, row_start_ptr, tile_start_ptr, ready_ptr,
    # sizes
    num_experts, K, N, split_width, num_splits,
    # strides
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_ym, stride_yn,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EXPERTS_POW2: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    row_tiles = tl.load(tile_start_ptr + num_experts)
    col_tiles = tl.cdiv(split_width, BLOCK_N)
    tiles_per_split = row_tiles * col_tiles
    experts = tl.arange(0, EXPERTS_POW2)
    # tile_start[e+1] for every expert, +inf past the last: expert of a row tile is the
    # number of experts whose tiles end at or before it.
    tile_ends = tl.load(tile_start_ptr + 1 + experts, mask=experts < num_experts,
                        other=2147483647)
    for tile in range(pid, tiles_per_split * num_splits, num_programs):
        split = tile // tiles_per_split
        in_split = tile - split * tiles_per_split
        row_tile = in_split // col_tiles
        col_tile = in_split - row_tile * col_tiles
        expert = tl.sum((tile_ends <= row_tile).to(tl.int32))
        first_row = tl.load(row_start_ptr + expert)
        end_row = tl.load(row_start_ptr + expert + 1)
        rows = first_row + (row_tile - tl.load(tile_start_ptr + expert)) * BLOCK_M \
            + tl.arange(0, BLOCK_M)
        col0 = split * split_width + col_tile * BLOCK_N
        end_col = tl.minimum(N, (split + 1) * split_width)
        cols = col0 + tl.arange(0, BLOCK_N)
        row_ok = rows < end_row
        col_ok = cols < end_col
        ks = tl.arange(0, BLOCK_K)
        x_tile = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :] * stride_xk
        w_tile = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) \
            * stride_wn + ks[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            a = tl.load(x_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:  # the interpreter's bf16 dot is wrong; fp32 there is exact enough
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
            x_tile += BLOCK_K * stride_xk
            w_tile += BLOCK_K * stride_wk
        y_tile = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :] * stride_yn
        tl.store(y_tile, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
        tl.debug_barrier()
        tl.atomic_add(ready_ptr + split, 1, sem="release", scope="gpu")


def expert_offsets(counts: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """row_start [E+1] and tile_start [E+1] (int32, on counts' device), no host sync."""
    counts = counts.to(torch.int32)
    zero = counts.new_zeros(1)
    row_start = torch.cat([zero, counts.cumsum(0, dtype=torch.int32)])
    tiles = (counts + block_m - 1) // block_m
    tile_start = torch.cat([zero, tiles.cumsum(0, dtype=torch.int32)])
    return row_start, tile_start


def split_width(hidden: int, splits: int) -> int:
    """sw = ceil(N / L), the model's split width."""
    return -(-hidden // splits)


def launch_grouped_gemm2(
    x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, row_start: torch.Tensor,
    tile_start: torch.Tensor, ready: torch.Tensor, *, splits: int, programs: int,
    block_m: int, block_n: int, block_k: int, num_warps: int = 4, num_stages: int = 3,
    kernel=grouped_gemm2_kernel, upcast: bool = False,
):
    """Launch with exactly `programs` persistent CTAs. x [T, K], weight [E, N, K], y [T, N].

    Checks belong to the caller (the op validates once per call); this only launches and
    returns the compiled kernel handle (None under the interpreter).
    """
    num_experts, hidden, k = weight.shape
    return kernel[(programs,)](
        x, weight, y, row_start, tile_start, ready,
        num_experts, k, hidden, split_width(hidden, splits), splits,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), weight.stride(2),
        y.stride(0), y.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        EXPERTS_POW2=triton.next_power_of_2(num_experts), UPCAST=upcast,
        num_warps=num_warps, num_stages=num_stages,
    )


def grouped_gemm2_reference(x: torch.Tensor, weight: torch.Tensor,
                            counts: list[int]) -> torch.Tensor:
    """Pure torch: y rows of expert e = x rows of e @ W_e^T, in x's dtype (fp32 math)."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        outs.append(x[start:start + n].float() @ weight[e].float().t())
        start += n
    y = torch.cat(outs) if outs else x.new_zeros(0, weight.shape[1])
    return y.to(x.dtype)
