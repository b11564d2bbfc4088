"""GEMM2 with a dedicated TMA loader warp (Gluon, Hopper): the same contract as
`gemm2.grouped_gemm2_kernel` (tile order, split publication, SCATTER), other code.

Why a second kernel: at the op's K (704 for Qwen/DeepSeek at TP2, 256 for Granite) a
tile is only 4-11 K-steps, and the Triton kernel's software pipeline fills and drains
once per tile: its next tile's first loads are issued only after the epilogue. Here a
one-warp partition issues every TMA load of the program's tile sequence into a ring of
STAGES buffers, running ahead across tile boundaries, while the default partition (one
warpgroup) waits on the ring, issues the wgmma and stores. Two CTAs fit on an SM (ring
96 KB at STAGES=3, 128 registers per thread at launch), so one CTA's epilogue overlaps
the other's MMAs, as with the Triton kernel.

Synchronization inside a CTA: ready[s] (the loader's expect-tx; TMA completes it) and
empty[s] (the consumer arrives once the wgmma that read slot s has retired). Publication
to GatherRS is the Triton kernel's: the tile's stores, a barrier over the consumer
warpgroup, one release atomic on ready_ptr[split] at GPU scope.

GPU only: Gluon has no interpreter path. CI checks that it compiles for sm_90
(`tools/compile_check.py`); `tests/test_kernels_gpu.py` checks its output bitwise
against the Triton kernel's, and the op picks it with `TileConfig.gemm_impl = "gluon"`.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .gemm2_layout import TokenPlaces, column_alignment, from_dest, mark_words, operands
from .launch_cache import LaunchCache, descriptor

# (Triton 3.6 names the partition-wide barrier thread_barrier, 3.7 barrier)
_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
MAXNREG = 128  # 2 CTAs of (4 + 4 rounded-up loader) warps per SM: 2 * 256 * 128 = 64K


@gluon.jit
def _tile_of(tile, tiles_per_split, col_tiles, last_cols, num_splits, split_width,
             row_start_ptr, tile_start_ptr, num_experts, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, SEARCH_STEPS: gl.constexpr):
    """(split, expert, first row, end row of the expert, first column) of a tile, in the
    Triton kernel's order. The expert is found by a binary search over tile_start
    (scalar loads that stay in L1): Triton 3.6 cannot build a reduction inside a
    warp-specialized partition, which the Triton kernel's register-table lookup needs."""
    split = gl.minimum(tile // tiles_per_split, num_splits - 1)
    in_split = tile - split * tiles_per_split
    cols_here = gl.where(split == num_splits - 1, last_cols, col_tiles)
    row_tile = in_split // cols_here
    col_tile = in_split - row_tile * cols_here
    lo = 0  # the expert (the last one starting at or before row_tile) lies in [lo, hi)
    hi = num_experts
    for _ in gl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        right = gl.load(tile_start_ptr + mid) <= row_tile
        lo, hi = gl.where(right, mid, lo), gl.where(right, hi, mid)
    expert = lo
    first_row = gl.load(row_start_ptr + expert) \
        + (row_tile - gl.load(tile_start_ptr + expert)) * BLOCK_M
    end_row = gl.load(row_start_ptr + expert + 1)
    col0 = split * split_width + col_tile * BLOCK_N
    return split, expert, first_row, end_row, col0


@gluon.jit
def _tile_counts(tile_start_ptr, num_experts, N, split_width, num_splits,
                 BLOCK_N: gl.constexpr):
    """(tiles of every split but the last, tiles in all, column tiles of the last split,
    which may be narrower: the Triton kernel's `split_col_tiles`)."""
    row_tiles = gl.load(tile_start_ptr + num_experts)
    tiles_per_split = row_tiles * gl.cdiv(split_width, BLOCK_N)
    last_cols = gl.cdiv(N - (num_splits - 1) * split_width, BLOCK_N)
    return (tiles_per_split, tiles_per_split * (num_splits - 1) + row_tiles * last_cols,
            last_cols)


@gluon.jit
def _popcount32(x):
    """`gemm2_places.popcount32` in Gluon (which cannot call a Triton function)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24) & 0x3F


@gluon.jit
def _token_major_rows(rows, end_row, expert, token_ptr, marks_ptr, dest_rows, topk,
                      MARK_WORDS: gl.constexpr):
    """`gemm2_places.token_major_rows` in Gluon: y's row of each row of a tile (-1:
    dropped)."""
    ok = rows < end_row
    tok = gl.load(token_ptr + rows, mask=ok, other=0).to(gl.int64)
    ok = ok & (tok >= 0) & (tok * topk < dest_rows)
    slot = rows * 0
    for w in gl.static_range(MARK_WORDS):
        m = gl.load(marks_ptr + tok * MARK_WORDS + w, mask=ok, other=0).to(gl.uint32,
                                                                         bitcast=True)
        one = m * 0 + 1
        below = (one << (expert % 32).to(gl.uint32)) - one
        part = gl.where(w < expert // 32, m, gl.where(w == expert // 32, m & below, 0))
        slot += _popcount32(part).to(gl.int32)
    return gl.where(ok & (slot < topk), (tok * topk + slot).to(gl.int32), -1)


@gluon.jit
def _load_partition(descs, bufs, bars, ptrs, sizes, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SEARCH_STEPS: gl.constexpr,
                    STAGES: gl.constexpr, SLOTS: gl.constexpr):
    """One warp: every TMA load of this program's tiles, STAGES ahead of the wgmma."""
    x_desc, w_desc = descs
    a_bufs, b_bufs = bufs
    ready_bars, empty_bars, stored_bars, free_bars = bars
    y_ptr, token_ptr, marks_ptr, ready_ptr, row_start_ptr, tile_start_ptr = ptrs
    num_experts, K, N, split_width, num_splits, dest_rows, topk, stride_ym, stride_yn = sizes
    tiles_per_split, total, last_cols = _tile_counts(tile_start_ptr, num_experts, N,
                                                     split_width, num_splits, BLOCK_N)
    nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
    count = 0
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        split, expert, first_row, end_row, col0 = _tile_of(
            tile, tiles_per_split, gl.cdiv(split_width, BLOCK_N), last_cols, num_splits,
            split_width, row_start_ptr, tile_start_ptr, num_experts, BLOCK_M, BLOCK_N,
            SEARCH_STEPS)
        for k0 in range(0, K, BLOCK_K):
            slot = count % STAGES
            # a fresh mbarrier counts as having completed the phase before phase 0, so
            # the first STAGES waits pass at once
            mbarrier.wait(empty_bars.index(slot), ((count // STAGES) & 1) ^ 1)
            mbarrier.expect(ready_bars.index(slot), nbytes)
            tma.async_copy_global_to_shared(x_desc, [first_row, k0], ready_bars.index(slot),
                                            a_bufs.index(slot))
            tma.async_copy_global_to_shared(w_desc, [expert * N + col0, k0],
                                            ready_bars.index(slot), b_bufs.index(slot))
            count += 1


@gluon.jit
def _publish_partition(descs, bufs, bars, ptrs, sizes, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                       SEARCH_STEPS: gl.constexpr, STAGES: gl.constexpr,
                       SLOTS: gl.constexpr):
    """One warp: the release atomic of every stored tile. The GPU-scope release waits
    until the tile's stores are visible; here that wait overlaps the next tile's MMAs
    instead of stalling the warpgroup. Ordering: the warpgroup's stores, its barrier,
    its arrive on stored[s] (release, CTA scope), this warp's wait (acquire, CTA scope),
    then the atomic (release, GPU scope: cumulative over what this warp has observed)."""
    ready_bars, empty_bars, stored_bars, free_bars = bars
    y_ptr, token_ptr, marks_ptr, ready_ptr, row_start_ptr, tile_start_ptr = ptrs
    num_experts, K, N, split_width, num_splits, dest_rows, topk, stride_ym, stride_yn = sizes
    tiles_per_split, total, last_cols = _tile_counts(tile_start_ptr, num_experts, N,
                                                     split_width, num_splits, BLOCK_N)
    i = 0
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        slot = i % SLOTS
        mbarrier.wait(stored_bars.index(slot), (i // SLOTS) & 1)
        split = gl.minimum(tile // tiles_per_split, num_splits - 1)
        gl.atomic_add(ready_ptr + split, 1, sem="release", scope="gpu")
        mbarrier.arrive(free_bars.index(slot))
        i += 1


@gluon.jit
def _mma_partition(bufs, bars, ptrs, sizes, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_K: gl.constexpr, SEARCH_STEPS: gl.constexpr, STAGES: gl.constexpr,
                   SLOTS: gl.constexpr, COL_ALIGN: gl.constexpr, SCATTER: gl.constexpr,
                   MARK_WORDS: gl.constexpr, FROM_DEST: gl.constexpr, PUBLISHER: gl.constexpr):
    """One warpgroup: wgmma over the ring, then the epilogue (a layout change through
    shared memory for row-contiguous 16-byte stores) and the tile's publication."""
    a_bufs, b_bufs = bufs
    ready_bars, empty_bars, stored_bars, free_bars = bars
    y_ptr, token_ptr, marks_ptr, ready_ptr, row_start_ptr, tile_start_ptr = ptrs
    num_experts, K, N, split_width, num_splits, dest_rows, topk, stride_ym, stride_yn = sizes
    WARPS: gl.constexpr = 4
    tiles_per_split, total, last_cols = _tile_counts(tile_start_ptr, num_experts, N,
                                                     split_width, num_splits, BLOCK_N)
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_N, 16])
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
    row_layout: gl.constexpr = gl.SliceLayout(1, out_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, out_layout)
    count = 0
    i = 0
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        split, expert, first_row, end_row, col0 = _tile_of(
            tile, tiles_per_split, gl.cdiv(split_width, BLOCK_N), last_cols, num_splits,
            split_width, row_start_ptr, tile_start_ptr, num_experts, BLOCK_M, BLOCK_N,
            SEARCH_STEPS)
        rows = first_row + gl.arange(0, BLOCK_M, layout=row_layout)
        if SCATTER:  # found before the K loop, which hides its latency
            if FROM_DEST:  # (token_ptr: the routing's dest, y's row of each row)
                out_rows = gl.load(token_ptr + rows, mask=rows < end_row, other=-1)
            else:
                out_rows = _token_major_rows(rows, end_row, expert, token_ptr, marks_ptr,
                                             dest_rows, topk, MARK_WORDS)
        else:
            out_rows = rows
        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma_layout)
        for k0 in range(0, K, BLOCK_K):
            slot = count % STAGES
            mbarrier.wait(ready_bars.index(slot), (count // STAGES) & 1)
            a = a_bufs.index(slot)
            b = b_bufs.index(slot)
            acc = warpgroup_mma(a, b.permute((1, 0)), acc, is_async=True)
            # one wgmma in flight: the one before it has read its slot, which goes back
            acc = warpgroup_mma_wait(1, deps=(acc, a, b))[0]
            mbarrier.arrive(empty_bars.index((count + STAGES - 1) % STAGES), pred=k0 > 0)
            count += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty_bars.index((count + STAGES - 1) % STAGES))
        cols = col0 + gl.arange(0, BLOCK_N, layout=col_layout)
        end_col = gl.multiple_of(gl.minimum(N, (split + 1) * split_width), COL_ALIGN)
        if SCATTER:
            row_ok = (out_rows >= 0) & (out_rows < dest_rows)
        else:
            row_ok = rows < end_row
        out = gl.convert_layout(acc.to(y_ptr.dtype.element_ty), out_layout)
        y_tile = y_ptr + out_rows[:, None].to(gl.int64) * stride_ym + cols[None, :] * stride_yn
        store_ok = row_ok[:, None] & (cols < end_col)[None, :]
        gl.store(y_tile, out, mask=store_ok)
        _barrier()  # the warpgroup's stores are issued (CTA-ordered) before thread 0 goes on
        if PUBLISHER:
            slot = i % SLOTS
            mbarrier.wait(free_bars.index(slot), ((i // SLOTS) & 1) ^ 1)
            mbarrier.arrive(stored_bars.index(slot))
        else:
            gl.atomic_add(ready_ptr + split, 1, sem="release", scope="gpu")
        i += 1


@gluon.jit(do_not_specialize=["num_experts", "K", "num_splits", "dest_rows", "topk"])
def grouped_gemm2_ws_kernel(
    x_desc, w_desc, y_ptr, row_start_ptr, tile_start_ptr, ready_ptr, token_ptr, marks_ptr,
    num_experts, K, N, split_width, num_splits, dest_rows, topk, stride_ym, stride_yn,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    SEARCH_STEPS: gl.constexpr, STAGES: gl.constexpr, COL_ALIGN: gl.constexpr,
    SCATTER: gl.constexpr, MARK_WORDS: gl.constexpr, FROM_DEST: gl.constexpr,
    PUBLISHER: gl.constexpr,
):
    SLOTS: gl.constexpr = 4  # stored tiles the publisher may lag behind
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape,
                                       x_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape,
                                       w_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    stored_bars = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    free_bars = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=1)
    for i in gl.static_range(SLOTS):
        mbarrier.init(stored_bars.index(i), count=1)
        mbarrier.init(free_bars.index(i), count=1)
    descs = (x_desc, w_desc)
    bufs = (a_bufs, b_bufs)
    bars = (ready_bars, empty_bars, stored_bars, free_bars)
    ptrs = (y_ptr, token_ptr, marks_ptr, ready_ptr, row_start_ptr, tile_start_ptr)
    sizes = (num_experts, K, N, split_width, num_splits, dest_rows, topk, stride_ym, stride_yn)
    # (constexprs passed one by one: a tuple of them would lose their constexpr-ness)
    if PUBLISHER:
        gl.warp_specialize([
            (_mma_partition, (bufs, bars, ptrs, sizes, BLOCK_M, BLOCK_N, BLOCK_K,
                              SEARCH_STEPS, STAGES, SLOTS, COL_ALIGN, SCATTER, MARK_WORDS,
                              FROM_DEST, True)),
            (_load_partition, (descs, bufs, bars, ptrs, sizes, BLOCK_M, BLOCK_N, BLOCK_K,
                               SEARCH_STEPS, STAGES, SLOTS)),
            (_publish_partition, (descs, bufs, bars, ptrs, sizes, BLOCK_M, BLOCK_N, BLOCK_K,
                                  SEARCH_STEPS, STAGES, SLOTS)),
        ], [1, 1], [24, 24])
    else:
        gl.warp_specialize([
            (_mma_partition, (bufs, bars, ptrs, sizes, BLOCK_M, BLOCK_N, BLOCK_K,
                              SEARCH_STEPS, STAGES, SLOTS, COL_ALIGN, SCATTER, MARK_WORDS,
                              FROM_DEST, False)),
            (_load_partition, (descs, bufs, bars, ptrs, sizes, BLOCK_M, BLOCK_N, BLOCK_K,
                               SEARCH_STEPS, STAGES, SLOTS)),
        ], [1], [24])


@functools.lru_cache(maxsize=16)
def _smem_layout(rows: int, cols: int):
    # (cached: building it costs ~9 us of host time on the launch path, twice per launch)
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)


def _ws_args(x, weight, y, row_start, tile_start, ready, splits, block_m, block_n, block_k,
             stages, places, publisher, maxnreg=None, width=None):
    num_experts, hidden, k = weight.shape
    a_layout, b_layout = _smem_layout(block_m, block_k), _smem_layout(block_n, block_k)
    x_desc = descriptor(TensorDescriptor, x, (block_m, block_k), a_layout)
    w_desc = descriptor(TensorDescriptor, weight.view(num_experts * hidden, k),
                        (block_n, block_k), b_layout)
    args = (x_desc, w_desc) + operands(weight, y, row_start, tile_start, ready, splits,
                                       places, width)
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                SEARCH_STEPS=(num_experts - 1).bit_length(), STAGES=stages,
                COL_ALIGN=column_alignment(hidden, splits, width), SCATTER=places is not None,
                MARK_WORDS=mark_words(places), FROM_DEST=from_dest(places),
                PUBLISHER=publisher, num_warps=4,
                maxnreg=MAXNREG if maxnreg is None else maxnreg)
    return args, meta


def check_shapes(block_m: int, block_n: int, block_k: int, num_warps: int) -> None:
    """The tile shapes this kernel is written for (ValueError otherwise)."""
    if block_m != 128 or block_n > 128 or block_n % 16 or block_k % 16 or num_warps != 4:
        raise ValueError(f"the Gluon GEMM2 runs 128 x (16..128) x 16k tiles on one "
                         f"warpgroup (4 warps), got {block_m} x {block_n} x {block_k}, "
                         f"{num_warps} warps")


def launch_grouped_gemm2_ws(x, weight, y, row_start, tile_start, ready, *, splits: int,
                            programs: int, block_m: int, block_n: int, block_k: int,
                            num_warps: int = 4, num_stages: int = 3,
                            places: TokenPlaces | None = None, publisher: bool = True,
                            warmup: bool = False, launcher: bool = False,
                            maxnreg: int | None = None, width: int | None = None):
    """`gemm2.launch_grouped_gemm2`'s contract (x [T, K] and weight [E, N, K] in bf16, y,
    offsets, ready flags, optional token-major places) with the warp-specialized kernel. With `warmup`
    it returns the compiled kernel; with `launcher` a `launch(stream=None)` callable whose
    kernel is compiled and loaded now (`gemm2.grouped_gemm2_launcher`)."""
    check_shapes(block_m, block_n, block_k, num_warps)
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ValueError(f"the Gluon GEMM2 takes bf16 x and weight, got {x.dtype}, {weight.dtype}")
    if x.shape[0] == 0:
        return (lambda stream=None: None) if launcher else None
    args, meta = _ws_args(x, weight, y, row_start, tile_start, ready, splits, block_m,
                          block_n, block_k, num_stages, places, publisher, maxnreg, width)
    if warmup:
        return grouped_gemm2_ws_kernel.warmup(*args, grid=(1,), **meta)
    if launcher:
        hit = _GEMM2_WS.compiled(args, meta)
        return lambda stream=None: _GEMM2_WS.launch((programs,), args, meta, hit, stream=stream)
    return _GEMM2_WS.launch((programs,), args, meta)


_GEMM2_WS = LaunchCache(grouped_gemm2_ws_kernel)


def compile_probe(device_index: int) -> None:
    """Compile (not launch) the kernel for a one-tile problem on this GPU: raises what the
    compiler raises where this Triton's Gluon cannot build it."""
    dev = torch.device("cuda", device_index)
    x = torch.zeros(128, 64, dtype=torch.bfloat16, device=dev)
    w = torch.zeros(1, 128, 64, dtype=torch.bfloat16, device=dev)
    y = torch.zeros(128, 128, dtype=torch.bfloat16, device=dev)
    idx = torch.zeros(2, dtype=torch.int32, device=dev)
    rows = torch.zeros(128, dtype=torch.int32, device=dev)
    places = TokenPlaces(rows, rows, 1, 1, rows)  # (the op's default: places from dest)
    launch_grouped_gemm2_ws(x, w, y, idx, idx, idx, splits=1, programs=1, block_m=128,
                            block_n=128, block_k=64, places=places, warmup=True)
