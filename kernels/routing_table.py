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
than k rows, whose extra rows no slot would hold), which the host raises as a
ValueError at its next check: a wrong order cannot pass silently.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm2 import next_pow2
from .launch_cache import LaunchCache

ERR_UNSORTED = 3
ERR_TOPK = 4


@triton.jit(do_not_specialize=["num_rows", "num_tokens", "topk", "num_experts", "stage_len"])
def routing_table_kernel(
    token_index_ptr, row_start_ptr, table_ptr, dest_ptr, error_ptr, stage_src_ptr,
    stage_dst_ptr, num_rows, num_tokens, topk, num_experts, stage_len,
    BLOCK_T: tl.constexpr, EXPERTS_POW2: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    TOPK_POW2: tl.constexpr, CHECK_ROWS: tl.constexpr, CHECK_CHUNK: tl.constexpr,
    WINDOW_STEPS: tl.constexpr, WRITE_DEST: tl.constexpr, STAGE_POW2: tl.constexpr,
):
    pid = tl.program_id(0)
    if STAGE_POW2 > 0:
        if pid == 0:  # the host's offsets (mapped pinned memory) into device memory
            at = tl.arange(0, STAGE_POW2)
            vals = tl.load(stage_src_ptr + at, mask=at < stage_len)
            tl.store(stage_dst_ptr + at, vals, mask=at < stage_len)
    tokens = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, EXPERTS_POW2)
    known = experts < num_experts
    begin = tl.load(row_start_ptr + experts, mask=known, other=0)
    end = tl.load(row_start_ptr + experts + 1, mask=known, other=0)
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
        real = rows < num_rows
        pair = rows + 1 < num_rows
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
                         stage: tuple[torch.Tensor, torch.Tensor] | None = None
                         ) -> torch.Tensor:
    """[M, topk] int32 table from rows grouped by expert, ascending token inside each.

    token_index [T] (int32/int64), row_start [E+1] int32 readable by the kernel; `error`
    is an int32 word that receives ERR_UNSORTED << 24 if the order does not hold and
    ERR_TOPK << 24 if a token has more than `topk` rows. `dest` ([T] int32), when
    given, receives the inverse: dest[table[t, s]] = t * topk + s.

    `stage` = (src, dst): int32 tensors of one size; the launch also copies src into dst
    (one program does, before anything later on the stream reads dst). The op passes
    the host's packed offsets in pinned memory, which the GPU reads in place (mapped),
    with row_start a view of them: one launch instead of a copy and a launch on the
    host's critical path, and no pinned tensor allocated per call.
    """
    table = torch.empty(num_tokens, topk, dtype=torch.int32, device=token_index.device)
    rows, experts = token_index.numel(), row_start.numel() - 1
    if dest is not None and (dest.dtype != torch.int32 or dest.numel() != rows):
        raise ValueError(f"dest must be [{rows}] int32, got {tuple(dest.shape)} {dest.dtype}")
    if stage is not None and (stage[0].numel() != stage[1].numel()
                              or stage[0].dtype != torch.int32 or stage[1].dtype != torch.int32):
        raise ValueError(f"stage must be two int32 tensors of one size, got "
                         f"{[(tuple(t.shape), t.dtype) for t in stage]}")
    if num_tokens == 0 or rows == 0 or experts == 0:
        if stage is not None:  # no kernel to carry the copy
            stage[1].copy_(stage[0], non_blocking=True)
        return table if num_tokens == 0 else table.fill_(-1)
    experts_pow2 = next_pow2(experts)
    block_t = max(1, min(128, 4096 // experts_pow2))
    programs = triton.cdiv(num_tokens, block_t)
    check_rows = next_pow2(triton.cdiv(rows, programs))
    src, dst = stage if stage is not None else (row_start, row_start)
    _ROUTING_TABLE.launch(
        (programs,), (token_index, row_start, table, table if dest is None else dest, error,
                      src, dst, rows, num_tokens, topk, experts, src.numel()),
        dict(BLOCK_T=block_t, EXPERTS_POW2=experts_pow2, SEARCH_STEPS=rows.bit_length(),
             TOPK_POW2=next_pow2(topk), CHECK_ROWS=check_rows,
             CHECK_CHUNK=min(check_rows, max(1, 4096 // experts_pow2)),
             WINDOW_STEPS=block_t.bit_length(), WRITE_DEST=dest is not None,
             STAGE_POW2=next_pow2(src.numel()) if stage is not None else 0, num_warps=4))
    return table


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
