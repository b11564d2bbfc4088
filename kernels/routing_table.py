"""The combine table in one kernel: for every token, the rows of y that belong to it.

    table[t, :] = the rows j with token_index[j] == t, in ascending j, -1 padded to top-k

GEMM2's rows come grouped by local expert (rows [row_start[e], row_start[e+1]) belong
to expert e) and, inside an expert, in ascending token order: the order of
Megatron-Core's `permute` (a masked_select over the [experts, tokens] routing map).
A token has at most one row per expert, so each of its rows is found by a binary
search of the token in one expert's segment: program p takes BLOCK_T tokens x every
local expert, narrows each segment to the window of its tokens, searches all of them
at once inside their windows, and a running count over the experts gives each found
row its slot. Expert order is row order, so the slots come out in ascending
row order: the same table as `combine_table` below (the pure-torch reference, an
argsort) and therefore the same fp32 sum order in GatherRS.

With `dest` it also writes the inverse, dest[table[t, s]] = t * k + s: where GEMM2
stores each row for a token-major y (`gemm2.py`, `gather_rs.py`).

One launch instead of the reference's ten small torch ops, and no host sync: this
runs on the host's critical path after the dispatcher's sync in every MoE layer.

The order is the kernel's input contract; the same program also checks it for a
slice of the rows (token_index[j] < token_index[j+1] inside every segment) and
records ERR_UNSORTED in the error word on a violation (ERR_TOPK for a token with more
than k rows, whose extra rows no slot would hold; ERR_COUNTS for expert counts that do
not sum to the rows), which the host raises as a ValueError at its next check: a wrong
order cannot pass silently. Rows past the counts' sum may be padding (`padded`: the
layer's bound of the rows under EP), which no segment holds and nothing checks.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .gemm2 import expert_offsets, next_pow2
from .launch_cache import LaunchCache

ERR_UNSORTED = 3
ERR_TOPK = 4
ERR_COUNTS = 5


@triton.jit(do_not_specialize=["num_rows", "num_tokens", "topk", "num_experts"])
def routing_table_kernel(
    token_index_ptr, offsets_ptr, table_ptr, dest_ptr, error_ptr, packed_ptr,
    num_rows, num_tokens, topk, num_experts, block_m,
    BLOCK_T: tl.constexpr, EXPERTS_POW2: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    TOPK_POW2: tl.constexpr, CHECK_ROWS: tl.constexpr, CHECK_CHUNK: tl.constexpr,
    WINDOW_STEPS: tl.constexpr, WRITE_DEST: tl.constexpr, FROM_COUNTS: tl.constexpr,
    PADDED: tl.constexpr,
):
    pid = tl.program_id(0)
    tokens = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, EXPERTS_POW2)
    known = experts < num_experts
    if FROM_COUNTS:
        # offsets_ptr holds the counts (the host's in mapped pinned memory, or the
        # device's): every program sums them itself, and program 0 stores the packed
        # device offsets [row_start (E+1) | tile_start (E+1) | counts (E)] that GEMM2
        # and GatherRS read
        raw = tl.load(offsets_ptr + experts, mask=known, other=0).to(tl.int32)
        # counts that do not sum to the rows (the host checks its own; device counts
        # cannot be): clamped into [0, rows] so that no kernel reads or writes past x or
        # y, and recorded as ERR_COUNTS
        count = tl.maximum(raw, 0)
        total = tl.cumsum(count, axis=0)
        end = tl.minimum(total, num_rows)
        begin = tl.minimum(total - count, num_rows)
        count = end - begin
        # PADDED: the rows past the counts' sum are padding (no segment holds them)
        counted = tl.max(end, axis=0)
        if PADDED:
            missed = tl.max(total, axis=0) > num_rows
        else:
            missed = tl.max(total, axis=0) != num_rows
        if pid == 0:
            if missed | (tl.min(raw, axis=0) < 0):
                tl.atomic_cas(error_ptr, 0, 5 << 24)  # ERR_COUNTS
            tile_end = tl.cumsum((count + block_m - 1) // block_m, axis=0)
            tl.store(packed_ptr + experts * 0, 0, mask=experts == 0)
            tl.store(packed_ptr + num_experts + 1 + experts * 0, 0, mask=experts == 0)
            tl.store(packed_ptr + 1 + experts, end, mask=known)
            tl.store(packed_ptr + num_experts + 2 + experts, tile_end, mask=known)
            tl.store(packed_ptr + 2 * num_experts + 2 + experts, count, mask=known)
    else:
        begin = tl.load(offsets_ptr + experts, mask=known, other=0)
        end = tl.load(offsets_ptr + experts + 1, mask=known, other=0)
        counted = num_rows
    # This program's tokens [t0, t0 + BLOCK_T) occupy a window [lb, ub) of each expert's
    # segment (at most one row per token and expert, so ub - lb <= BLOCK_T): two
    # searches per expert, then every [T, E] search runs inside its window, in
    # WINDOW_STEPS instead of SEARCH_STEPS steps (a third of the loads at T = 64k).
    t0 = pid * BLOCK_T
    lb, lb_hi = begin, end
    ub, ub_hi = begin, end
    for _ in range(SEARCH_STEPS):
        act = lb < lb_hi
        mid = (lb + lb_hi) // 2
        seen = tl.load(token_index_ptr + mid, mask=act, other=0)
        lb = tl.where(act & (seen < t0), mid + 1, lb)
        lb_hi = tl.where(act & (seen >= t0), mid, lb_hi)
        act = ub < ub_hi
        mid = (ub + ub_hi) // 2
        seen = tl.load(token_index_ptr + mid, mask=act, other=0)
        ub = tl.where(act & (seen < t0 + BLOCK_T), mid + 1, ub)
        ub_hi = tl.where(act & (seen >= t0 + BLOCK_T), mid, ub_hi)
    want = tokens[:, None] + experts[None, :] * 0  # [T, E]
    lo = lb[None, :] + want * 0
    hi = ub[None, :] + want * 0
    # lower_bound of each token in its window, all [T, E] searches in step
    for _ in range(WINDOW_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        seen = tl.load(token_index_ptr + mid, mask=active, other=0)
        right = active & (seen < want)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(active & (seen >= want), mid, hi)
    inside = lo < ub[None, :]
    found = inside & (tl.load(token_index_ptr + lo, mask=inside, other=-1) == want)
    slot = tl.cumsum(found.to(tl.int32), axis=1) - 1  # rank among the token's rows
    ok = tokens < num_tokens
    for s in tl.static_range(TOPK_POW2):
        row = tl.max(tl.where(found & (slot == s), lo, -1), axis=1)
        tl.store(table_ptr + tokens.to(tl.int64) * topk + s, row, mask=ok & (s < topk))
        if WRITE_DEST:  # the inverse: where GEMM2 stores row `row` (token-major y)
            tl.store(dest_ptr + row, tokens * topk + s, mask=ok & (s < topk) & (row >= 0))
    # more rows than top-k for a token: its extra rows would be dropped
    if tl.max(tl.where(ok, tl.sum(found.to(tl.int32), axis=1), 0), axis=0) > topk:
        tl.atomic_cas(error_ptr, 0, 4 << 24)  # ERR_TOPK
    # the contract, for this program's share of the rows: tokens in [0, M), strictly
    # ascending inside each expert's segment
    # ascending, in chunks; row+1 starts a segment iff it equals some row_start[e], found
    # against the starts already in registers (row_start may be host memory: no
    # dependent loads of it)
    any_bad = pid * 0
    for c0 in tl.static_range(0, CHECK_ROWS, CHECK_CHUNK):
        rows = pid * CHECK_ROWS + c0 + tl.arange(0, CHECK_CHUNK)
        real = rows < counted
        pair = rows + 1 < counted
        a = tl.load(token_index_ptr + rows, mask=real, other=0)
        b = tl.load(token_index_ptr + rows + 1, mask=pair, other=num_tokens)
        hit = (rows[:, None] + 1 == begin[None, :]) & known[None, :]
        starts = tl.max(hit.to(tl.int32), axis=1) > 0
        bad = (real & ((a < 0) | (a >= num_tokens))) | (pair & (a >= b) & ~starts)
        any_bad = tl.maximum(any_bad, tl.max(bad.to(tl.int32), axis=0))
    if any_bad > 0:
        tl.atomic_cas(error_ptr, 0, 3 << 24)  # ERR_UNSORTED (jit code sees no globals)


_ROUTING_TABLE = LaunchCache(routing_table_kernel)


def launch_routing_table(token_index: torch.Tensor, row_start: torch.Tensor, num_tokens: int,
                         topk: int, error: torch.Tensor, dest: torch.Tensor | None = None,
                         from_counts: tuple[torch.Tensor, int] | None = None,
                         padded: bool = False) -> torch.Tensor:
    """[M, topk] int32 table from rows grouped by expert, ascending token inside each.

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
    table = torch.empty(num_tokens, topk, dtype=torch.int32, device=token_index.device)
    rows = token_index.numel()
    experts = row_start.numel() - (from_counts is None)
    if dest is not None and (dest.dtype != torch.int32 or dest.numel() != rows):
        raise ValueError(f"dest must be [{rows}] int32, got {tuple(dest.shape)} {dest.dtype}")
    packed = from_counts[0] if from_counts is not None else row_start
    if from_counts is not None and (packed.numel() != 3 * experts + 2
                                    or packed.dtype != torch.int32):
        raise ValueError(f"packed must be [3E + 2] = [{3 * experts + 2}] int32, got "
                         f"{tuple(packed.shape)} {packed.dtype}")
    if num_tokens == 0 or rows == 0 or experts == 0:
        if from_counts is not None:  # no kernel to fill them
            counts = row_start.to(packed.device, non_blocking=True)
            packed.copy_(torch.cat(expert_offsets(counts, from_counts[1]) + (counts,)))
        return table if num_tokens == 0 else table.fill_(-1)
    grid, meta = _routing_grid_meta(rows, num_tokens, topk, experts, dest is not None,
                                    from_counts is not None, padded)
    _ROUTING_TABLE.launch(grid, (token_index, row_start, table, table if dest is None else dest,
                                 error, packed, rows, num_tokens, topk, experts,
                                 from_counts[1] if from_counts else 1), meta)
    return table


@functools.lru_cache(maxsize=256)  # on the launch path of every call: computed once
def _routing_grid_meta(rows: int, num_tokens: int, topk: int, experts: int, write_dest: bool,
                       from_counts: bool, padded: bool = False) -> tuple[tuple, dict]:
    experts_pow2 = next_pow2(experts)
    block_t = max(1, min(128, 4096 // experts_pow2))
    programs = triton.cdiv(num_tokens, block_t)
    check_rows = next_pow2(triton.cdiv(rows, programs))
    return (programs,), dict(
        BLOCK_T=block_t, EXPERTS_POW2=experts_pow2, SEARCH_STEPS=rows.bit_length(),
        TOPK_POW2=next_pow2(topk), CHECK_ROWS=check_rows,
        CHECK_CHUNK=min(check_rows, max(1, 4096 // experts_pow2)),
        WINDOW_STEPS=block_t.bit_length(), WRITE_DEST=write_dest, FROM_COUNTS=from_counts,
        PADDED=padded, num_warps=4)


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
