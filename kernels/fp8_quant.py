"""Transformer Engine's Hopper FP8 quantizers emulated in pure torch (TE 2.12), and their
dequantization: what the FP8 GEMM2 (`gemm2_fp8`) reads, built without TE for tests and
for an ops layer that quantizes by itself.

Recipes (Megatron-Core 0.19's `--fp8-recipe`, TE's recipe class):
  * tensorwise -> `Float8CurrentScaling`: one scale per tensor from its own amax now
    (`quantize_tensorwise`); TE's default: no power-of-2 rounding, epsilon 0.
  * delayed -> `DelayedScaling`: the scale comes from an amax history updated after the
    step (`delayed_scale_update`), the tensor is cast with the scale it has
    (`quantize_with_scale`), and its amax goes into the history's row 0.
  * blockwise -> `Float8BlockScaling`: activations in 1x128 blocks along K, weights in
    128x128 blocks (`quantize_blockwise`), power-of-2 scales by default.

Every scale follows TE's `compute_scale_from_amax` (common/recipe/recipe_common.cuh):
amax floored at epsilon; amax 0, inf or NaN gives scale 1; scale = fp8_max / amax in
fp32, an infinite one replaced by `value_for_inf`; with power-of-2 scales the mantissa
bits are cleared (rounded down to 2^floor(log2)). The cast saturates (TE's
`__NV_SATFINITE`), and scale_inv = 1 / scale in fp32.

Scale layouts are TE's own (the "GEMM_READY" ones, the only ones TE 2.12 writes,
`Float8BlockQuantizer.get_scale_shape`), with the padding TE leaves unwritten set to NaN
here, so that a reader of padding shows:
  * 1x128, x [M, K]: scale_inv [ceil(K/128), roundup(M, 4)], element [kb, m]
    (transposed: one row of scales per K block);
  * 128x128, W [N, K]: scale_inv [ceil(N/128), roundup(ceil(K/128), 4)], element [nb, kb].
Worked example: x [300, 256] in 1x128 blocks -> scale_inv [2, 300]; W [2048, 704] in
128x128 blocks -> scale_inv [16, 8] of which columns 6 and 7 are padding.
"""

from __future__ import annotations

import torch

BLOCK = 128  # TE's block length for both 1x128 and 128x128 scaling
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FLT_MAX = torch.finfo(torch.float32).max


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def block_scale_shape(m: int, k: int, block_rows: int) -> tuple[int, int]:
    """The shape of TE's blockwise `scale_inv` (padding included) for an [M, K] tensor:
    1 x 128 blocks [ceil(K/128), roundup(M, 4)] (transposed), 128 x 128 blocks
    [ceil(M/128), roundup(ceil(K/128), 4)]."""
    kb = -(-k // BLOCK)
    return (kb, _round_up(m, 4)) if block_rows == 1 else (-(-m // BLOCK), _round_up(kb, 4))


def scale_from_amax(amax: torch.Tensor, fp8_max: float, *, pow2: bool = False,
                    epsilon: float = 0.0, value_for_inf: float = FLT_MAX) -> torch.Tensor:
    """TE's `compute_scale_from_amax`, elementwise on an fp32 amax tensor."""
    amax = amax.float()
    amax = torch.where(amax < epsilon, torch.full_like(amax, epsilon), amax)  # (NaN stays)
    scale = torch.full_like(amax, fp8_max) / amax
    scale = torch.where(scale.isinf(), torch.full_like(scale, value_for_inf), scale)
    if pow2:  # keep sign and exponent: the largest power of two <= scale
        scale = (scale.contiguous().view(torch.int32) & -0x800000).view(torch.float32)
    unusable = (amax == 0) | amax.isinf() | amax.isnan()
    return torch.where(unusable, torch.ones_like(scale), scale)


def cast_fp8(values: torch.Tensor, dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """Saturating cast of fp32 values (TE casts with __NV_SATFINITE)."""
    top = FP8_MAX[dtype]
    return values.clamp(-top, top).to(dtype)


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, dtype=torch.float8_e4m3fn):
    """(data, scale_inv): x * scale cast to FP8 (TE's `Float8Quantizer`, delayed scaling's
    cast with the scale it holds); scale_inv = 1 / scale in fp32."""
    scale = scale.float()
    return cast_fp8(x.float() * scale, dtype), 1.0 / scale


def quantize_tensorwise(x: torch.Tensor, dtype=torch.float8_e4m3fn, *, pow2: bool = False,
                        epsilon: float = 0.0):
    """(data, scale_inv []) of TE's `Float8CurrentScalingQuantizer`: the scale from this
    tensor's amax now (infinite scales become FLT_MAX: `nvte_compute_scale_from_amax`)."""
    amax = x.abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
    scale = scale_from_amax(amax, FP8_MAX[dtype], pow2=pow2, epsilon=epsilon)
    return quantize_with_scale(x, scale, dtype)


def quantize_tensorwise_splits(x: torch.Tensor, counts: list[int], dtype=torch.float8_e4m3fn,
                               **kw):
    """(data [T, K], scale_inv [E]): each expert's rows a tensor of its own, as TE's
    GroupedLinear quantizes its input (`tex.split_quantize`, one quantizer per GEMM); an
    expert without rows gets scale_inv 1."""
    parts = [quantize_tensorwise(rows, dtype, **kw) for rows in x.split(list(counts))]
    if not parts:
        return x.to(dtype), torch.ones(0, device=x.device)
    return torch.cat([d for d, _ in parts]), torch.stack([s for _, s in parts])


def delayed_scale_update(amax_history: torch.Tensor, scale: torch.Tensor, *,
                         fp8_max: float = 448.0, margin: int = 0, algo: str = "max"):
    """(history, scale) after TE's `amax_and_scale_update` (common/recipe/delayed_scaling.cu):
    amax = the history's max ("max") or row 0 ("most_recent"); scale = fp8_max * 2^-margin
    / amax where amax is finite and > 0, else the old scale; an infinite scale becomes
    FLT_MAX. The history [L] or [L, n] (row 0: the amax recorded this step) rolls up one
    row, row 0 zeroed for the next step. Megatron's defaults: L = 1, "most_recent"."""
    if algo not in ("max", "most_recent"):
        raise ValueError(f"algo must be 'max' or 'most_recent', got {algo!r}")
    amax = amax_history.amax(0) if algo == "max" else amax_history[0]
    scaled_max = torch.tensor(fp8_max, dtype=torch.float32) * 2.0 ** -margin
    new = torch.where(amax.isfinite() & (amax > 0), scaled_max.to(amax.device) / amax,
                      scale.float())
    new = torch.where(new.isinf(), torch.full_like(new, FLT_MAX), new)
    history = amax_history.roll(-1, 0)
    history[0] = 0
    return history, new


def quantize_blockwise(x: torch.Tensor, block_rows: int, dtype=torch.float8_e4m3fn, *,
                       pow2: bool = True, epsilon: float = 0.0):
    """(data [M, K], scale_inv in TE's layout) of TE's `Float8BlockQuantizer`: 1 x 128
    blocks (`block_rows` 1, activations) or 128 x 128 (`block_rows` 128, weights)."""
    if block_rows not in (1, BLOCK):
        raise ValueError(f"block_rows must be 1 or {BLOCK}, got {block_rows}")
    m, k = x.shape
    mb, kb = -(-m // block_rows), -(-k // BLOCK)
    padded = x.new_zeros(mb * block_rows, kb * BLOCK, dtype=torch.float32)
    padded[:m, :k] = x.float()  # (zeros leave every block's amax as it is)
    amax = padded.abs().view(mb, block_rows, kb, BLOCK).amax(dim=(1, 3))  # [mb, kb]
    # an amax too small for a finite fp32 scale: the input type's largest value
    scale = scale_from_amax(amax, FP8_MAX[dtype], pow2=pow2, epsilon=epsilon,
                            value_for_inf=torch.finfo(x.dtype).max)
    full = scale.repeat_interleave(block_rows, 0).repeat_interleave(BLOCK, 1)[:m, :k]
    data = cast_fp8(x.float() * full, dtype)
    out = torch.full(block_scale_shape(m, k, block_rows), float("nan"), device=x.device)
    if block_rows == 1:  # TE's 1x128 kernel divides in double: `1.0 / scale`
        out[:, :m] = (1.0 / scale.double()).float().t()
    else:  # the 128x128 kernel in fp32: `1.0f / scale`
        out[:, :kb] = 1.0 / scale
    return data, out


def dequantize_blockwise(data: torch.Tensor, scale_inv: torch.Tensor,
                         block_rows: int) -> torch.Tensor:
    """float64 values of `quantize_blockwise`'s (data, scale_inv); padding is not read."""
    m, k = data.shape
    kb = -(-k // BLOCK)
    if block_rows == 1:
        per_block = scale_inv[:kb, :m].t()  # [m, kb]
    else:
        per_block = scale_inv[:, :kb].repeat_interleave(BLOCK, 0)[:m]
    return data.double() * per_block.double().repeat_interleave(BLOCK, 1)[:, :k]
