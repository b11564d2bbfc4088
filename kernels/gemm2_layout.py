"""How GEMM2's output is cut into splits, what both GEMM2 kernels take after their
tensor descriptors and the check of a token-major y's places: host code shared by
`gemm2` (Triton), `gemm2_ws` (Gluon) and `gather_rs`, kept apart so that none of them
imports another for it (`gemm2` picks the Gluon kernel, so `gemm2_ws` must not import
`gemm2`).

Split s covers hidden columns [s*sw, min(N, (s+1)*sw)) with the split width sw
(`split_width`: ceil(N/L), unless the op narrows the last split). Example: N=2048, L=3
-> sw=683; a wider sw=768 leaves 512 columns to the last split.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def split_width(hidden: int, splits: int) -> int:
    """sw = ceil(N / L), the model's split width."""
    return -(-hidden // splits)


def split_col_tiles(hidden: int, splits: int, width: int, block_n: int) -> tuple[int, int]:
    """(column tiles of every split but the last, of the last) for split width `width`."""
    last = hidden - (splits - 1) * width
    if not 0 < last <= width:
        raise ValueError(f"split width {width} leaves {last} columns of N={hidden} to the "
                         f"last of {splits} splits: it must hold 1..{width}")
    return -(-width // block_n), -(-last // block_n)


def column_alignment(hidden: int, splits: int, width: int | None = None) -> int:
    """The largest power of two (<= 16) dividing N and the split width (`width`, default
    ceil(N/L)): the column masks are constant over that many elements, so loads and
    stores vectorize."""
    both = hidden | (width or split_width(hidden, splits))
    return min(16, both & -both)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1); plain Python: it runs on the launch path,
    where `triton.next_power_of_2` costs a few microseconds per call."""
    return 1 << max(0, (n - 1).bit_length())


class TokenPlaces(NamedTuple):
    """Where GEMM2 stores each row of a token-major y, found by the kernel itself: row j
    (token t = token_index[j], of the tile's expert e) goes to y[t * topk + s], where s is
    the number of bits of t's expert mask below e (`marks[t * words:(t + 1) * words]`, the
    routing's first pass: one bit per local expert the token has a row in). That is the
    slot the routing's second pass gives the row in the combine table, so GEMM2 need not
    wait for that pass (`kernels/routing_table.py`).

    With `dest`, the second pass's output (y's row of each row, -1 for a row it did not
    place), complete before GEMM2 runs, the kernel reads the place instead: one load per
    row, whose latency the K loop hides, where counting takes two dependent loads (the
    token, then its mask) in front of every tile's K loop (on one H200 the op took
    1.23x-1.43x its time counting: docs/RESULTS.md, "Where GEMM2 finds its rows").

    token_index: [T] int32 / int64; marks: [M * words] int32; words = ceil(E / 32);
    dest: None or [T] int32."""

    token_index: object
    marks: object
    words: int
    topk: int
    dest: object = None


def operands(weight, y, row_start, tile_start, ready, splits, places, width=None) -> tuple:
    """Both GEMM2 kernels' arguments after the two tensor descriptors (`places`: a
    `TokenPlaces` for a token-major y, else None; `width`: the split width, default
    ceil(N/L))."""
    num_experts, hidden, k = weight.shape
    if places is None:
        token_ptr = marks_ptr = row_start
    else:  # (with dest, the kernels read it where they would read the tokens)
        token_ptr = places.token_index if places.dest is None else places.dest
        marks_ptr = places.marks
    topk = 1 if places is None else places.topk
    return (y, row_start, tile_start, ready, token_ptr, marks_ptr, num_experts, k, hidden,
            width or split_width(hidden, splits), splits, y.shape[0], topk,
            y.stride(0), y.stride(1))


def mark_words(places) -> int:
    """The MARK_WORDS constexpr of both kernels (1 in row order)."""
    return 1 if places is None else places.words


def from_dest(places) -> bool:
    """The FROM_DEST constexpr of both kernels: the places read from the routing's dest."""
    return places is not None and places.dest is not None


def check_places(x, weight, y, places: TokenPlaces | None) -> None:
    """The token-major placement's tensors fit x, the experts and y (ValueError naming
    what does not): the kernel then reads no mark outside `marks`."""
    if places is None:
        return
    token_index, marks, words, topk, dest = places
    tokens = -(-y.shape[0] // topk) if topk > 0 else 0
    if (token_index.dtype not in (torch.int32, torch.int64)
            or token_index.numel() != x.shape[0]):
        raise ValueError(f"places.token_index must be [{x.shape[0]}] int32/int64 (a token "
                         f"per x row), got {tuple(token_index.shape)} {token_index.dtype}")
    if topk < 1 or words != -(-weight.shape[0] // 32):
        raise ValueError(f"places.topk must be >= 1 and places.words ceil(E / 32) = "
                         f"{-(-weight.shape[0] // 32)}, got {topk}, {words}")
    if marks.dtype != torch.int32 or marks.numel() < tokens * words:
        raise ValueError(f"places.marks must be int32 with >= ceil(rows of y / topk) * "
                         f"words = {tokens * words} words, got {marks.numel()} {marks.dtype}")
    if dest is not None and (dest.dtype != torch.int32 or dest.numel() != x.shape[0]):
        raise ValueError(f"places.dest must be [{x.shape[0]}] int32 (y's row of each x row), "
                         f"got {tuple(dest.shape)} {dest.dtype}")
