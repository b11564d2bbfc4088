"""Grouped GEMM2 with split publication: the compute side of GEMM2+GatherRS.

    y[rows of expert e, :] = x[rows of expert e, :] @ W_e^T          (bf16 in, fp32 acc)

(or e4m3 x and W with Transformer Engine's scales: `grouped_gemm2_fp8_kernel`, whose tile
walk the bf16 kernel runs unscaled; the scales' layouts and checks are `gemm2_fp8`'s)

or, with SCATTER, y[t * k + s, :] for row j of token t (token-major for GatherRS): s, the
row's slot among its token's rows, is read from the routing's second pass (FROM_DEST,
the default), or counted here (the number of the token's experts below the tile's, a
popcount of the token's expert mask from the routing's first pass), so that GEMM2 need
not wait for the second pass (`gemm2_layout.TokenPlaces`); a row that lands outside y
(only bad input, which the routing's passes record) is dropped.

A persistent kernel: exactly P programs (the planner's compute slots) walk one global
tile sequence laid out in split order. Split s covers hidden columns
[s*sw, min(N, (s+1)*sw)) with the split width sw (ceil(N/L) unless the op narrows the
last split: then sw > N/L and the last split holds the remaining N - (L-1) sw columns);
inside a split the tiles run over the global row-tile index (all experts' row tiles back
to back) and then the column tiles of the split. Program b takes tiles b, b+P, b+2P, ...
(paper section III-C), so programs run ahead into later splits before every tile of an
earlier one is done.

Readiness protocol (the consumer is `gather_rs.py`):
  * writer: every tile, after its stores, `debug_barrier` (all threads' stores issued and
    ordered within the CTA) then one `atomic_add(ready[s], 1, release, gpu)`;
  * reader: waits with acquire loads until ready[s] == expected, where
    expected = row_tiles * (column tiles of split s): ceil(sw / BLOCK_N) for every split
    but the last, ceil((N - (L-1) sw) / BLOCK_N) for it (`split_col_tiles`);
  * reset: the consumer zeroes `ready` once it has seen every split; the host zeroes it
    after an error. Nothing here allocates, so CUDA-graph capture is safe.

Worked example: N=2048, L=2, BLOCK_N=128 -> sw=1024, 8 column tiles per split; experts
with 300 and 20 rows, BLOCK_M=128 -> row tiles 3 + 1 = 4; 32 tiles per split, 64 in
all; tile 37 is split 1, row tile 0 (expert 0, rows 0..127), columns 1664..1791.
"""

from __future__ import annotations

import functools
import warnings
from array import array
from itertools import accumulate

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .gemm2_layout import (TokenPlaces, check_places, column_alignment, from_dest, mark_words,
                           next_pow2, operands, split_col_tiles)
# (ops/buffer.py and the tests also read the split geometry here, as `gemm2.split_width`)
from .gemm2_layout import split_width as split_width
from .gemm2_fp8 import (SCALING, Fp8Scales, block_scale_ptrs, block_scales, check_operands,
                        scale_operands)
from .gemm2_places import token_major_rows
from .launch_cache import LaunchCache, descriptor


_NO_SPEC = ["num_experts", "K", "num_splits", "dest_rows", "topk"]


@triton.jit(do_not_specialize=_NO_SPEC)
def grouped_gemm2_kernel(
    # tensor descriptors (TMA on Hopper) and pointers
    x_desc, w_desc, y_ptr, row_start_ptr, tile_start_ptr, ready_ptr, token_ptr, marks_ptr,
    # sizes (N and split_width are specialized: their divisibility lets the stores
    # vectorize; they change only with the model); dest_rows: rows of y when SCATTER
    num_experts, K, N, split_width, num_splits, dest_rows, topk,
    # strides
    stride_ym, stride_yn,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EXPERTS_POW2: tl.constexpr, UPCAST: tl.constexpr, COL_ALIGN: tl.constexpr,
    FLATTEN: tl.constexpr, SCATTER: tl.constexpr, MARK_WORDS: tl.constexpr,
    FROM_DEST: tl.constexpr,
):
    """bf16 x and W: the FP8 kernel's tile walk without scales (SCALING 0 compiles none
    of its scale code: the same instructions as this kernel had before FP8)."""
    grouped_gemm2_fp8_kernel(
        x_desc, w_desc, y_ptr, row_start_ptr, tile_start_ptr, ready_ptr, token_ptr, marks_ptr,
        num_experts, K, N, split_width, num_splits, dest_rows, topk, stride_ym, stride_yn,
        y_ptr, y_ptr, 0, 0, 0, 0, 0, BLOCK_M, BLOCK_N, BLOCK_K, EXPERTS_POW2, UPCAST,
        COL_ALIGN, FLATTEN, SCATTER, MARK_WORDS, FROM_DEST, 0)


@triton.jit(do_not_specialize=_NO_SPEC + ["sx_stride0"])
def grouped_gemm2_fp8_kernel(
    x_desc, w_desc, y_ptr, row_start_ptr, tile_start_ptr, ready_ptr, token_ptr, marks_ptr,
    num_experts, K, N, split_width, num_splits, dest_rows, topk, stride_ym, stride_yn,
    # the scales (`gemm2_fp8.scale_operands`; sx_stride0 changes with the rows under
    # kind "block": not specialized)
    sx_ptr, sw_ptr, sx_stride0, sx_stride1, sw_stride0, sw_stride1, sw_stride2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EXPERTS_POW2: tl.constexpr, UPCAST: tl.constexpr, COL_ALIGN: tl.constexpr,
    FLATTEN: tl.constexpr, SCATTER: tl.constexpr, MARK_WORDS: tl.constexpr,
    FROM_DEST: tl.constexpr, SCALING: tl.constexpr,
):
    """FP8 (e4m3) x and W with the scales of `gemm2_fp8.Fp8Scales` (SCALING 1: per
    tensor, 2: 1x128 x 128x128 blocks); with SCALING 0 (unscaled) the bf16 kernel's body."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    row_tiles = tl.load(tile_start_ptr + num_experts)
    col_tiles = tl.cdiv(split_width, BLOCK_N)
    last_cols = tl.cdiv(N - (num_splits - 1) * split_width, BLOCK_N)  # (narrower or equal)
    tiles_per_split = row_tiles * col_tiles
    all_tiles = tiles_per_split * (num_splits - 1) + row_tiles * last_cols
    # Every expert's tile and row ranges, loaded once into registers: a tile then finds
    # its expert without a dependent global load in front of its first TMA load.
    experts = tl.arange(0, EXPERTS_POW2)
    known = experts < num_experts
    tile_begin = tl.load(tile_start_ptr + experts, mask=known, other=2147483647)
    tile_end = tl.load(tile_start_ptr + 1 + experts, mask=known, other=2147483647)
    row_begin = tl.load(row_start_ptr + experts, mask=known, other=0)
    row_end = tl.load(row_start_ptr + 1 + experts, mask=known, other=0)
    for tile in tl.range(pid, all_tiles, num_programs, flatten=FLATTEN):
        split = tl.minimum(tile // tiles_per_split, num_splits - 1)
        in_split = tile - split * tiles_per_split
        cols_here = tl.where(split == num_splits - 1, last_cols, col_tiles)
        row_tile = in_split // cols_here
        col_tile = in_split - row_tile * cols_here
        # the expert of a row tile: the number of experts whose tiles end before it
        expert = tl.sum((tile_end <= row_tile).to(tl.int32))
        mine = experts == expert
        first_row = tl.sum(tl.where(mine, row_begin, 0)) \
            + (row_tile - tl.sum(tl.where(mine, tile_begin, 0))) * BLOCK_M
        end_row = tl.sum(tl.where(mine, row_end, 0))
        col0 = split * split_width + col_tile * BLOCK_N
        end_col = tl.multiple_of(tl.minimum(N, (split + 1) * split_width), COL_ALIGN)
        # Whole-tile loads: rows past the expert's end (the next expert's) and columns
        # past the split feed only outputs that the masked store below drops; the
        # descriptors zero-fill past the tensors' ends.
        rows = first_row + tl.arange(0, BLOCK_M)
        if SCATTER:  # y row of each x row, found before the K loop hides its latency
            if FROM_DEST:  # (token_ptr: the routing's dest, y's row of each row)
                out_rows = tl.load(token_ptr + rows, mask=rows < end_row, other=-1)
            else:
                out_rows = token_major_rows(rows, end_row, expert, token_ptr, marks_ptr,
                                            dest_rows, topk, MARK_WORDS)
        else:
            out_rows = rows
        if SCALING == 2:
            sx_rows, sw_cols, sx_ok, sw_ok = block_scale_ptrs(
                sx_ptr, sw_ptr, rows, end_row, col0, N, expert, sx_stride1, sw_stride0,
                sw_stride1, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = x_desc.load([first_row, k0])
            b = w_desc.load([expert * N + col0, k0])
            if UPCAST:  # the interpreter's bf16 dot is wrong; fp32 there is exact enough
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if SCALING == 2:  # (BLOCK_K = 128: a K step is one scale block)
                acc += tl.dot(a, b.T) * block_scales(sx_rows, sw_cols, k0 // BLOCK_K, sx_ok,
                                                     sw_ok, sx_stride0, sw_stride2)
            else:
                acc = tl.dot(a, b.T, acc)
        if SCALING == 1:
            acc *= tl.load(sx_ptr + expert * sx_stride0) * tl.load(sw_ptr + expert * sw_stride0)
        cols = col0 + tl.arange(0, BLOCK_N)
        y_tile = y_ptr + out_rows[:, None].to(tl.int64) * stride_ym + cols[None, :] * stride_yn
        if SCATTER:  # a row placed outside y (bad input) is dropped
            row_ok = (out_rows >= 0) & (out_rows < dest_rows)
        else:
            row_ok = rows < end_row
        out = acc.to(y_ptr.dtype.element_ty)
        store_ok = row_ok[:, None] & (cols < end_col)[None, :]
        tl.store(y_tile, out, mask=store_ok)
        tl.debug_barrier()  # every thread's stores are issued before the release below
        tl.atomic_add(ready_ptr + split, 1, sem="release", scope="gpu")


def expert_offsets(counts: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """row_start [E+1] and tile_start [E+1] (int32, on counts' device), no host sync."""
    counts = counts.to(torch.int32)
    zero = counts.new_zeros(1)
    row_start = torch.cat([zero, counts.cumsum(0, dtype=torch.int32)])
    tiles = (counts + block_m - 1) // block_m
    tile_start = torch.cat([zero, tiles.cumsum(0, dtype=torch.int32)])
    return row_start, tile_start


def expert_offsets_host(counts: list[int], block_m: int,
                        device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_start, tile_start, counts) of `expert_offsets` from host counts, int32: built
    on the host and copied in one non-blocking transfer (from pinned memory on CUDA), so
    the host never waits and the counts need no copy of their own."""
    return unpack_offsets(packed_offsets_host(counts, block_m, device)[0], len(counts))


def unpack_offsets(packed: torch.Tensor, experts: int):
    """(row_start, tile_start, counts) views of `packed_offsets_host`'s tensor."""
    # one C++ call for the three views: 3 slices or `Tensor.split` (a Python wrapper) cost
    # 1.7x and 2.3x its host time (CPU micro-benchmark)
    return packed.split_with_sizes((experts + 1, experts + 1, experts))


def packed_offsets_host(counts: list[int], block_m: int, device) -> tuple[torch.Tensor, int]:
    """[row_start (E+1) | tile_start (E+1) | counts (E)] int32 on `device`, and the row
    tiles of all experts (tile_start[E], what the planner's W_comp reads).

    Built on the host and sent in one non-blocking copy from pinned memory (pageable
    memory would make the copy wait for the stream); an int32 `array` read in place by
    `torch.frombuffer` costs a fraction of `torch.tensor` on nested lists (docs/RESULTS.md,
    host steps). The op's default path instead has the routing-table kernel sum the
    counts into this layout (`ops.routing.Router.route`); this is its copy path."""
    # (numpy / torch integers work too: `array` takes anything with __index__)
    tiles = list(accumulate([(c + block_m - 1) // block_m for c in counts], initial=0))
    buf = array("i", accumulate(counts, initial=0))
    buf.extend(tiles)
    buf.extend(counts)
    host = torch.frombuffer(buf, dtype=torch.int32)  # keeps `buf` alive
    if str(device).startswith("cuda"):
        host = host.pin_memory()
    return host.to(device, non_blocking=True), tiles[-1]


def _gemm2_args(x, weight, y, row_start, tile_start, ready, splits, block_m, block_n,
                block_k, num_warps, num_stages, upcast, flatten, places=None, maxnreg=None,
                width=None, scales=None):
    num_experts, hidden, k = weight.shape
    x_desc = descriptor(TensorDescriptor, x, (block_m, block_k))
    w_desc = descriptor(TensorDescriptor, weight.view(num_experts * hidden, k),
                        (block_n, block_k))
    args = (x_desc, w_desc) + operands(weight, y, row_start, tile_start, ready, splits,
                                       places, width)
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                EXPERTS_POW2=next_pow2(num_experts), UPCAST=upcast,
                COL_ALIGN=column_alignment(hidden, splits, width), FLATTEN=flatten,
                SCATTER=places is not None, MARK_WORDS=mark_words(places),
                FROM_DEST=from_dest(places), num_warps=num_warps, num_stages=num_stages)
    if scales is not None:  # (the FP8 kernel: its scales after the bf16 kernel's arguments)
        args += scale_operands(scales)
        meta["SCALING"] = SCALING[scales.kind]
    if maxnreg is not None:
        meta["maxnreg"] = maxnreg
    return args, meta


def launch_grouped_gemm2(
    x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, row_start: torch.Tensor,
    tile_start: torch.Tensor, ready: torch.Tensor, *, splits: int, programs: int,
    block_m: int, block_n: int, block_k: int, num_warps: int = 4, num_stages: int = 3,
    kernel=grouped_gemm2_kernel, upcast: bool = False, warmup: bool = False,
    flatten: bool = False, places: TokenPlaces | None = None, impl: str = "triton",
    launcher: bool = False, maxnreg: int | None = None, width: int | None = None,
    scales: Fp8Scales | None = None,
):
    """Launch with exactly `programs` persistent CTAs. x [T, K], weight [E, N, K]; y [T, N],
    or with `places` (`TokenPlaces`) a token-major [M k, N] with row j of the product
    stored at y[t k + s] (t its token, s its slot; rows placed outside y are dropped).

    x and weight must be contiguous with 16-byte aligned rows (the op checks). With
    `warmup` it compiles without launching and returns the compiled kernel. `impl`:
    "triton" (this kernel), "auto" or a Gluon kernel of `gemm2_ws` (CUDA only), same
    contract; `launcher` (Gluon only) is `grouped_gemm2_launcher`'s callable. `maxnreg`
    caps the registers per thread (None: the compiler's choice; the Gluon kernel's
    `gemm2_ws.MAXNREG`), so that other kernels' CTAs fit beside two of these per SM.
    `width`: the split width sw (default ceil(N/L); a larger one narrows the last split,
    `split_col_tiles`). `scales`: FP8 (e4m3) x and weight with TE's scales
    (`gemm2_fp8.Fp8Scales`; Triton's kernel only; `kernel` is then the FP8 one).
    """
    if width is not None:
        split_col_tiles(weight.shape[1], splits, width, block_n)  # (raises if it does not fit)
    check_places(x, weight, y, places)
    check_operands(x, weight, y, scales, block_k, impl)
    if scales is not None:
        kernel = grouped_gemm2_fp8_kernel
    impl = resolve_impl(impl, x.device, x.dtype, block_m, block_n, num_warps,
                        places is not None)
    if impl != "triton":
        return _gluon(impl)(x, weight, y, row_start, tile_start, ready, splits=splits,
                            programs=programs, block_m=block_m, block_n=block_n,
                            block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                            places=places, publisher=impl != "gluon_inline_publish",
                            warmup=warmup, launcher=launcher, maxnreg=maxnreg, width=width)
    if launcher:
        raise ValueError("launcher=True is for the Gluon kernels: use grouped_gemm2_launcher")
    if x.shape[0] == 0:
        return None  # no rows, no tiles: every split is ready with zero tiles
    args, meta = _gemm2_args(x, weight, y, row_start, tile_start, ready, splits, block_m,
                             block_n, block_k, num_warps, num_stages, upcast, flatten, places,
                             maxnreg, width, scales)
    if warmup:
        return kernel.warmup(*args, grid=(1,), **meta)
    for cache in (_GEMM2, _GEMM2_FP8):
        if kernel is cache.kernel:
            return cache.launch((programs,), args, meta)
    return kernel[(programs,)](*args, **meta)


def grouped_gemm2_launcher(x, weight, y, row_start, tile_start, ready, *, splits: int,
                           programs: int, block_m: int, block_n: int, block_k: int,
                           num_warps: int = 4, num_stages: int = 3, upcast: bool = False,
                           flatten: bool = False, places: TokenPlaces | None = None,
                           impl: str = "triton", maxnreg: int | None = None,
                           width: int | None = None, scales: Fp8Scales | None = None):
    """A callable `launch(stream=None)` that launches GEMM2 (as `launch_grouped_gemm2`),
    with its kernel compiled and loaded now: launched after GatherRS, GEMM2 must not wait
    for a JIT compile or a lazy module load while communication CTAs spin on its flags."""
    check_operands(x, weight, y, scales, block_k, impl)
    if resolve_impl(impl, x.device, x.dtype, block_m, block_n, num_warps,
                    places is not None) != "triton":
        return launch_grouped_gemm2(x, weight, y, row_start, tile_start, ready,
                                    splits=splits, programs=programs, block_m=block_m,
                                    block_n=block_n, block_k=block_k, num_warps=num_warps,
                                    num_stages=num_stages, places=places, impl=impl,
                                    launcher=True, maxnreg=maxnreg, width=width)
    check_places(x, weight, y, places)
    if x.shape[0] == 0:
        return lambda stream=None: None
    args, meta = _gemm2_args(x, weight, y, row_start, tile_start, ready, splits, block_m,
                             block_n, block_k, num_warps, num_stages, upcast, flatten, places,
                             maxnreg, width, scales)
    cache = _GEMM2 if scales is None else _GEMM2_FP8
    hit = cache.compiled(args, meta)
    return lambda stream=None: cache.launch((programs,), args, meta, hit, stream=stream)


_GEMM2 = LaunchCache(grouped_gemm2_kernel)
_GEMM2_FP8 = LaunchCache(grouped_gemm2_fp8_kernel)

#: GEMM2 implementations: this file's Triton kernel, and the warp-specialized Gluon
#: kernel of `gemm2_ws` (Hopper): tiles published by a warp of their own, or by the
#: warpgroup that stored them ("gluon_inline_publish"); "auto" picks (`resolve_impl`)
IMPLS = ("triton", "gluon", "gluon_inline_publish")


def resolve_impl(impl: str, device: torch.device, dtype: torch.dtype, block_m: int,
                 block_n: int, num_warps: int, scatter: bool) -> str:
    """`impl`, or for "auto" the Gluon kernel where it runs and measured faster: bf16 on a
    Hopper GPU with its one tile shape, storing a token-major y (`scatter`, the TP
    layouts: 4-12% faster overlapped; in GEMM2's row order, under EP, no gain measured;
    docs/RESULTS.md, "Kernel choices measured"); else Triton's, FP8 always (the Gluon
    kernel has no scales: `gemm2_fp8.check_operands` refuses it for FP8)."""
    if impl != "auto":
        return impl
    ok = (scatter and device.type == "cuda" and dtype == torch.bfloat16 and block_m == 128
          and block_n <= 128 and num_warps == 4 and _gluon_runs_on(device.index or 0))
    return "gluon" if ok else "triton"


@functools.lru_cache(maxsize=16)
def _gluon_runs_on(device_index: int) -> bool:
    if torch.cuda.get_device_capability(device_index) != (9, 0):
        return False  # wgmma and this TMA pipeline are sm_90 only
    try:
        from . import gemm2_ws
    except (ImportError, AttributeError):  # a Triton without (this) Gluon API
        return False
    try:  # one small compile: a Triton whose Gluon cannot build the kernel falls back here
        gemm2_ws.compile_probe(device_index)  # instead of failing inside the op's launch
    except Exception as err:  # noqa: BLE001 - any compiler error means "not here"
        warnings.warn(f"the Gluon GEMM2 does not build with Triton {triton.__version__} "
                      f"({type(err).__name__}: {str(err)[:200]}); GEMM2 runs the Triton "
                      f"kernel", RuntimeWarning, stacklevel=2)
        return False
    return True


def _gluon(impl: str):
    if impl not in IMPLS:
        raise ValueError(f"GEMM2 impl must be one of {IMPLS}, got {impl!r}")
    from . import gemm2_ws  # Gluon is imported only where it is used (CUDA)

    return gemm2_ws.launch_grouped_gemm2_ws



def grouped_gemm2_reference(x: torch.Tensor, weight: torch.Tensor,
                            counts: list[int]) -> torch.Tensor:
    """Pure torch: y rows of expert e = x rows of e @ W_e^T, in x's dtype (fp32 math)."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        outs.append(x[start:start + n].float() @ weight[e].float().t())
        start += n
    y = torch.cat(outs) if outs else x.new_zeros(0, weight.shape[1])
    return y.to(x.dtype)
