"""Rows through Transformer Engine's 1x128 block quantization and back, exactly, in bf16.

`Float8BlockScaling` (Megatron's `--fp8-recipe blockwise`) quantizes activations in 1 x 128
blocks and weights in 128 x 128 blocks, each block's scale a power of two by default
(`power_2_scale`, unless NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1). An e4m3 value has at most
4 significant bits, so q * scale_inv with a power-of-two scale_inv is exactly a bf16
value (8 significant bits, fp32's exponent range): the dequantized operand IS the FP8
operand, and a bf16 GEMM of dequantized operands with fp32 accumulation is the product
TE's block-scaled FP8 GEMM computes, to the order of the fp32 sums. So the grouped
blockwise path quantizes and dequantizes in one pass and runs the bf16 grouped kernels.

    x [R, K] bf16 -> out [R, K] bf16: each row's 128-column blocks b
        amax_b = max |x| over the block; scale_b = TE's compute_scale_from_amax (448 /
        amax, an infinite one the input type's largest value, power of two: the mantissa
        cleared; amax 0 / inf / NaN: 1); out = round_to_e4m3(saturate(x * scale_b)) /
        scale_b

One launch, one [BLOCK_R, 128] tile per program. The reference is kernels/fp8_quant.py's
emulation of TE's quantizer, dequantized (`fake_quantize_rows_reference`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_quant import BLOCK, dequantize_blockwise, quantize_blockwise
from .fp8_rows import _saturated_round, _scale_of
from .launch_cache import LaunchCache


@triton.jit
def _block_scale(amax, FP8_MAX: tl.constexpr):
    """TE's compute_scale_from_amax with power-of-two scales (FP8_MAX: 448 for e4m3,
    57344 for e5m2): current scaling's, an infinite one bf16's largest value (the
    input's type), the mantissa cleared (1 stays 1)."""
    scale = _scale_of(amax, FP8_MAX, 3.3895313892515355e38)  # (bf16's largest value)
    return (scale.to(tl.int32, bitcast=True) & -0x800000).to(tl.float32, bitcast=True)


@triton.jit
def _through_blocks(v, amax, AXIS: tl.constexpr, E5M2: tl.constexpr):
    """v's values through blocks of the given amax (along AXIS of the tile) and back."""
    if E5M2:
        scale = tl.expand_dims(_block_scale(amax, 57344.0), AXIS)
    else:
        scale = tl.expand_dims(_block_scale(amax, 448.0), AXIS)
    return _saturated_round(v * scale, E5M2) / scale  # (a power of two: exact)


@triton.jit(do_not_specialize=["rows"])
def fake_quantize_rows_kernel(x_ptr, out_ptr, rows, K: tl.constexpr, BLOCK_R: tl.constexpr,
                              BLOCK_K: tl.constexpr, E5M2: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    inside = (r < rows)[:, None] & (c < K)[None, :]
    offs = r.to(tl.int64)[:, None] * K + c[None, :]
    v = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    out = _through_blocks(v, tl.max(tl.abs(v), axis=1), 1, E5M2)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def fake_quantize_columns_kernel(x_ptr, ends_ptr, out_ptr, K: tl.constexpr,
                                 SPLIT: tl.constexpr, BLOCK_K: tl.constexpr,
                                 E5M2: tl.constexpr):
    """Group g's rows in blocks of 128 from its first row (the last one partial), each
    column of a block one block; program (g, column tile, s) takes the blocks s, s +
    SPLIT, .. of its group."""
    g = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    start = tl.load(ends_ptr + tl.maximum(g - 1, 0)).to(tl.int64)
    start = tl.where(g > 0, start, 0)
    end = tl.load(ends_ptr + g).to(tl.int64)
    for r0 in range(start + tl.program_id(2) * 128, end, SPLIT * 128):
        r = r0 + tl.arange(0, 128)
        inside = (r < end)[:, None] & (c < K)[None, :]
        offs = r[:, None] * K + c[None, :]
        v = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        out = _through_blocks(v, tl.max(tl.abs(v), axis=0), 0, E5M2)
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def fake_quantize_weights_kernel(w_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr,
                                 BLOCK: tl.constexpr):
    """One 128 x 128 block of one expert's [N, K] matrix per program (axis 0: expert and
    block row, the expert's blocks from its first row)."""
    row_blocks: tl.constexpr = (N + BLOCK - 1) // BLOCK
    e = (tl.program_id(0) // row_blocks).to(tl.int64)
    r = (tl.program_id(0) % row_blocks) * BLOCK + tl.arange(0, BLOCK)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = (r < N)[:, None] & (c < K)[None, :]
    offs = e * N * K + r[:, None] * K + c[None, :]
    v = tl.load(w_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(v), axis=1), axis=0)
    scale = _block_scale(amax, 448.0)
    out = _saturated_round(v * scale, False) / scale
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=inside)


_FAKE = LaunchCache(fake_quantize_rows_kernel)
_FAKE_WEIGHTS = LaunchCache(fake_quantize_weights_kernel)
_FAKE_COLUMNS = LaunchCache(fake_quantize_columns_kernel)
_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _check(x: torch.Tensor, fmt: str = "e4m3") -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be [R, K] bf16, got {getattr(x, 'shape', type(x).__name__)} "
                         f"{getattr(x, 'dtype', '')}")
    if fmt not in _FORMATS:
        raise ValueError(f"fmt must be one of {tuple(_FORMATS)}, got {fmt!r}")


def fake_quantize_rows(x: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """[R, K] bf16: x quantized in 1 x 128 blocks as TE's blockwise recipe quantizes
    activations (and, for dgrad, gradients; `fmt` "e4m3" or "e5m2", power-of-two scales),
    dequantized exactly (module doc)."""
    _check(x, fmt)
    x = x.contiguous()
    out = torch.empty_like(x)
    rows, k = x.shape
    if rows and k:
        grid = (triton.cdiv(rows, 32), triton.cdiv(k, BLOCK))
        _FAKE.launch(grid, (x, out, rows), dict(K=k, BLOCK_R=32, BLOCK_K=BLOCK,
                                                 E5M2=fmt == "e5m2", num_warps=4))
    return out


def fake_quantize_rows_reference(x: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """The same from TE's quantizer emulated (kernels/fp8_quant.py)."""
    _check(x, fmt)
    return dequantize_blockwise(*quantize_blockwise(x, 1, _FORMATS[fmt]), 1).to(torch.bfloat16)


def fake_quantize_columns(x: torch.Tensor, ends: torch.Tensor, fmt: str = "e4m3"
                          ) -> torch.Tensor:
    """[R, K] bf16: each group's rows (group g: rows ends[g-1] to ends[g], ends [E] int on
    x's device) quantized in 128 x 1 blocks from the group's first row, as TE's blockwise
    recipe quantizes a wgrad operand (the columnwise copy of each expert's tensor: x, h
    and dL/dy), dequantized exactly; rows past ends[-1] are not written. One launch."""
    _check(x, fmt)
    x = x.contiguous()
    out = torch.empty_like(x)
    rows, k = x.shape
    groups = ends.numel()
    if rows and k and groups:
        # (blocks of a group over up to 8 programs: 40 experts' columns fill an H100)
        split = max(1, min(8, triton.cdiv(rows, groups * BLOCK)))
        block_k = 64
        grid = (groups, triton.cdiv(k, block_k), split)
        _FAKE_COLUMNS.launch(grid, (x, ends, out), dict(
            K=k, SPLIT=split, BLOCK_K=block_k, E5M2=fmt == "e5m2", num_warps=4))
    return out


def fake_quantize_columns_reference(x: torch.Tensor, ends: list[int], fmt: str = "e4m3"
                                    ) -> torch.Tensor:
    """The same from TE's quantizer emulated, one group's transpose at a time (rows past
    ends[-1] zero)."""
    _check(x, fmt)
    out = torch.zeros_like(x)
    start = 0
    for end in ends:
        if end > start:
            part = x[start:end].t().contiguous()
            data, scale_inv = quantize_blockwise(part, 1, _FORMATS[fmt])
            out[start:end] = dequantize_blockwise(data, scale_inv, 1).t().to(torch.bfloat16)
        start = end
    return out


def fake_quantize_weights(weight: torch.Tensor) -> torch.Tensor:
    """[E, N, K] bf16: each expert's weight quantized in 128 x 128 blocks as TE's blockwise
    recipe quantizes weights (power-of-two scales), dequantized exactly: one launch
    (once per change of the weights: every step in training)."""
    if weight.dim() != 3 or not weight.is_floating_point():
        raise ValueError(f"weight must be a stack [E, N, K] of floats, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    # (the stack's bf16 values, as the reference quantizes: fp32 parameters rounded here,
    # not in the kernel, where the interpreter's cast truncates)
    weight = weight.to(torch.bfloat16).contiguous()
    out = torch.empty(weight.shape, dtype=torch.bfloat16, device=weight.device)
    e, n, k = weight.shape
    if out.numel():
        grid = (e * triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK))
        _FAKE_WEIGHTS.launch(grid, (weight, out), dict(N=n, K=k, BLOCK=BLOCK, num_warps=8))
    return out


def fake_quantize_weights_reference(weight: torch.Tensor) -> torch.Tensor:
    """The same from TE's quantizer emulated, one expert at a time (float64 temporaries)."""
    if weight.dim() != 3:
        raise ValueError(f"weight must be a stack [E, N, K], got {tuple(weight.shape)}")
    out = torch.empty(weight.shape, dtype=torch.bfloat16, device=weight.device)
    for e, w in enumerate(weight):
        data, scale_inv = quantize_blockwise(w.to(torch.bfloat16), BLOCK)
        out[e] = dequantize_blockwise(data, scale_inv, BLOCK)
    return out
