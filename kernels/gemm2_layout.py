"""How GEMM2's output is cut into splits and what both GEMM2 kernels take after their
tensor descriptors: plain Python shared by `gemm2` (Triton), `gemm2_ws` (Gluon) and
`gather_rs`, kept apart so that none of them imports another for it (`gemm2` picks the
Gluon kernel, so `gemm2_ws` must not import `gemm2`).

Split s covers hidden columns [s*sw, min(N, (s+1)*sw)) with the split width sw
(`split_width`: ceil(N/L), unless the op narrows the last split). Example: N=2048, L=3
-> sw=683; a wider sw=768 leaves 512 columns to the last split.
"""

from __future__ import annotations


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


def operands(weight, y, row_start, tile_start, ready, splits, dest, width=None) -> tuple:
    """Both GEMM2 kernels' arguments after the two tensor descriptors (`width`: the
    split width, default ceil(N/L))."""
    num_experts, hidden, k = weight.shape
    return (y, row_start, tile_start, ready, dest if dest is not None else row_start,
            num_experts, k, hidden, width or split_width(hidden, splits), splits, y.shape[0],
            y.stride(0), y.stride(1))
