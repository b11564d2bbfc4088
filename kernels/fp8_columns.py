"""Expert-sorted e4m3 rows copied as columns, each group's first column a multiple of 16;
an e4m3 weight stack transposed per expert (`transpose_stack`).

The weight gradient of a grouped linear contracts over each expert's rows: dW_g =
dy[g]^T x[g]. torch's scaled grouped GEMM takes that as 2d x 2d with the rows as the
reduction dim, so both operands must be transposed ([K, R] row-major), and its TMA
raises on a group whose first column is not 16-byte aligned (and hits a device assert
on an empty one there; docs/data/scaled_grouped_mm_probe_h100.json). So:

    q [R, K] e4m3 (row-major), group_ends [G] (the last <= R; rows past it padding) ->
        out [K, C] e4m3: the rows of group g as columns from column_ends[g-1], the
                         columns up to column_ends[g] (each group's width rounded up to
                         ALIGN) zero; padding rows not copied
        column_ends [G] int32: the GEMM's group offsets

C = R + (ALIGN - 1) * G rounded up to ALIGN: room for every group's padding whatever the
counts, known without them (no host sync). One launch; each program walks one group's
columns in [BLOCK_R, BLOCK_K] tiles from the group's first row, transposed in registers,
so the loads (along K) and the stores (a tile's columns: consecutive from an aligned
one) are contiguous, and writes every column once, zeros included (no memset). A uint8
transpose by torch's `.t().contiguous()` runs its generic strided copy: 13 ms for
Granite's 524288 x 1536 rows on one H100; this kernel 0.92 ms, Qwen's 131072 x 2048
0.23 ms (2.3 TB/s moved). Its first version placed each row by its own loaded column
(14.0 and 5.0 ms), and one with the tiles aligned but the store mask's bound of unknown
divisibility 4.4 and 1.2 ms: the mask along the stored columns must be known constant
over 16 bytes (`tl.multiple_of` on the width) for the stores to stay vectors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_rows import MAX_GROUPS
from .launch_cache import LaunchCache

E4M3 = torch.float8_e4m3fn
#: each group's first column is a multiple of this (16 bytes of e4m3)
ALIGN = 16


@triton.jit(do_not_specialize=["groups", "col_blocks"])
def group_columns_kernel(q_ptr, ends_ptr, starts_ptr, out_ptr, groups, col_blocks,
                         K: tl.constexpr, SPLIT: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_K: tl.constexpr, ALIGN: tl.constexpr):
    """Program (g, K tile, s): group g's columns from its first (a multiple of ALIGN),
    BLOCK_R at a time (tiles s, s + SPLIT, ..), each its rows transposed, the columns
    past its last row zero; g == groups: the columns past the last group, zero. A
    tile's columns are consecutive from an aligned one, so its stores are contiguous."""
    g = tl.program_id(0)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    first = tl.load(ends_ptr + tl.maximum(g - 1, 0)).to(tl.int64)
    first = tl.where(g > 0, first, 0)
    last = tl.load(ends_ptr + tl.minimum(g, groups - 1)).to(tl.int64)
    last = tl.where(g < groups, last, first)  # (the tail: no rows)
    col0 = tl.multiple_of(tl.load(starts_ptr + g), ALIGN)
    # (a multiple of ALIGN, said so: the store mask then keeps 16-byte vectors)
    width = tl.multiple_of(tl.load(starts_ptr + g + 1) - col0, ALIGN)
    # (C as ALIGN x col_blocks: the compiler then knows each out row starts aligned)
    out_rows = k.to(tl.int64)[:, None] * (col_blocks * ALIGN)
    for j in range(tl.program_id(2) * BLOCK_R, width, SPLIT * BLOCK_R):
        r = first + j + tl.arange(0, BLOCK_R)
        tile = tl.load(q_ptr + r[:, None] * K + k[None, :],
                       mask=(r < last)[:, None] & (k < K)[None, :], other=0)
        c = j + tl.arange(0, BLOCK_R)
        tl.store(out_ptr + out_rows + (col0 + c)[None, :], tl.trans(tile),
                 mask=(k < K)[:, None] & (c < width)[None, :])


@triton.jit
def transpose_stack_kernel(q_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    inside = (n < N)[:, None] & (k < K)[None, :]
    tile = tl.load(q_ptr + e * N * K + n[:, None] * K + k[None, :], mask=inside, other=0)
    tl.store(out_ptr + e * N * K + k[:, None] * N + n[None, :], tl.trans(tile),
             mask=(k < K)[:, None] & (n < N)[None, :])


_COLUMNS = LaunchCache(group_columns_kernel)
_TRANSPOSE = LaunchCache(transpose_stack_kernel)


def transpose_stack(q: torch.Tensor) -> torch.Tensor:
    """[E, K, N] e4m3: each expert's matrix of the stack q [E, N, K] transposed (the
    dgrad's weight operand), one launch. torch's `.transpose(1, 2).contiguous()` on e4m3
    is the same generic strided copy as above."""
    if q.dim() != 3 or q.dtype != E4M3 or not q.is_contiguous():
        raise ValueError(f"q must be a contiguous e4m3 stack [E, N, K], got "
                         f"{tuple(q.shape)} {q.dtype}")
    e, n, k = q.shape
    out = torch.empty(e, k, n, dtype=torch.uint8, device=q.device)
    block_n, block_k = min(64, triton.next_power_of_2(max(n, 16))), min(64, triton.next_power_of_2(max(k, 16)))
    if q.numel():
        _TRANSPOSE.launch((e, triton.cdiv(n, block_n), triton.cdiv(k, block_k)),
                          (q.view(torch.uint8), out),
                          dict(N=n, K=k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4))
    return out.view(E4M3)


def _layout(rows: int, group_ends: torch.Tensor):
    """(column_ends int64 [G], shift int64 [G], C): each group's columns and row offset."""
    counts = torch.diff(group_ends, prepend=group_ends.new_zeros(1)).to(torch.int64)
    widths = (counts + ALIGN - 1) // ALIGN * ALIGN
    column_ends = torch.cumsum(widths, 0)
    shift = (column_ends - widths) - (group_ends.to(torch.int64) - counts)
    cols = -(-(rows + (ALIGN - 1) * group_ends.numel()) // ALIGN) * ALIGN
    return column_ends, shift, max(cols, ALIGN)


def _check(q: torch.Tensor, group_ends: torch.Tensor) -> None:
    if q.dim() != 2 or q.dtype != E4M3 or not q.is_contiguous():
        raise ValueError(f"q must be contiguous [R, K] e4m3, got {tuple(q.shape)} {q.dtype}")
    if (group_ends.dim() != 1 or group_ends.is_floating_point()
            or group_ends.device != q.device or not 0 < group_ends.numel() <= MAX_GROUPS):
        raise ValueError(f"group_ends must be 1 to {MAX_GROUPS} integers on {q.device}, got "
                         f"{tuple(group_ends.shape)} {group_ends.dtype} on {group_ends.device}")


def group_columns(q: torch.Tensor, group_ends: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [K, C] e4m3, column_ends int32 [G]) as the module doc says; group_ends
    non-decreasing and at most R (the device holds them: not checked here)."""
    _check(q, group_ends)
    rows, k = q.shape
    column_ends, _, cols = _layout(rows, group_ends)
    # each group's first column, then the last group's end and C: the program of group
    # g writes columns starts[g] to starts[g + 1], the one past the last the tail (every
    # column written once: no memset)
    starts = torch.cat([column_ends.new_zeros(1), column_ends, column_ends.new_full((1,), cols)])
    out = torch.empty(k, cols, dtype=torch.uint8, device=q.device)
    groups = group_ends.numel()
    block_r, block_k = 128, min(64, triton.next_power_of_2(max(k, 16)))
    split = max(1, min(8, triton.cdiv(rows, groups * block_r)))
    grid = (groups + 1, max(1, triton.cdiv(k, block_k)), split)
    if k:
        _COLUMNS.launch(grid, (q.view(torch.uint8), group_ends, starts, out, groups,
                               cols // ALIGN),
                        dict(K=k, SPLIT=split, BLOCK_R=block_r, BLOCK_K=block_k,
                             ALIGN=ALIGN, num_warps=4))
    return out.view(E4M3), column_ends.to(torch.int32)


def group_columns_reference(q: torch.Tensor, group_ends: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in pure torch from the ends on the host."""
    _check(q, group_ends)
    rows, k = q.shape
    column_ends, shift, cols = _layout(rows, group_ends)
    out = torch.zeros(k, cols, dtype=torch.uint8, device=q.device)
    start = 0
    for end, moved in zip(group_ends.tolist(), shift.tolist()):
        out[:, start + moved:end + moved] = q[start:end].view(torch.uint8).t()
        start = end
    return out.view(E4M3), column_ends.to(torch.int32)
