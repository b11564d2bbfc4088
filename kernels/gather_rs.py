"""GatherRS: top-k combine + reduce-scatter of GEMM2 output, pushed to peers as splits finish.

For every token t owned by destination rank d (tokens [d*Md, (d+1)*Md)), and every
column of a ready split, this rank sums in fp32 the rows of y it computed for t (its
top-k assignments to local experts, `table[t, :]`, -1 where absent), optionally times
each row's routing probability, and stores the partial into rank d's receive buffer at
slot [this rank, t - d*Md, :]. A cross-rank barrier follows; `sum_partials_kernel`
(`kernels/sum_partials.py`) then
adds the D slots in fp32 into this rank's bf16 output rows.

Where y's rows are: where every token has its k rows on this rank (TP layouts, T = M k)
the op makes y token-major (TOKEN_MAJOR): row t*k + s holds slot s of token t (GEMM2
stored it there through the routing table's inverse), so a program computes the
addresses of slot s of its block of tokens and reads no table (worked example, k = 4:
token 10's rows are y rows 40..43). Otherwise (EP, tokens with rows elsewhere) y is in
GEMM2's row order and each slot's rows come from the table first.

Work per split: D * ceil(Md/BLOCK_TM) * ceil(width/BLOCK_TN) items (width sw, or the
N - (L-1) sw columns the last split holds), program c takes items c, c+C, ...; the
destination is the fastest index so neighbouring programs write to different peers.
Tail helpers: the last split becomes ready only when GEMM2 ends, when its SMs fall idle,
so a second launch of H programs (pid C..C+H-1, queued after GEMM2 on its stream) shares
the last split's items with the C programs (stride C+H there); the helpers skip the
earlier splits. H = 0 is the plain scheme.

The flag protocol, in full (the only subtle part of the operator):
  * readiness, `ready[s]` (local int32, one per split): written only by GEMM2 tiles
    (`atomic_add(+1, release, gpu)` after their stores); read here by
    `atomic_add(0, acquire, gpu)` until it reaches the tiles per split, row tiles
    (`tile_start[E]`, on the device) x GEMM2 column tiles per split; programs with no
    item in split s do not wait for it.
  * completion, `done` (local int32): after its last store every program does
    `atomic_add(done, 1, release, sys)`; sys scope so that its peer stores are ordered
    for observers on other GPUs. The program that sees C+H-1 acquired them all (it may
    be a helper: the barrier, reset and epoch logic do not care which launch it is in).
  * barrier, agreement and recovery: the last program to finish runs the cross-rank
    barrier of `flags.py` (whose docstring is the cross-rank protocol in full): it
    publishes this rank's arrival and descriptor (epoch, generation, M, N, kind) to every
    peer, waits for theirs, compares them, and after a fault (a wait ran out, a peer
    gave up on this call or faulted, another epoch or generation) recovers the group
    with its peers, on the device. C, L and the tail helpers are each rank's own (no
    peer reads them). Cost: one program's DESC_WORDS + 1 stores per peer, and a load
    per source per poll.
  * reset: the last program zeroes `done` and `ready[0..L-1]` for the next call (every
    GEMM2 tile has published and every wait has ended by then). After a time-out the host
    zeroes them.
  * double buffering: receive slots alternate by epoch parity, so a rank that runs ahead
    into call n+1 never overwrites slots a slower peer is still summing for call n; it
    cannot reach call n+2 before that peer has passed the barrier of call n+1.
  * bounded waits: every spin stops after `timeout_us` microseconds of the GPU's global
    timer (the host's monotonic clock under the interpreter) or `max_spins` polls, and records
    `kind << 24 | value` in `error` (kind 1: split `value` never became ready; kinds
    2, 6-8: the barrier's, `flags.py`); the host raises. A hang is a bug.
  * CUDA graphs: nothing allocates, the flags reset themselves, and the epoch and
    generation are device words (`epoch_ptr`, `flags.STATE_WORDS`: the last program
    stores the call's epoch after the barrier; the next call's programs read it + 1),
    as is the parity that picks this call's slots
    (GatherRS's and the final sum's), so a replay of captured calls goes on counting.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .flags import (DESC_WORDS, ERR_BARRIER_TIMEOUT, ERR_MISMATCH,  # noqa: F401 (re-exported)
                    ERR_PEER_FAULT, ERR_READY_TIMEOUT, ERR_RECOVERY, KIND_FAILED,
                    KIND_REFERENCE, MAX_WAIT_TIMEOUT_S, PENDING, RECORD_WORDS, RECOVERED,
                    STATE_WORDS, WAIT_TIMEOUT_S, agreement_kernel, barrier, launch_agreement,
                    signal_words, timeout_us, wait_at_least)
from .gemm2_layout import column_alignment, next_pow2, split_width
from .launch_cache import LaunchCache


@triton.jit
def _combine_item(item, split, geometry, src, receive,
                  BLOCK_TM: tl.constexpr, BLOCK_TN: tl.constexpr, TOPK_POW2: tl.constexpr,
                  HAS_PROBS: tl.constexpr, SLOT_LOOP: tl.constexpr, TOKEN_MAJOR: tl.constexpr):
    """One item of a split: BLOCK_TM tokens of destination `dst` x BLOCK_TN columns, their
    top-k rows summed in fp32 and stored into dst's receive slot. `geometry`: the split's
    (tokens per rank, split width, end column, column blocks); `src`: y and its strides,
    the routing table, the probabilities and k; `receive`: the receive slots' addresses,
    the partial sums' pointer type and strides, and (rank, world, parity)."""
    tokens_per_rank, split_width, end_col, col_blocks = geometry
    y_ptr, stride_ym, stride_yn, table_ptr, prob_ptr, topk = src
    dst_ptrs, partial_like_ptr, dst_slot_stride, dst_row_stride, rank, world, parity = receive
    slots = tl.arange(0, TOPK_POW2)
    dst = item % world
    rest = item // world
    col_block = rest % col_blocks
    token_block = rest // col_blocks
    local = token_block * BLOCK_TM + tl.arange(0, BLOCK_TM)  # row in dst's slice
    cols = split * split_width + col_block * BLOCK_TN + tl.arange(0, BLOCK_TN)
    tok_ok = local < tokens_per_rank
    col_ok = cols < end_col
    tokens = (dst * tokens_per_rank + local).to(tl.int64)
    if SLOT_LOOP:
        # One [TM, TN] gather per top-k slot, unrolled: no cross-thread reduction
        # (the accumulator has the loads' layout) and all k loads can be issued
        # before the first add. Slots are added in ascending order from 0.0.
        acc = tl.zeros((BLOCK_TM, BLOCK_TN), dtype=tl.float32)
        for j in tl.static_range(TOPK_POW2):
            slot_ok = tok_ok & (j < topk)
            if TOKEN_MAJOR:
                # y row t*k + j holds slot j of token t (every token has its k rows
                # here): the load's address needs no table read to wait for
                src = tokens * topk + j
                has = slot_ok
                row = src
                if HAS_PROBS:  # the probabilities are indexed by GEMM2 row
                    row = tl.load(table_ptr + src, mask=slot_ok, other=-1)
                val = tl.load(y_ptr + src[:, None] * stride_ym + cols[None, :] * stride_yn,
                              mask=has[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            else:
                row = tl.load(table_ptr + tokens * topk + j, mask=slot_ok, other=-1)
                has = row >= 0
                val = tl.load(y_ptr + row[:, None].to(tl.int64) * stride_ym
                              + cols[None, :] * stride_yn,
                              mask=has[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            if HAS_PROBS:
                val = val * tl.load(prob_ptr + row, mask=has, other=0.0).to(tl.float32)[:, None]
            acc += val
    else:
        # All k rows of the block's tokens gathered at once ([TM, k, TN]), summed
        # over k in fp32 in a fixed order, whatever C and L are.
        slot_ok = slots < topk
        rows = tl.load(table_ptr + tokens[:, None] * topk + slots[None, :],
                       mask=tok_ok[:, None] & slot_ok[None, :], other=-1)  # [TM, k]
        has = rows >= 0
        vals = tl.load(y_ptr + rows[:, :, None].to(tl.int64) * stride_ym
                       + cols[None, None, :] * stride_yn,
                       mask=has[:, :, None] & col_ok[None, None, :], other=0.0)
        vals = vals.to(tl.float32)
        if HAS_PROBS:
            w = tl.load(prob_ptr + rows, mask=has, other=0.0).to(tl.float32)
            vals = vals * w[:, :, None]
        acc = tl.sum(vals, axis=1)  # [TM, TN]
    if world == 1:  # no peers: the partials are this rank's output, partial_like
        base = partial_like_ptr
    else:
        # peers' buffers arrive as int64 addresses; typed like `partial_like_ptr`
        # (symmetric-memory buffers and our slot offsets are 16-byte aligned)
        # (both parities' tables, [2, world]: this call's receive slots)
        base = tl.multiple_of(tl.load(dst_ptrs + parity * world + dst)
                              .to(partial_like_ptr.dtype), 16)
    out = base + rank * dst_slot_stride + local[:, None].to(tl.int64) * dst_row_stride \
        + cols[None, :]
    tl.store(out, acc.to(partial_like_ptr.dtype.element_ty),
             mask=tok_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["tokens_per_rank", "num_splits", "rank", "world", "topk",
                               "num_experts", "gemm_col_tiles", "gemm_last_col_tiles",
                               "max_spins", "timeout_us", "pid_base", "comm_programs",
                               "helpers", "kind"])
def gather_rs_kernel(
    # (flat, not tuples: `LaunchCache` keys and launches the binary on flat arguments, and
    # do_not_specialize is per argument; `_combine_item` takes them grouped)
    # pointers
    y_ptr, table_ptr, prob_ptr, dst_ptrs, signal_ptrs, ready_ptr, done_ptr, error_ptr,
    tile_start_ptr, partial_like_ptr, epoch_ptr, record_ptr,
    # sizes and protocol values (kind: this launch's descriptor word beside M and N)
    tokens_per_rank, N, split_width, num_splits, rank, world, topk, num_experts,
    gemm_col_tiles, gemm_last_col_tiles, max_spins, timeout_us, kind,
    # programs: [0, comm_programs) launched before GEMM2; [comm_programs, + helpers) by a
    # second launch after it (pid_base = comm_programs), for the last split only
    pid_base, comm_programs, helpers,
    # strides (destination strides in elements of the partial dtype); these, N and the
    # split width are specialized so the column-contiguous accesses vectorize
    stride_ym, stride_yn, dst_slot_stride, dst_row_stride,
    # meta-parameters
    BLOCK_TM: tl.constexpr, BLOCK_TN: tl.constexpr, TOPK_POW2: tl.constexpr,
    HAS_PROBS: tl.constexpr, COL_ALIGN: tl.constexpr, SLOT_LOOP: tl.constexpr,
    ITEM_STAGES: tl.constexpr, TOKEN_MAJOR: tl.constexpr,
):
    tl.static_assert(SLOT_LOOP or not TOKEN_MAJOR, "a token-major y is read one slot at a time")
    pid = tl.program_id(0) + pid_base
    all_programs = comm_programs + helpers
    token_blocks = tl.cdiv(tokens_per_rank, BLOCK_TM)
    # GEMM2 tiles per split, from the row tiles on the device: exact even when the host
    # planned from an estimate of the routed counts. The last split may be narrower.
    row_tiles = tl.load(tile_start_ptr + num_experts)
    # (passed in us, so the argument is an int32 whatever the bound: one binary)
    timeout_ns = timeout_us.to(tl.int64) * 1000
    alive = pid * 0 + 1  # int32 0/1: after a time-out later splits are not waited for
    # this call's epoch: one more than the last call's, which its last program stored
    # (read on the device, so a CUDA graph's replays go on counting)
    epoch = pid * 0
    if world > 1:
        epoch = tl.load(epoch_ptr) + 1
    parity = epoch % 2
    src = (y_ptr, stride_ym, stride_yn, table_ptr, prob_ptr, topk)
    receive = (dst_ptrs, partial_like_ptr, dst_slot_stride, dst_row_stride, rank, world, parity)
    for split in range(num_splits):
        last = split == num_splits - 1
        expected = row_tiles * tl.where(last, gemm_last_col_tiles, gemm_col_tiles)
        width = tl.where(last, N - (num_splits - 1) * split_width, split_width)
        col_blocks = tl.cdiv(width, BLOCK_TN)
        items = world * token_blocks * col_blocks
        # The last split becomes ready when GEMM2 ends, and the SMs GEMM2 leaves are then
        # idle: its items are shared by the communication CTAs and the tail helpers.
        stride = tl.where(last, all_programs, comm_programs)
        first = tl.where(pid < stride, pid, items)  # helpers skip the earlier splits
        if (first < items) & (alive == 1):
            ok = wait_at_least(ready_ptr + split, expected, max_spins, timeout_ns, "gpu")
            if ok == 0:
                tl.atomic_cas(error_ptr, 0, (1 << 24) | split)
                alive = alive * 0
        end_col = tl.multiple_of(tl.minimum(N, (split + 1) * split_width), COL_ALIGN)
        # ITEM_STAGES > 1: Triton's pipeliner turns the table and y gathers of the next
        # ITEM_STAGES - 1 items into cp.async copies into shared memory, so a CTA keeps
        # rows in flight beyond what its registers hold. It acts only on a loop that
        # carries its own num_stages (a dot-free loop ignores the kernel-level one).
        for item in tl.range(first, items, stride, num_stages=ITEM_STAGES):
            _combine_item(item, split, (tokens_per_rank, split_width, end_col, col_blocks),
                          src, receive, BLOCK_TM, BLOCK_TN, TOPK_POW2, HAS_PROBS,
                          SLOT_LOOP, TOKEN_MAJOR)
    tl.debug_barrier()
    if tl.atomic_add(done_ptr, 1, sem="release", scope="sys") == all_programs - 1:
        tl.atomic_add(done_ptr, 0, sem="acquire", scope="sys")
        if world > 1:
            # (the epoch it returns: this call's, or where the group restarts after a fault)
            epoch = barrier(signal_ptrs, epoch_ptr, error_ptr, record_ptr, epoch, rank, world,
                            tokens_per_rank * world, N, kind, max_spins, timeout_ns)
            # every program of the call has read the epoch (each added to `done` after)
            tl.store(epoch_ptr, epoch)
        tl.store(done_ptr, 0)
        for split in range(num_splits):
            tl.store(ready_ptr + split, 0)


# (max_shared: its CTAs share SMs with GEMM2's: the tail helpers, the shared placement)
_GATHER_RS = LaunchCache(gather_rs_kernel, max_shared=True)


#: Shared memory the item pipeline may fill (Hopper gives a CTA up to 227 KiB; the rest
#: is left to the compiler's own scratch).
ITEM_PIPELINE_BYTES = 192 * 1024


def fit_item_stages(requested: int, item_bytes: int, budget: int = ITEM_PIPELINE_BYTES) -> int:
    """The deepest item pipeline <= `requested` whose buffers fit: stages - 1 items of
    `item_bytes` (TM x pow2(k) x TN elements of y) are in flight in shared memory."""
    if requested < 1:
        raise ValueError(f"item pipeline depth (comm_stages) must be >= 1, got {requested}")
    return max(1, min(requested, 1 + budget // max(1, item_bytes)))


def launch_gather_rs(
    y: torch.Tensor, table: torch.Tensor, probs: torch.Tensor | None, dst_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor, ready: torch.Tensor, done: torch.Tensor, error: torch.Tensor,
    tile_start: torch.Tensor, *, tokens_per_rank: int, splits: int, rank: int, world: int,
    gemm_col_tiles: int, epoch: torch.Tensor, max_spins: int, partial_like: torch.Tensor,
    dst_slot_stride: int, dst_row_stride: int, programs: int, block_tm: int, block_tn: int,
    num_warps: int = 16, kernel=gather_rs_kernel, warmup: bool = False, item_stages: int = 1,
    slot_loop: bool = True, helpers: int = 0, launch_helpers: bool = False, stream=None,
    token_major: bool = False, maxnreg: int | None = None,
    width: int | None = None, gemm_last_col_tiles: int | None = None,
    wait_timeout_s: float = WAIT_TIMEOUT_S, record: torch.Tensor | None = None,
    kind: int = 0,
):
    """Launch exactly `programs` communication CTAs. y [T, N] in GEMM2's row order, or
    with `token_major` [M * k, N] with slot j of token t at row t * k + j, which needs
    every token to have its k rows here (T = M k, as under TP); table [M, k] int32;
    `partial_like`: any tensor of the partial sums' dtype (gives the peer pointer type),
    with world == 1 the output itself (`dst_ptrs` is then not read); `item_stages`:
    software-pipeline depth of the item loop (1 = none); `helpers`: H tail helpers share
    the last split; `launch_helpers` launches those H programs (after GEMM2, on its
    stream) instead of the `programs` communication CTAs; `maxnreg` caps the registers
    per thread (None: the compiler's choice); `width`: the split width sw (default
    ceil(N/L)) and `gemm_last_col_tiles` GEMM2's column tiles in the last split, which
    holds the N - (L-1) sw columns left (default `gemm_col_tiles`); `wait_timeout_s`: the
    bound of every wait in seconds (with `max_spins` polls); `epoch`: the group's
    int32 call counter on this device (read and advanced by the call where world > 1;
    `dst_ptrs` then holds both parities' tables, [2, world]); `kind`: this launch's
    descriptor word beside M and N (`flags.py`), agreed on at the barrier, and `record`
    (int32 [RECORD_WORDS], default `error`'s word, where world 1 never writes it) where
    a mismatch is recorded."""
    if token_major and not slot_loop:
        raise ValueError("a token-major y is gathered one slot at a time (slot_loop=True)")
    hidden = y.shape[1]
    slots = next_pow2(table.shape[1])
    stages = fit_item_stages(item_stages, block_tm * slots * block_tn * y.element_size())
    # (the kernel reads probs[row] at prob_ptr + row: a strided view must be copied)
    has_probs = probs is not None
    probs = probs.contiguous() if has_probs else y
    args = (y, table, probs, dst_ptrs, signal_ptrs, ready, done,
            error, tile_start, partial_like, epoch, error if record is None else record,
            tokens_per_rank, hidden,
            width or split_width(hidden, splits), splits, rank, world, table.shape[1],
            tile_start.numel() - 1, gemm_col_tiles,
            gemm_col_tiles if gemm_last_col_tiles is None else gemm_last_col_tiles,
            max_spins, timeout_us(wait_timeout_s), kind,
            programs if launch_helpers else 0, programs, helpers,
            y.stride(0), y.stride(1), dst_slot_stride, dst_row_stride)
    meta = dict(BLOCK_TM=block_tm, BLOCK_TN=block_tn, TOPK_POW2=slots,
                HAS_PROBS=has_probs, COL_ALIGN=column_alignment(hidden, splits, width),
                SLOT_LOOP=slot_loop, ITEM_STAGES=stages, TOKEN_MAJOR=token_major,
                num_warps=num_warps, num_stages=1)
    if maxnreg is not None:
        meta["maxnreg"] = maxnreg
    if warmup:
        return kernel.warmup(*args, grid=(1,), **meta)
    grid = (helpers if launch_helpers else programs,)
    if kernel is gather_rs_kernel:
        return _GATHER_RS.launch(grid, args, meta, stream=stream)
    return kernel[grid](*args, **meta)


def gather_rs_reference(y: torch.Tensor, token_index: torch.Tensor, num_tokens: int,
                        probs: torch.Tensor | None = None) -> torch.Tensor:
    """Pure torch, one rank: [M, N] fp32 = sum of y rows per token (times probs)."""
    full = torch.zeros(num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
    rows = y.float() if probs is None else y.float() * probs.float()[:, None]
    return full.index_add_(0, token_index, rows)
