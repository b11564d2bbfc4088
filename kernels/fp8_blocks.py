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
from .fp8_rows import _round_to_e4m3
from .launch_cache import LaunchCache

#: the largest bf16 value: TE's scale for an amax too small for a finite fp32 scale
BF16_MAX = 3.3895313892515355e38


@triton.jit
def _block_scale(amax):
    """TE's compute_scale_from_amax for e4m3 with power-of-two scales."""
    usable = (amax > 0) & (amax < float("inf"))
    safe = tl.where(usable, amax, 1.0)
    scale = tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), safe)
    scale = tl.where(scale == float("inf"), 3.3895313892515355e38, scale)
    scale = (scale.to(tl.int32, bitcast=True) & -0x800000).to(tl.float32, bitcast=True)
    return tl.where(usable, scale, 1.0)


@triton.jit(do_not_specialize=["rows"])
def fake_quantize_rows_kernel(x_ptr, out_ptr, rows, K: tl.constexpr, BLOCK_R: tl.constexpr,
                              BLOCK_K: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    inside = (r < rows)[:, None] & (c < K)[None, :]
    offs = r.to(tl.int64)[:, None] * K + c[None, :]
    v = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    scale = _block_scale(tl.max(tl.abs(v), axis=1))
    q = tl.minimum(tl.maximum(v * scale[:, None], -448.0), 448.0)
    out = _round_to_e4m3(q) / scale[:, None]  # (a power of two: exact)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=inside)


_FAKE = LaunchCache(fake_quantize_rows_kernel)


def _check(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be [R, K] bf16, got {getattr(x, 'shape', type(x).__name__)} "
                         f"{getattr(x, 'dtype', '')}")


def fake_quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[R, K] bf16: x quantized in 1 x 128 blocks as TE's blockwise recipe quantizes
    activations (power-of-two scales), dequantized exactly (module doc)."""
    _check(x)
    x = x.contiguous()
    out = torch.empty_like(x)
    rows, k = x.shape
    if rows and k:
        grid = (triton.cdiv(rows, 32), triton.cdiv(k, BLOCK))
        _FAKE.launch(grid, (x, out, rows), dict(K=k, BLOCK_R=32, BLOCK_K=BLOCK, num_warps=4))
    return out


def fake_quantize_rows_reference(x: torch.Tensor) -> torch.Tensor:
    """The same from TE's quantizer emulated (kernels/fp8_quant.py)."""
    _check(x)
    return dequantize_blockwise(*quantize_blockwise(x, 1), 1).to(torch.bfloat16)


def fake_quantize_weights(weight: torch.Tensor) -> torch.Tensor:
    """[E, N, K] bf16: each expert's weight quantized in 128 x 128 blocks as TE's blockwise
    recipe quantizes weights (power-of-two scales), dequantized exactly (pure torch, one
    expert at a time to bound the float64 temporaries: once per change of the weights)."""
    if weight.dim() != 3:
        raise ValueError(f"weight must be a stack [E, N, K], got {tuple(weight.shape)}")
    out = torch.empty(weight.shape, dtype=torch.bfloat16, device=weight.device)
    for e, w in enumerate(weight):
        data, scale_inv = quantize_blockwise(w.to(torch.bfloat16), BLOCK)
        out[e] = dequantize_blockwise(data, scale_inv, BLOCK)
    return out
