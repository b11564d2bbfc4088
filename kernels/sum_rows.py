"""The backward of a row gather, without atomics: out[t] = sum of rows[r] over index[r] == t.

    rows  [R, H]        the gradient of the gathered rows (R: routed rows, M x top-k)
    index [R]           int64, the source row of each gathered row, each in [0, N)
    out   [N, H]        rows' dtype: the fp32 sum of each source row's rows in ascending
                        r, rounded once; 0 for a source row no row came from

The fused path permutes the tokens with `index_select` (`mcore/dispatch.py`), whose
autograd backward is `index_add_`: bf16 atomics into [N, H], one per element of every
row, in an order that changes run to run (19 ms of a 266 ms Granite training step at
S = 16384 on an H100, 4 layers). Here the rows are first ordered by source row on the
device (a stable sort: a token's rows stay in ascending r) and each source row's
[start, end) read off the sorted index by `searchsorted`, so no count comes to the host.
One program then sums BLOCK_T source rows x BLOCK_H columns: it loops over its tokens'
rows up to the largest count in the block (shorter ones masked), in fp32, and writes
each element once. Same bits run to run; the sum in ascending r is also what the CPU's
sequential fp32 `index_add_` gives, which `sum_rows_by_index_reference` computes.

Example: rows a, b, c, d; index [1, 0, 1, 3]; N = 4 -> [b, a + c, 0, d].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch_cache import LaunchCache, row_tile


@triton.jit(do_not_specialize=["num_src"])
def sum_rows_kernel(rows_ptr, order_ptr, starts_ptr, out_ptr, num_src, H: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t, c] = sum over j < starts[t + 1] - starts[t] of rows[order[starts[t] + j], c]
    (starts: [N + 1], source row t's rows are order[starts[t]:starts[t + 1]])."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    live = t < num_src
    start = tl.load(starts_ptr + t, mask=live, other=0)
    count = tl.load(starts_ptr + t + 1, mask=live, other=0) - start
    last = tl.max(count, axis=0)
    # [BLOCK_T, 1] inside the loop: a 1-D token mask used in both shapes fails Triton
    # 3.6-3.7's layout pass at some block shapes (32 x 128)
    start, count = start[:, None], count[:, None]
    cols = (c < H)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in range(0, last):
        here = j < count
        # unmasked, at row 0 for a finished token (R > 0 where any count is)
        r = tl.load(order_ptr + tl.where(here, start + j, 0))  # int64: R x H may pass 2^31
        acc += tl.load(rows_ptr + r * H + c[None, :], mask=here & cols,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * H + c[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=live[:, None] & cols)


_SUM_ROWS = LaunchCache(sum_rows_kernel)

#: What an fp32 sum serves: fp64 rows would lose their precision in it.
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def block_shape(h: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_H): the widest power-of-two column block up to 512 dividing H
    (7168, 2048, 1536 -> 512; 96 -> 32), 1024 elements a program: 2 source rows a
    program at model widths. The fastest of 12 shapes on an H100 at 65536 tokens x 8
    rows (H = 1536: 0.62 ms, 2.7 TB/s; 8 x 512 took 0.75 ms; H = 7168: 2.8 ms, within
    2% of the best); a program's loop runs to its tokens' largest count."""
    _, block_h = row_tile(h, 512)
    return max(1024 // block_h, 1), block_h


def _check(rows: torch.Tensor, index: torch.Tensor, num_src: int) -> None:
    if rows.dim() != 2 or rows.dtype not in DTYPES:
        raise ValueError(f"rows must be [R, H] of {', '.join(map(str, DTYPES))} (an fp32 "
                         f"sum), got {tuple(rows.shape)} {rows.dtype}")
    if index.dim() != 1 or index.dtype != torch.int64 or index.shape[0] != rows.shape[0]:
        raise ValueError(f"index must be int64 [R] with R = {rows.shape[0]} (rows), got "
                         f"{tuple(index.shape)} {index.dtype}")
    if isinstance(num_src, bool) or not isinstance(num_src, int) or num_src < 0:
        raise ValueError(f"num_src must be an int >= 0, got {num_src!r}")
    if rows.device != index.device:
        raise ValueError(f"rows on {rows.device}, index on {index.device}")


def source_starts(index: torch.Tensor, num_src: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [R], starts [N + 1]), on the device, no host sync: rows order[starts[t]:
    starts[t + 1]] are source row t's, in ascending r (a stable sort). An index outside
    [0, N) falls outside every range, so its row is dropped."""
    sorted_index, order = torch.sort(index, stable=True)
    bounds = torch.arange(num_src + 1, dtype=torch.int64, device=index.device)
    return order, torch.searchsorted(sorted_index, bounds)


def sum_rows_by_index(rows: torch.Tensor, index: torch.Tensor, num_src: int) -> torch.Tensor:
    """[N, H] in rows' dtype: out[t] = the fp32 sum of rows[r] over index[r] == t in
    ascending r, rounded once (0 where none). Every index must lie in [0, N) (not checked:
    no host sync; a row outside is dropped)."""
    _check(rows, index, num_src)
    h = rows.shape[1]
    out = torch.empty(num_src, h, dtype=rows.dtype, device=rows.device)
    if num_src == 0 or h == 0:
        return out
    order, starts = source_starts(index, num_src)
    block_t, block_h = block_shape(h)
    grid = (triton.cdiv(num_src, block_t), triton.cdiv(h, block_h))
    _SUM_ROWS.launch(grid, (rows.contiguous(), order, starts, out, num_src),
                     dict(H=h, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4))
    return out


def sum_rows_by_index_reference(rows: torch.Tensor, index: torch.Tensor, num_src: int,
                                dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The same in torch, unrounded: [N, H] in `dtype`, by `index_add_` on the CPU (one
    row after another, in r order: with fp32 the kernel's exact sum)."""
    _check(rows, index, num_src)
    out = torch.zeros(num_src, rows.shape[1], dtype=dtype)
    return out.index_add_(0, index.cpu(), rows.cpu().to(dtype))
