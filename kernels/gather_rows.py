"""Row gather with a row count that only the device knows: out[r] = src[index[r]], r < valid.

    src   [N, H]  the tokens' hidden states
    index [R]     int64, the source row of each output row (R: an upper bound of the rows)
    valid [1]     int, on the device: how many leading output rows are real
    out   [R, H]  rows >= valid are left as they were (torch.empty: unspecified)

The dispatcher's postprocess permutes the tokens into expert order before the host knows
how many rows its experts got (`mcore/dispatch.py`, `deferred_postprocess`): it sizes the
permutation by a bound and the counts arrive later. `index_select` over the bound would
copy every padding row too (under EP = 2 about as many as the real ones); here a program
whose rows all lie past `valid` returns at once, so the copy moves the real rows only.
`gather_rows_reference` below is the same in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch_cache import LaunchCache, row_tile


@triton.jit(do_not_specialize=["rows"])
def gather_rows_kernel(src_ptr, index_ptr, valid_ptr, out_ptr, rows, H: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_h = tl.program_id(1)
    valid = tl.minimum(tl.load(valid_ptr).to(tl.int32), rows)
    if pid_r * BLOCK_R < valid:
        r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        c = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        live = r < valid
        src_rows = tl.load(index_ptr + r, mask=live, other=0)
        mask = live[:, None] & (c < H)[None, :]
        values = tl.load(src_ptr + src_rows[:, None] * H + c[None, :], mask=mask)
        tl.store(out_ptr + r.to(tl.int64)[:, None] * H + c[None, :], values, mask=mask)


_GATHER_ROWS = LaunchCache(gather_rows_kernel)


def block_shape(h: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_H): the widest power-of-two column block up to 512 dividing H
    (2048 -> 512, 1536 -> 512, 64 -> 64), 4096 elements a program."""
    return row_tile(h, 512)


def _check(src: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> None:
    if src.dim() != 2:
        raise ValueError(f"src must be [N, H], got {tuple(src.shape)}")
    if index.dim() != 1 or index.dtype != torch.int64:
        raise ValueError(f"index must be int64 [R], got {tuple(index.shape)} {index.dtype}")
    if valid.numel() != 1 or valid.is_floating_point():
        raise ValueError(f"valid must be one integer, got {tuple(valid.shape)} {valid.dtype}")
    if not (src.device == index.device == valid.device):
        raise ValueError(f"src on {src.device}, index on {index.device}, valid on "
                         f"{valid.device}")


def gather_rows(src: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[R, H]: row r < valid is src[index[r]]; later rows unspecified (no host sync).
    Every index below `valid` must lie in [0, N) (the dispatcher's permutation does)."""
    _check(src, index, valid)
    rows, h = index.shape[0], src.shape[1]
    out = torch.empty(rows, h, dtype=src.dtype, device=src.device)
    if rows == 0 or h == 0:
        return out
    block_r, block_h = block_shape(h)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(h, block_h))
    _GATHER_ROWS.launch(grid, (src.contiguous(), index.contiguous(), valid.reshape(1), out,
                               rows), dict(H=h, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=4))
    return out


def gather_rows_reference(src: torch.Tensor, index: torch.Tensor,
                          valid: torch.Tensor) -> torch.Tensor:
    """The same in torch: the first `valid` rows of src[index] (a host sync)."""
    _check(src, index, valid)
    n = min(int(valid.reshape(())), index.shape[0])
    return src.index_select(0, index[:n])
