"""Where a GEMM2 tile stores its rows in a token-major y (`gemm2_layout.TokenPlaces`): the
device half, shared by both GEMM2 kernels (the Triton one and the Gluon one call it) and
by the routing's second pass (`popcount32`).

Row j of GEMM2 holds token t = token_index[j] of the tile's expert e; its slot s among
t's rows is the number of t's experts below e, the set bits of t's expert mask (one bit
per local expert, built by the routing's first pass) below bit e. Worked example, four
experts: token 5 has rows in experts 1 and 3, mask 0b1010; its row of expert 3 counts
one bit below bit 3: slot 1, y row 5 k + 1, where the routing's table puts it too.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def popcount32(x):
    """Set bits of each uint32 (SWAR: pairs, nibbles, bytes, then their sum)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24) & 0x3F


@triton.jit
def token_major_rows(rows, end_row, expert, token_ptr, marks_ptr, dest_rows, topk,
                     MARK_WORDS: tl.constexpr):
    """y's row of each of a tile's rows (`TokenPlaces`): t * topk + the bits of token t's
    expert mask below the tile's expert; -1 past the expert's rows, for a token outside
    y, or for a slot >= topk (bad input: the routing's passes record it). Two dependent
    loads (the token, then its mask), where reading the routing's dest takes one."""
    ok = rows < end_row
    tok = tl.load(token_ptr + rows, mask=ok, other=0).to(tl.int64)
    ok = ok & (tok >= 0) & (tok * topk < dest_rows)
    slot = tl.zeros_like(rows)
    for w in tl.static_range(MARK_WORDS):
        m = tl.load(marks_ptr + tok * MARK_WORDS + w, mask=ok, other=0).to(tl.uint32,
                                                                         bitcast=True)
        one = m * 0 + 1
        below = (one << (expert % 32).to(tl.uint32)) - one  # bits of lower experts in e's word
        part = tl.where(w < expert // 32, m, tl.where(w == expert // 32, m & below, 0))
        slot += popcount32(part).to(tl.int32)
    # (int32: a token-major y has M k < 2^31 rows)
    return tl.where(ok & (slot < topk), (tok * topk + slot).to(tl.int32), -1)


def token_places_reference(token_index, counts: list[int], num_tokens: int, topk: int):
    """Pure torch: (marks [M * words] int32, dest [T] int64) for rows grouped by expert
    (`counts` rows each): marks[t * words + e // 32] has bit e % 32 set for every expert
    e with a row of token t; dest[j] = t k + (t's experts below row j's), the y row the
    kernels' `token_major_rows` finds (before their checks drop bad rows)."""
    import torch

    experts = len(counts)
    words = max(1, -(-experts // 32))
    expert = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts, dtype=torch.long))
    tok = token_index.long().cpu()
    bits = torch.zeros(num_tokens, words * 32, dtype=torch.bool)
    bits[tok, expert] = True
    below = torch.cumsum(bits.long(), dim=1) - bits.long()  # set bits below each bit
    dest = tok * topk + below[tok, expert]
    weights = (1 << torch.arange(32, dtype=torch.int64))
    marks = (bits.view(num_tokens, words, 32).long() * weights).sum(-1)
    marks = torch.where(marks >= 1 << 31, marks - (1 << 32), marks).to(torch.int32)
    return marks.reshape(-1), dest
