"""Per-group current (or delayed) scaling of expert-sorted rows in two launches.

Transformer Engine's GroupedLinear quantizes its input under `Float8CurrentScaling` one
expert at a time (`tex.split_quantize`, one quantizer per GEMM): per expert an amax
kernel, a scale and a cast, on host-split views, after a host sync for the split. With
128 experts that is hundreds of launches per FC1 / FC2 (one H100, Qwen 4 x 4096: FC2's
forward without its GEMM 3.2 ms, `docs/data/fp8_gemm2_probe_h100.json`). Here the groups
are contiguous row ranges known on the device only:

    x [R, K] (bf16 / fp16 / fp32), group_ends [G] int (cumulative rows of each group,
    the last <= R; rows past it are padding) ->
        data [R, K] e4m3:  saturate(x * scale_g) for the group g of each row (padding: 0)
        group_scale_inv [G] fp32: 1 / scale_g (TE's scale_inv of each group's tensor)
        row_scale_inv  [R] fp32: each row's group scale_inv (padding: 0), the row-wise
                               scale a scaled grouped GEMM reads

with scale_g = 448 / amax_g as TE's `compute_scale_from_amax` (epsilon 0, no power-of-2
rounding: Float8CurrentScaling's defaults): amax 0, inf or NaN gives 1, an infinite
scale FLT_MAX. The same bits as `quantize_tensorwise_splits` (kernels/fp8_quant.py, TE
emulated), the reference below: IEEE-rounded divisions (`div_rn`) and the saturating
round-to-nearest cast TE makes. Launch 1 (`group_amax_kernel`) reduces each row's |x|
and folds it into its group's amax by a float atomic max (amax is non-negative); launch
2 (`cast_rows_kernel`) scales and casts. A weight stack [E, N, K] is the same call on
[E * N, K] with group_ends = N, 2N, ... (`stack_group_ends`).

Delayed scaling (TE's `Float8Quantizer`) is the same two launches with the scales given:
launch 1 folds each group's amax into the caller's amax slots (a strided view of TE's
amax history), launch 2 casts with the given scale_g (a strided view of TE's scales),
scale_inv = 1 / scale_g.

e5m2 in e4m3 (`carrier=E4M3`, TE's hybrid gradients for GEMMs that take e4m3 alone, as
torch's scaled grouped GEMM on sm90): the values rounded to e5m2 as above are stored
times a power of two 2^k_g in e4m3, whose 3 mantissa bits hold e5m2's 2, and scale_inv
times 2^-k_g, so every product is the e5m2 one. k_g puts the group's largest scaled
value (amax_g scale_g, within 57344) in (224, 448]: -7 under current scaling, more under
a delayed scale that leaves e5m2's top unused (the first step's scale 1). Exact for
every value above 2^-14 of that largest (e4m3's normals); smaller ones land on e4m3's
subnormal grid, an error under 2^-17 of it, where e5m2's own rounding is up to 2^-3 of
each value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_quant import (FP8_MAX, FLT_MAX, quantize_tensorwise_splits, quantize_with_scale,
                        scale_from_amax)
from .launch_cache import LaunchCache

E4M3 = torch.float8_e4m3fn
#: the most groups one call takes (one program compares each row with every group end)
MAX_GROUPS = 1024


@triton.jit
def _group_of(rows, ends_ptr, groups, GROUPS_P2: tl.constexpr):
    """The group of each row: how many group ends are <= the row (== groups: padding)."""
    g = tl.arange(0, GROUPS_P2)
    ends = tl.load(ends_ptr + g, mask=g < groups, other=0x7FFFFFFF).to(tl.int64)
    return tl.sum((rows.to(tl.int64)[:, None] >= ends[None, :]).to(tl.int32), axis=1)


@triton.jit
def _scale_of(amax, FP8_MAX: tl.constexpr, INF_SCALE: tl.constexpr = 3.4028234663852886e38):
    """TE's compute_scale_from_amax (epsilon 0, no pow2), IEEE division; FP8_MAX 448 for
    e4m3, 57344 for e5m2; an infinite scale becomes INF_SCALE (fp32's largest value, or
    the blockwise quantizer's input type's)."""
    usable = (amax > 0) & (amax < float("inf"))  # (NaN compares false)
    safe = tl.where(usable, amax, 1.0)
    scale = tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), safe)
    scale = tl.where(scale == float("inf"), INF_SCALE, scale)
    return tl.where(usable, scale, 1.0)


@triton.jit
def _round_to_e4m3(v):
    """v (fp32, within +-448) rounded to nearest-even e4m3 value, still fp32: 3 mantissa
    bits kept for normals (|v| >= 2^-6), multiples of 2^-9 below. Then the cast is exact
    everywhere: the Triton interpreter's own fp32 -> e4m3 rounding is wrong at ties and
    where rounding carries into the exponent (127.97 -> 64), a GPU's is not needed."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    tiny = (tl.abs(v) + 16384.0) - 16384.0  # (fp32's ulp at 2^14 is 2^-9: one RNE add)
    tiny = tl.where(bits < 0, -tiny, tiny)
    return tl.where(tl.abs(v) < 0.015625, tiny, normal)


@triton.jit
def _round_to_e5m2(v):
    """v (fp32, within +-57344) rounded to nearest-even e5m2 value, still fp32: 2 mantissa
    bits kept for normals (|v| >= 2^-14), multiples of 2^-16 below (as `_round_to_e4m3`)."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0xFFFFF + ((bits >> 21) & 1)) & -0x200000).to(tl.float32, bitcast=True)
    tiny = (tl.abs(v) + 128.0) - 128.0  # (fp32's ulp at 2^7 is 2^-16: one RNE add)
    tiny = tl.where(bits < 0, -tiny, tiny)
    return tl.where(tl.abs(v) < 6.103515625e-05, tiny, normal)


@triton.jit
def _saturated_round(v, E5M2: tl.constexpr):
    """v (fp32) saturated to the format's largest value and rounded to its grid (fp32)."""
    if E5M2:
        return _round_to_e5m2(tl.minimum(tl.maximum(v, -57344.0), 57344.0))
    return _round_to_e4m3(tl.minimum(tl.maximum(v, -448.0), 448.0))


@triton.jit
def _pow2(k):
    """2^k (int32 k within fp32's normal exponents) as fp32, built from its bits."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _carry_exponent(group, live, amax_ptr, amax_stride, scale, CARRY_E4M3: tl.constexpr):
    """k of the power of two 2^k each group's e5m2 values are carried in e4m3 with: the
    largest with top * 2^k <= 448, top = min(amax * scale, 57344) the group's largest
    scaled value (-7 under current scaling; where top is 0, inf or NaN too); 0 where not
    carrying. e5m2's rounding of a value <= top stays <= 448 * 2^-k: 448 is on its grid."""
    if CARRY_E4M3:
        amax = tl.load(amax_ptr + group * amax_stride, mask=live, other=0.0)
        top = tl.minimum(amax * scale, 57344.0)
        usable = (top > 0) & (top < float("inf"))  # (NaN compares false)
        top = tl.where(usable, tl.maximum(top, 8.673617379884035e-19), 57344.0)  # (2^-60)
        bits = top.to(tl.int32, bitcast=True)
        # top = m 2^e, m in [1, 2): k = 8 - e, one less where m > 1.75 (448 = 1.75 2^8)
        return 135 - ((bits >> 23) & 0xFF) - ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return tl.zeros(group.shape, tl.int32)


@triton.jit
def _source_rows(r, live, src_ptr, HAS_SRC: tl.constexpr):
    """int64 row of x each row r reads: src[r] (a gather) or r itself."""
    if HAS_SRC:
        return tl.load(src_ptr + r, mask=live, other=0).to(tl.int64)
    return r.to(tl.int64)


@triton.jit(do_not_specialize=["rows", "groups", "amax_stride"])
def group_amax_kernel(x_ptr, src_ptr, ends_ptr, amax_ptr, rows, groups, stride_x, amax_stride,
                      K: tl.constexpr, GROUPS_P2: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_K: tl.constexpr, HAS_SRC: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    group = _group_of(r, ends_ptr, groups, GROUPS_P2)
    live = (r < rows) & (group < groups)
    src = _source_rows(r, live, src_ptr, HAS_SRC)
    row_max = tl.zeros((BLOCK_R,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        c = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_ptr + src[:, None] * stride_x + c[None, :],
                    mask=live[:, None] & (c < K)[None, :], other=0.0)
        row_max = tl.maximum(row_max, tl.max(tl.abs(v.to(tl.float32)), axis=1))
    tl.atomic_max(amax_ptr + group * amax_stride, row_max, mask=live, sem="relaxed")


@triton.jit
def _group_scale(group, live, amax_ptr, amax_stride, scale_ptr, scale_stride,
                 FP8_MAX: tl.constexpr, GIVEN: tl.constexpr):
    """Each group's scale: given (delayed scaling: scale_ptr[group * scale_stride]) or
    current scaling's from its amax; 1 where not `live`."""
    if GIVEN:
        return tl.load(scale_ptr + group * scale_stride, mask=live, other=1.0)
    return _scale_of(tl.load(amax_ptr + group * amax_stride, mask=live, other=0.0), FP8_MAX)


@triton.jit(do_not_specialize=["rows", "groups", "scale_stride", "amax_stride"])
def cast_rows_kernel(x_ptr, src_ptr, ends_ptr, amax_ptr, scale_ptr, out_ptr, row_scale_inv_ptr,
                     group_scale_inv_ptr, rows, groups, stride_x, scale_stride, amax_stride,
                     K: tl.constexpr,
                     GROUPS_P2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                     HAS_SRC: tl.constexpr, E5M2: tl.constexpr, FP8_MAX: tl.constexpr,
                     GIVEN_SCALE: tl.constexpr, CARRY_E4M3: tl.constexpr):
    pid = tl.program_id(0)
    if pid == 0:  # the groups' scale_inv, once
        g = tl.arange(0, GROUPS_P2)
        s = _group_scale(g, g < groups, amax_ptr, amax_stride, scale_ptr, scale_stride,
                         FP8_MAX, GIVEN_SCALE)
        kg = _carry_exponent(g, g < groups, amax_ptr, amax_stride, s, CARRY_E4M3)
        tl.store(group_scale_inv_ptr + g,
                 tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s) * _pow2(-kg),
                 mask=g < groups)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    group = _group_of(r, ends_ptr, groups, GROUPS_P2)
    live = (r < rows) & (group < groups)
    src = _source_rows(r, live, src_ptr, HAS_SRC)
    scale = _group_scale(group, live, amax_ptr, amax_stride, scale_ptr, scale_stride,
                         FP8_MAX, GIVEN_SCALE)
    k = _carry_exponent(group, live, amax_ptr, amax_stride, scale, CARRY_E4M3)
    one = tl.full(scale.shape, 1.0, tl.float32)
    tl.store(row_scale_inv_ptr + r,
             tl.where(live, tl.math.div_rn(one, scale) * _pow2(-k), 0.0), mask=r < rows)
    for k0 in range(0, K, BLOCK_K):
        c = k0 + tl.arange(0, BLOCK_K)
        inside = (r < rows)[:, None] & (c < K)[None, :]
        v = tl.load(x_ptr + src[:, None] * stride_x + c[None, :],
                    mask=live[:, None] & (c < K)[None, :], other=0.0)
        q = _saturated_round(v.to(tl.float32) * scale[:, None], E5M2)
        if CARRY_E4M3:  # (e5m2's values in e4m3: times 2^k, rounded where subnormal)
            q = _round_to_e4m3(q * _pow2(k)[:, None])
        tl.store(out_ptr + r.to(tl.int64)[:, None] * K + c[None, :],
                 q.to(out_ptr.dtype.element_ty), mask=inside)


_AMAX = LaunchCache(group_amax_kernel)
_CAST = LaunchCache(cast_rows_kernel)


def _tiles(k: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_K): 16-byte loads along K, about 8192 elements a K step."""
    block_k = min(256, triton.next_power_of_2(max(k, 16)))
    return max(8, 8192 // block_k), block_k


def _check(x: torch.Tensor, group_ends: torch.Tensor, src: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be [R, K] bf16 / fp16 / fp32, got {tuple(x.shape)} {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError(f"x's rows must be contiguous, got strides {x.stride()}")
    if (group_ends.dim() != 1 or group_ends.is_floating_point()
            or group_ends.device != x.device):
        raise ValueError(f"group_ends must be [G] integers on {x.device}, got "
                         f"{tuple(group_ends.shape)} {group_ends.dtype} on {group_ends.device}")
    if not 0 < group_ends.numel() <= MAX_GROUPS:
        raise ValueError(f"1 to {MAX_GROUPS} groups, got {group_ends.numel()}")
    if src is not None and (src.dim() != 1 or src.dtype != torch.int64
                            or src.device != x.device):
        raise ValueError(f"src must be int64 [R] on {x.device}, got {tuple(src.shape)} "
                         f"{src.dtype} on {src.device}")


def _check_delayed(scale, amax_into, groups: int, device) -> None:
    if (scale is None) != (amax_into is None):
        raise ValueError("scale and amax_into go together (delayed scaling), or neither")
    for name, t in (("scale", scale), ("amax_into", amax_into)):
        if t is not None and (t.shape != (groups,) or t.dtype != torch.float32
                              or t.device != device):
            raise ValueError(f"{name} must be fp32 [{groups}] on {device}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")


def _carries(dtype: torch.dtype, carrier: torch.dtype | None) -> bool:
    """Whether e5m2's values are stored in e4m3 (`carrier`); refuses other pairs."""
    if dtype not in FP8_MAX:
        raise ValueError(f"dtype must be one of {tuple(FP8_MAX)}, got {dtype}")
    if carrier not in (None, dtype, E4M3):
        raise ValueError(f"carrier must be None, dtype ({dtype}) or {E4M3}, got {carrier}")
    return carrier == E4M3 and dtype == torch.float8_e5m2


def quantize_groups(x: torch.Tensor, group_ends: torch.Tensor,
                    src: torch.Tensor | None = None, dtype: torch.dtype = E4M3,
                    scale: torch.Tensor | None = None, amax_into: torch.Tensor | None = None,
                    carrier: torch.dtype | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data [R, K] e4m3, group_scale_inv [G] fp32, row_scale_inv [R] fp32): each group
    of rows of x (the rows before group_ends[g], from the previous end) quantized as one
    tensor under TE's current scaling (module doc). With `src` (int64 [R]) the rows are
    x[src] (x [N, K]), gathered while quantizing: a permutation never written in bf16.
    Rows past the last end are padding: written 0 with row scale_inv 0, read nowhere
    (nor is their src). Ends must be non-decreasing and at most R, and src of the other
    rows in [0, N): the device holds them, they are not checked here. `dtype`: e4m3, or
    e5m2 (TE's gradient format under `--fp8-format hybrid`; scale 57344 / amax).
    Delayed scaling: `scale` and `amax_into` (fp32 [G], any stride: views of TE's scale
    and amax history) -- group g is cast with scale[g] (scale_inv 1 / scale[g], TE's
    Float8Quantizer) and its amax folded into amax_into[g] by max, as TE's cast records
    it for the next scale update. `carrier`: the dtype data is stored in, `dtype` (None)
    or e4m3 for e5m2's values (module doc: times a power of two per group, scale_inv
    divided by it)."""
    _check(x, group_ends, src)
    carry = _carries(dtype, carrier)
    rows, k = (x.shape[0] if src is None else src.numel()), x.shape[1]
    groups = group_ends.numel()
    _check_delayed(scale, amax_into, groups, x.device)
    data = torch.empty(rows, k, dtype=E4M3 if carry else dtype, device=x.device)
    amax = (torch.zeros(groups, dtype=torch.float32, device=x.device) if amax_into is None
            else amax_into)
    group_scale_inv = torch.empty(groups, dtype=torch.float32, device=x.device)
    row_scale_inv = torch.empty(rows, dtype=torch.float32, device=x.device)
    block_r, block_k = _tiles(k)
    grid = (max(1, triton.cdiv(rows, block_r)),)
    meta = dict(K=k, GROUPS_P2=triton.next_power_of_2(groups), BLOCK_R=block_r,
                BLOCK_K=block_k, HAS_SRC=src is not None, num_warps=4)
    cast_meta = dict(meta, E5M2=dtype == torch.float8_e5m2, FP8_MAX=FP8_MAX[dtype],
                     GIVEN_SCALE=scale is not None, CARRY_E4M3=carry)
    index = group_ends if src is None else src  # (not read without src)
    given = amax if scale is None else scale  # (not read without a given scale)
    if rows and k:
        _AMAX.launch(grid, (x, index, group_ends, amax, rows, groups, x.stride(0),
                            amax.stride(0)), meta)
    _CAST.launch(grid, (x, index, group_ends, amax, given, data, row_scale_inv,
                        group_scale_inv, rows, groups, x.stride(0), given.stride(0),
                        amax.stride(0)), cast_meta)
    return data, group_scale_inv, row_scale_inv


def stack_group_ends(experts: int, rows_each: int, device) -> torch.Tensor:
    """group_ends of a weight stack [E, N, K] read as [E * N, K]: N, 2N, ..., E * N."""
    return torch.arange(1, experts + 1, device=device, dtype=torch.int64) * rows_each


def quantize_groups_reference(x: torch.Tensor, counts: list[int],
                              src: torch.Tensor | None = None, dtype: torch.dtype = E4M3,
                              scale: torch.Tensor | None = None,
                              amax_into: torch.Tensor | None = None,
                              carrier: torch.dtype | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same in pure torch from host counts (TE's per-expert quantizer emulated,
    `quantize_tensorwise_splits`; with `scale`, `quantize_with_scale` per group and each
    group's amax folded into `amax_into`; with `carrier` e5m2's values moved to e4m3),
    padding rows as the kernel writes them."""
    carry = _carries(dtype, carrier)
    _check_delayed(scale, amax_into, len(counts), x.device)
    if src is not None:  # (the padding rows' src may be anything: clamped, then dropped)
        x = x[src.clamp(0, x.shape[0] - 1)]
    rows = sum(counts)
    if scale is None:
        data, group_scale_inv = quantize_tensorwise_splits(x[:rows], counts, dtype)
    else:
        data, group_scale_inv = _delayed_splits_reference(x[:rows], counts, dtype, scale,
                                                          amax_into)
    if carry:
        data, group_scale_inv = _carried_reference(data, counts, x[:rows], group_scale_inv,
                                                   scale, amax_into)
    pad = x.shape[0] - rows
    data = torch.cat([data, torch.zeros(pad, x.shape[1], dtype=data.dtype, device=x.device)])
    row_scale_inv = torch.cat([group_scale_inv.float().repeat_interleave(
        torch.tensor(counts, device=x.device)), torch.zeros(pad, device=x.device)])
    return data, group_scale_inv.float(), row_scale_inv


def _carried_reference(data, counts, x, group_scale_inv, scale, amax_into):
    """e5m2 data [R, K] carried in e4m3 (module doc): each group's values times its 2^k,
    the largest with top 2^k <= 448 = 0.875 2^9 (frexp: top = m 2^e, m in [0.5, 1)), top
    its amax times scale within 57344 (2^-7 where 0, inf or NaN); scale_inv times 2^-k."""
    if scale is None:  # (current scaling: each group's amax; an empty group's 0)
        amax = torch.stack([part.abs().amax().float() if part.numel()
                            else torch.zeros((), device=x.device) for part in x.split(counts)])
        scale = scale_from_amax(amax, FP8_MAX[torch.float8_e5m2])
    else:
        amax = amax_into
    e5m2_max = FP8_MAX[torch.float8_e5m2]
    top = (amax.float() * scale.float()).clamp_max(e5m2_max)  # (NaN stays NaN)
    top = torch.where((top > 0) & top.isfinite(), top.clamp_min(2.0 ** -60), e5m2_max)
    m, e = torch.frexp(top)
    k = 9 - e - (m > 0.875).to(e.dtype)
    rows_k = k.repeat_interleave(torch.tensor(counts, device=data.device))
    carried = (data.float() * torch.pow(2.0, rows_k.double()).float()[:, None]).to(E4M3)
    return carried, group_scale_inv.float() * torch.pow(2.0, -k.double()).float()


def _delayed_splits_reference(x, counts, dtype, scale, amax_into):
    """(data, scale_inv [G]) of each group cast with its given scale, its amax folded
    into amax_into (TE's Float8Quantizer per group)."""
    data, amax = [], []
    for part, group_scale in zip(x.split(list(counts)), scale.unbind()):
        data.append(quantize_with_scale(part, group_scale, dtype)[0])
        amax.append(part.abs().amax().float() if part.numel() else scale.new_zeros(()))
    amax_into.copy_(torch.maximum(amax_into, torch.stack(amax)))
    return torch.cat(data), 1.0 / scale.float()


assert FP8_MAX[E4M3] == 448.0 and FLT_MAX == 3.4028234663852886e38  # (the kernel's constants)
