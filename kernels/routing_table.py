"""The combine table in two passes over the rows: for every token, the rows of y that
belong to it.

    table[t, :] = the rows j with token_index[j] == t, in ascending j, -1 padded to top-k

GEMM2's rows come grouped by local expert (rows [row_start[e], row_start[e+1]) belong
to expert e) and, inside an expert, in ascending token order: the order of
Megatron-Core's `permute` (a masked_select over the [experts, tokens] routing map).
A token has at most one row per expert, and expert order is row order, so a row's slot
among its token's rows is the number of the token's experts below its own:

  1. marks (`routing_marks_kernel`, one program per BLOCK_R rows): each row sets bit e
     of its token's expert mask, marks[t, e // 32] |= 1 << (e % 32) (an atomic OR: the
     result does not depend on the order the rows arrive in); the same programs fill
     the table with -1 and check the row order;
  2. slots (`routing_slots_kernel`): each row counts the bits of its token's mask below
     its expert (a popcount), slot s, and stores table[t, s] = row.

Worked example, k = 2, experts 0..3: token 5 has rows in experts 1 and 3 (rows 40 and
97): its mask is 0b1010, row 40 counts 0 bits below bit 1 (slot 0), row 97 one bit
below bit 3 (slot 1): table[5] = [40, 97], the same table as `combine_table` below (the
pure-torch reference, an argsort), and therefore the same fp32 sum order in GatherRS.

With `dest` the slots pass also writes the inverse, dest[table[t, s]] = t * k + s: where
GEMM2 stores each row for a token-major y. GEMM2 does not read it: it counts the same
bits itself from the marks (`gemm2_places.token_major_rows`), so the op queues the slots
pass on GatherRS's stream (`route_rows(defer_slots=True)`, `SlotsPass`) and GEMM2 starts
after the marks pass alone; dest serves the backward and the tools.

O(T) loads and atomics, where a search of every token in every expert's segment is
O(M E log): on one H200, at the three models' TP1EP1 shapes (S = 4096, 16384), the
search took 30-129 us per call and these passes 14-46 us (CUDA-graph replays, docs/RESULTS.md), on
the critical path before GEMM2 of every call. No host sync: this runs after the
dispatcher's sync in every MoE layer.

The order is the kernels' input contract; the marks pass also checks it (token_index[j]
in [0, M) and < token_index[j+1] inside every segment) and records ERR_UNSORTED in the
error word on a violation; the slots pass records ERR_TOPK for a token with more than k
rows (whose extra rows no slot holds), the marks pass ERR_COUNTS for expert counts that
do not sum to the rows; the host raises them as a ValueError at its next check: a wrong
order cannot pass silently. Rows past the counts' sum may be padding (`padded`: the
layer's bound of the rows under EP), which no segment holds and nothing checks.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .gemm2 import expert_offsets, next_pow2
from .gemm2_places import popcount32
from .launch_cache import LaunchCache

ERR_UNSORTED = 3
ERR_TOPK = 4
ERR_COUNTS = 5


@triton.jit
def _row_experts(rows, end, experts, known, BLOCK_R: tl.constexpr, SPAN: tl.constexpr):
    """(expert of each row, whether the next row starts another segment): the expert is
    the number of segments that end at or before the row (num_experts past the last).
    A block's rows are consecutive, so they usually cross few segment ends: those
    (fewer than SPAN) are picked out of the registers once per program and each row
    compares with them alone; a block crossing more compares with every end."""
    ends = tl.where(known, end, 2147483647)  # (unknown experts end past every row)
    r0 = tl.min(rows, axis=0)
    e_lo = tl.sum((ends <= r0).to(tl.int32), axis=0)
    # (the ends a row of the block, or the row after it, can meet)
    crossed = tl.sum((ends <= r0 + BLOCK_R).to(tl.int32), axis=0) - e_lo
    if crossed < SPAN:
        j = tl.arange(0, SPAN)
        picked = tl.sum(tl.where(experts[None, :] == (e_lo + j)[:, None], ends[None, :], 0),
                        axis=1)
        picked = tl.where(j < crossed, picked, 2147483647)
        expert = e_lo + tl.sum((picked[None, :] <= rows[:, None]).to(tl.int32), axis=1)
        boundary = tl.max((picked[None, :] == rows[:, None] + 1).to(tl.int32), axis=1) > 0
    else:
        expert = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
        boundary = tl.max((ends[None, :] == rows[:, None] + 1).to(tl.int32), axis=1) > 0
    return expert, boundary


@triton.jit
def _segments_from_counts(counts_ptr, packed_ptr, error_ptr, experts, known, num_rows,
                          num_experts, block_m, PADDED: tl.constexpr):
    """The end of every expert's rows from the counts, which every program sums
    itself (the host's in mapped pinned memory, or the device's); program 0 stores the
    packed device offsets [row_start (E+1) | tile_start (E+1) | counts (E)] that GEMM2,
    GatherRS and the slots pass read. Counts that do not sum to the rows (the host
    checks its own; device counts cannot be) are clamped into [0, rows] so that no
    kernel reads or writes past x or y, and recorded as ERR_COUNTS."""
    raw = tl.load(counts_ptr + experts, mask=known, other=0).to(tl.int32)
    count = tl.maximum(raw, 0)
    total = tl.cumsum(count, axis=0)
    end = tl.minimum(total, num_rows)
    begin = tl.minimum(total - count, num_rows)
    count = end - begin
    if PADDED:  # the rows past the counts' sum are padding (no segment holds them)
        missed = tl.max(total, axis=0) > num_rows
    else:
        missed = tl.max(total, axis=0) != num_rows
    if tl.program_id(0) == 0:
        if missed | (tl.min(raw, axis=0) < 0):
            tl.atomic_cas(error_ptr, 0, 5 << 24)  # ERR_COUNTS (jit code sees no globals)
        tile_end = tl.cumsum((count + block_m - 1) // block_m, axis=0)
        tl.store(packed_ptr + experts * 0, 0, mask=experts == 0)
        tl.store(packed_ptr + num_experts + 1 + experts * 0, 0, mask=experts == 0)
        tl.store(packed_ptr + 1 + experts, end, mask=known)
        tl.store(packed_ptr + num_experts + 2 + experts, tile_end, mask=known)
        tl.store(packed_ptr + 2 * num_experts + 2 + experts, count, mask=known)
    return end


@triton.jit(do_not_specialize=["num_rows", "num_tokens", "topk", "num_experts", "words",
                               "fill_per_program"])
def routing_marks_kernel(
    token_index_ptr, offsets_ptr, table_ptr, marks_ptr, error_ptr, packed_ptr,
    num_rows, num_tokens, topk, num_experts, words, block_m, fill_per_program,
    BLOCK_R: tl.constexpr, EXPERTS_POW2: tl.constexpr, TOPK_POW2: tl.constexpr,
    FILL_CHUNK: tl.constexpr, SPAN: tl.constexpr, FROM_COUNTS: tl.constexpr,
    PADDED: tl.constexpr,
):
    """Pass 1: each row's bit in its token's expert mask (marks [M, words] int32, zero
    before), the table's -1 padding for fill_per_program tokens, the order check."""
    pid = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_POW2)
    known = experts < num_experts
    if FROM_COUNTS:
        end = _segments_from_counts(offsets_ptr, packed_ptr, error_ptr, experts, known,
                                    num_rows, num_experts, block_m, PADDED)
    else:
        end = tl.load(offsets_ptr + experts + 1, mask=known, other=0)
    slots = tl.arange(0, TOPK_POW2)
    for f0 in range(0, fill_per_program, FILL_CHUNK):
        chunk = f0 + tl.arange(0, FILL_CHUNK)
        tokens = pid * fill_per_program + chunk
        fill = (chunk < fill_per_program) & (tokens < num_tokens)
        tl.store(table_ptr + tokens.to(tl.int64)[:, None] * topk + slots[None, :], -1,
                 mask=fill[:, None] & (slots[None, :] < topk))
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    expert, boundary = _row_experts(rows, end, experts, known, BLOCK_R, SPAN)
    real = (expert < num_experts) & (rows < num_rows)
    tok = tl.load(token_index_ptr + rows, mask=real, other=0)
    in_range = (tok >= 0) & (tok < num_tokens)
    e = tl.where(real, expert, 0)
    bit = tl.full([BLOCK_R], 1, tl.uint32) << (e % 32).to(tl.uint32)
    tl.atomic_or(marks_ptr + tok.to(tl.int64) * words + e // 32, bit.to(tl.int32, bitcast=True),
                 mask=real & in_range, sem="relaxed")
    # the contract: tokens in [0, M), strictly ascending inside each expert's segment
    pair = real & ~boundary & (rows + 1 < num_rows)
    nxt = tl.load(token_index_ptr + rows + 1, mask=pair, other=0)
    bad = (real & ~in_range) | (pair & (tok >= nxt))
    if tl.max(bad.to(tl.int32), axis=0) > 0:
        tl.atomic_cas(error_ptr, 0, 3 << 24)  # ERR_UNSORTED


@triton.jit(do_not_specialize=["num_rows", "num_tokens", "topk", "num_experts", "words"])
def routing_slots_kernel(
    token_index_ptr, row_start_ptr, table_ptr, dest_ptr, marks_ptr, error_ptr,
    num_rows, num_tokens, topk, num_experts, words,
    BLOCK_R: tl.constexpr, EXPERTS_POW2: tl.constexpr, WORDS_POW2: tl.constexpr,
    SPAN: tl.constexpr, WRITE_DEST: tl.constexpr,
):
    """Pass 2: each row's slot, the bits of its token's mask below its expert; the
    table entry (and with WRITE_DEST the inverse, dest[row] = t * k + slot)."""
    experts = tl.arange(0, EXPERTS_POW2)
    known = experts < num_experts
    end = tl.load(row_start_ptr + experts + 1, mask=known, other=0)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    expert, _ = _row_experts(rows, end, experts, known, BLOCK_R, SPAN)
    real = (expert < num_experts) & (rows < num_rows)
    tok = tl.load(token_index_ptr + rows, mask=real, other=0)
    ok = real & (tok >= 0) & (tok < num_tokens)
    w = tl.arange(0, WORDS_POW2)
    mask = tl.load(marks_ptr + tok.to(tl.int64)[:, None] * words + w[None, :],
                   mask=ok[:, None] & (w[None, :] < words), other=0).to(tl.uint32, bitcast=True)
    e = tl.where(real, expert, 0)
    one = tl.full([BLOCK_R], 1, tl.uint32)
    below_bit = (one << (e % 32).to(tl.uint32)) - one  # the bits of lower experts in e's word
    mine = w[None, :] == (e // 32)[:, None]
    below = tl.where(w[None, :] < (e // 32)[:, None], mask,
                     tl.where(mine, mask & below_bit[:, None], 0))
    slot = tl.sum(popcount32(below), axis=1).to(tl.int32)
    total = tl.sum(popcount32(mask), axis=1).to(tl.int32)
    keep = ok & (slot < topk)
    tl.store(table_ptr + tok.to(tl.int64) * topk + slot, rows, mask=keep)
    if WRITE_DEST:  # the inverse: where GEMM2 stores the row (token-major y), -1 where
        # it stores nothing (a bad row: GEMM2 may read dest, `gemm2_layout.TokenPlaces`)
        tl.store(dest_ptr + rows, tl.where(keep, tok * topk + slot, -1), mask=rows < num_rows)
    # more rows than top-k for a token: its extra rows would be dropped
    if tl.max((ok & (total > topk)).to(tl.int32), axis=0) > 0:
        tl.atomic_cas(error_ptr, 0, 4 << 24)  # ERR_TOPK


#: segment ends a block of rows may cross and still compare with those alone
SPAN = 8

_MARKS = LaunchCache(routing_marks_kernel)
_SLOTS = LaunchCache(routing_slots_kernel)


class SlotsPass(NamedTuple):
    """The second pass of one routing, not launched yet: `launch(stream)` queues it (on
    GatherRS's stream in the op, which alone reads the table before the call ends, while
    GEMM2 places its rows from the marks itself: `gemm2_layout.TokenPlaces`). Launching
    it again rewrites the same table."""

    grid: tuple
    args: tuple
    meta: dict

    def launch(self, stream=None) -> None:
        _SLOTS.launch(self.grid, self.args, self.meta, stream=stream)


class RoutingPasses(NamedTuple):
    """What `route_rows` queued: the table (complete once `slots` has run, or at once
    when `slots` is None), the tokens' expert masks ([M * words] int32) and the second
    pass if deferred."""

    table: torch.Tensor
    marks: torch.Tensor
    words: int
    slots: SlotsPass | None


def launch_routing_table(token_index: torch.Tensor, row_start: torch.Tensor, num_tokens: int,
                         topk: int, error: torch.Tensor, dest: torch.Tensor | None = None,
                         from_counts: tuple[torch.Tensor, int] | None = None,
                         padded: bool = False) -> torch.Tensor:
    """[M, topk] int32 table from rows grouped by expert, ascending token inside each
    (both passes, `route_rows`)."""
    return route_rows(token_index, row_start, num_tokens, topk, error, dest, from_counts,
                      padded).table


def route_rows(token_index: torch.Tensor, row_start: torch.Tensor, num_tokens: int,
               topk: int, error: torch.Tensor, dest: torch.Tensor | None = None,
               from_counts: tuple[torch.Tensor, int] | None = None, padded: bool = False,
               defer_slots: bool = False) -> RoutingPasses:
    """The two passes; with `defer_slots` the second is returned unlaunched.

    token_index [T] (int32/int64), row_start [E+1] int32 on the same device; `error` is
    an int32 word that receives ERR_UNSORTED << 24 if the order does not hold and
    ERR_TOPK << 24 if a token has more than `topk` rows. `dest` ([T] int32), when
    given, receives the inverse: dest[table[t, s]] = t * topk + s.

    `from_counts` = (packed, block_m): `row_start` is then the counts [E] instead (int32
    or int64), in memory the GPU reads (the op's: pinned host memory read in place, or
    the device counts a layer never brought to the host), and the launch also fills
    `packed` ([3E + 2] int32 on the device) with `gemm2.packed_offsets_host`'s layout,
    [row_start | tile_start | counts]: the offsets reach the device without a copy or
    any summing on the host's critical path. Counts that do not sum to the T rows, or
    a negative one, are clamped into [0, T] there (no kernel reads or writes past x or
    y) and recorded as ERR_COUNTS << 24 in `error`. `padded` (with `from_counts`): the
    counts may sum to fewer than the T rows; the rows past their sum are padding, in no
    expert's segment, neither in the table nor checked (only a sum past T is an error).
    """
    if padded and from_counts is None:
        raise ValueError("padded rows need from_counts (the offsets then come from the counts)")
    device = token_index.device
    table = torch.empty(num_tokens, topk, dtype=torch.int32, device=device)
    rows = token_index.numel()
    experts = row_start.numel() - (from_counts is None)
    if dest is not None and (dest.dtype != torch.int32 or dest.numel() != rows):
        raise ValueError(f"dest must be [{rows}] int32, got {tuple(dest.shape)} {dest.dtype}")
    packed = from_counts[0] if from_counts is not None else row_start
    if from_counts is not None and (packed.numel() != 3 * experts + 2
                                    or packed.dtype != torch.int32):
        raise ValueError(f"packed must be [3E + 2] = [{3 * experts + 2}] int32, got "
                         f"{tuple(packed.shape)} {packed.dtype}")
    words = max(1, -(-experts // 32))  # (triton.cdiv costs ~2 us a call on the host)
    marks = torch.zeros(num_tokens * words, dtype=torch.int32, device=device)
    if num_tokens == 0 or rows == 0 or experts == 0:
        if from_counts is not None:  # no kernel to fill them
            counts = row_start.to(packed.device, non_blocking=True)
            packed.copy_(torch.cat(expert_offsets(counts, from_counts[1]) + (counts,)))
        return RoutingPasses(table if num_tokens == 0 else table.fill_(-1), marks, words, None)
    grid, fill, marks_meta, slots_meta, slots_grid = _routing_grid_meta(
        rows, num_tokens, topk, experts, dest is not None, from_counts is not None, padded)
    _MARKS.launch(grid, (token_index, row_start, table, marks, error, packed, rows,
                         num_tokens, topk, experts, words,
                         from_counts[1] if from_counts else 1, fill), marks_meta)
    slots = SlotsPass(slots_grid,
                      (token_index, packed, table, table if dest is None else dest, marks,
                       error, rows, num_tokens, topk, experts, words), slots_meta)
    if defer_slots:
        return RoutingPasses(table, marks, words, slots)
    slots.launch()
    return RoutingPasses(table, marks, words, None)


@functools.lru_cache(maxsize=256)  # on the launch path of every call: computed once
def _routing_grid_meta(rows: int, num_tokens: int, topk: int, experts: int, write_dest: bool,
                       from_counts: bool, padded: bool = False) -> tuple:
    """(marks grid, tokens each marks program fills, marks meta, slots meta, slots grid): BLOCK_R
    rows x every expert in registers, about 8K elements per program."""
    experts_pow2 = next_pow2(experts)
    topk_pow2 = next_pow2(topk)
    block_r = max(16, min(1024, 8192 // experts_pow2))
    fill_chunk = max(16, 1024 // topk_pow2)
    programs = max(triton.cdiv(rows, block_r), triton.cdiv(num_tokens, fill_chunk))
    marks = dict(BLOCK_R=block_r, EXPERTS_POW2=experts_pow2, TOPK_POW2=topk_pow2,
                 FILL_CHUNK=fill_chunk, SPAN=SPAN, FROM_COUNTS=from_counts, PADDED=padded,
                 num_warps=4)
    slots = dict(BLOCK_R=block_r, EXPERTS_POW2=experts_pow2,
                 WORDS_POW2=next_pow2(triton.cdiv(experts, 32)), SPAN=SPAN,
                 WRITE_DEST=write_dest, num_warps=4)
    return ((programs,), triton.cdiv(num_tokens, programs), marks, slots,
            (triton.cdiv(rows, block_r),))


def combine_table(token_index: torch.Tensor, num_tokens: int, topk: int) -> torch.Tensor:
    """[M, k] int32: the rows of y belonging to each token, in row order, -1 padded.

    token_index[j] is the global token of row j (Megatron's sorted_indices). Row order
    within a token is ascending, so the fp32 sum order is fixed by the routing alone and
    the output does not depend on C or L. No host synchronization (a few small kernels).
    """
    rows = token_index.numel()
    table = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=token_index.device)
    if rows == 0:
        return table
    order = torch.argsort(token_index, stable=True)
    sorted_tokens = token_index[order]
    # a row's slot is its rank among its token's rows: its position minus the position
    # of the token's first row (searchsorted, not bincount: that syncs on CUDA)
    first = torch.searchsorted(sorted_tokens, sorted_tokens)
    slot = torch.arange(rows, device=token_index.device) - first
    table[sorted_tokens, slot] = order.to(torch.int32)
    return table
