"""Expert-grouped FP8 under current scaling: quantize rows by group, a grouped FP8 GEMM.

What the layer's own FP8 expert path (mcore/fp8_experts.py) runs instead of TE's
GroupedLinear under `--fp8-recipe tensorwise` in inference, each step one or two
launches for all experts, the groups' row ranges read on the device (no host sync):

    xq, x_scale_inv, x_rows = quantize_fp8_groups(x, ends)        # TE's current scaling,
                                                                  # one tensor per group
    y = fp8_grouped_linear(xq, x_rows, wq, w_scale_inv, ends)     # y[g] = x[g] W_g^T, bf16

`ends` [E]: the cumulative rows of each expert (rows past the last are padding).
`quantize_fp8_groups` is `kernels/fp8_rows.py` (Triton on CUDA and under the
interpreter; elsewhere its pure-torch reference, which needs the ends on the host).
`fp8_grouped_linear` is torch's `_scaled_grouped_mm` (CUTLASS, sm90) with row-wise
scales: each row's group scale_inv for x, each expert's for W, accumulating in fp32 with
fast accumulation as TE's forward GEMM under current scaling (`use_split_accumulator`
off for fprop); off sm90 a dequantized fp32 product per group (a checking path).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kernels.fp8_blocks import (fake_quantize_columns, fake_quantize_columns_reference,
                                   fake_quantize_rows, fake_quantize_rows_reference,
                                   fake_quantize_weights, fake_quantize_weights_reference)
from ..kernels.fp8_rows import quantize_groups, quantize_groups_reference, stack_group_ends
from .config import interpreting

E4M3 = torch.float8_e4m3fn


def _check_ends(ends: torch.Tensor, device) -> None:
    if not isinstance(ends, torch.Tensor) or ends.dim() != 1 or ends.is_floating_point():
        raise ValueError(f"ends must be a 1-D integer tensor (cumulative rows per group), "
                         f"got {getattr(ends, 'shape', type(ends).__name__)}")
    if ends.device != device:
        raise ValueError(f"ends on {ends.device}, the rows on {device}")


class DelayedScales(NamedTuple):
    """Delayed scaling's state of G tensors quantized by group: `scale` [G] fp32, what
    each is cast with (scale_inv = 1 / scale), and `amax` [G] fp32, into which each
    quantization's amax is folded by max. Views of TE's `fp8_meta` (its scale and row 0
    of its amax history, one slot per GEMM, any stride) in the layer; the scale update
    from the history stays TE's."""

    scale: torch.Tensor
    amax: torch.Tensor


def quantize_fp8_groups(x: torch.Tensor, ends: torch.Tensor, src: torch.Tensor | None = None,
                        dtype: torch.dtype = E4M3, delayed: DelayedScales | None = None,
                        carrier: torch.dtype | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data [R, K] e4m3, scale_inv [E] fp32, row_scale_inv [R] fp32): rows of x [R, K]
    quantized under Transformer Engine's current scaling, each group (the rows up to
    ends[g] from the previous end) one tensor with its own amax, as TE's GroupedLinear
    quantizes each expert's input; the values of TE's quantizer. With `src` (int64 [R])
    the rows are x[src] (x [N, K]: the tokens before the permutation), gathered while
    quantizing. Padding rows (past ends[-1]) come back 0 with row_scale_inv 0. `dtype`:
    e4m3, or e5m2 (gradients under `--fp8-format hybrid`). `delayed`: TE's delayed
    scaling instead -- each group cast with its `delayed.scale` and its amax folded into
    `delayed.amax` (TE's Float8Quantizer per GEMM). `carrier=torch.float8_e4m3fn` with
    e5m2: e5m2's values stored in e4m3 (times a power of two per group, scale_inv divided
    by it) for GEMMs that take e4m3 alone (kernels/fp8_rows.py)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    _check_ends(ends, x.device)
    if delayed is not None and not isinstance(delayed, DelayedScales):
        raise TypeError(f"delayed must be a DelayedScales, got {type(delayed).__name__}")
    scale, amax = delayed if delayed is not None else (None, None)
    if x.is_cuda or interpreting():
        return quantize_groups(x, ends, src, dtype, scale, amax, carrier)
    ends_host = ends.tolist()  # (CPU: no sync to avoid)
    counts = [b - a for a, b in zip([0] + ends_host[:-1], ends_host)]
    rows = x.shape[0] if src is None else src.numel()
    if min(counts, default=0) < 0 or (ends_host and ends_host[-1] > rows):
        raise ValueError(f"ends must be non-decreasing and at most {rows}, got {ends_host}")
    return quantize_groups_reference(x, counts, src, dtype, scale, amax, carrier)


def quantize_fp8_stack(weight: torch.Tensor, delayed: DelayedScales | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(data [E, N, K] e4m3, scale_inv [E] fp32): each expert's weight [N, K] of the
    stack one tensor under current scaling (TE's weight quantizer per GEMM), or under
    delayed scaling with `delayed` (one scale and amax slot per expert)."""
    if weight.dim() != 3:
        raise ValueError(f"weight must be a stack [E, N, K], got {tuple(weight.shape)}")
    e, n, k = weight.shape
    ends = stack_group_ends(e, n, weight.device)
    data, scale_inv, _ = quantize_fp8_groups(weight.reshape(e * n, k), ends, delayed=delayed)
    return data.view(e, n, k), scale_inv


def scaled_grouped_mm_refusal(device=None) -> str | None:
    """Why the GPU `device` (default: the current one) cannot run the grouped FP8 GEMMs on
    torch's scaled grouped GEMM (built for sm90; elsewhere `fp8_grouped_linear` falls back
    to a per-expert loop reading the ends on the host); None on sm90 and without CUDA."""
    if not torch.cuda.is_available():
        return None
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} (no torch._scaled_grouped_mm)"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return (f"an sm{major}{minor} GPU (the grouped FP8 GEMMs are torch's scaled grouped "
                f"GEMM, built for sm90)")
    return None


def _scaled_grouped_mm_ok(x: torch.Tensor) -> bool:
    return x.is_cuda and scaled_grouped_mm_refusal(x.device) is None


def fp8_grouped_linear(xq: torch.Tensor, row_scale_inv: torch.Tensor, wq: torch.Tensor,
                       w_scale_inv: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """[R, N] bf16: y[rows of g] = (xq * row_scale_inv)[rows of g] @ (wq[g] * w_scale_inv[g])^T
    for e4m3 xq [R, K] and wq [E, N, K] (nn.Linear layout), fp32 accumulation; rows past
    ends[-1] unspecified."""
    if xq.dtype != E4M3 or wq.dtype != E4M3 or xq.dim() != 2 or wq.dim() != 3:
        raise ValueError(f"xq [R, K] and wq [E, N, K] must be e4m3, got {tuple(xq.shape)} "
                         f"{xq.dtype}, {tuple(wq.shape)} {wq.dtype}")
    if xq.shape[1] != wq.shape[2] or ends.numel() != wq.shape[0]:
        raise ValueError(f"xq's K {xq.shape[1]} / ends' groups {ends.numel()} do not match "
                         f"wq {tuple(wq.shape)}")
    if row_scale_inv.shape != (xq.shape[0],) or w_scale_inv.shape != (wq.shape[0],):
        raise ValueError(f"row_scale_inv must be [{xq.shape[0]}] and w_scale_inv "
                         f"[{wq.shape[0]}], got {tuple(row_scale_inv.shape)}, "
                         f"{tuple(w_scale_inv.shape)}")
    _check_ends(ends, xq.device)
    if _scaled_grouped_mm_ok(xq) and xq.shape[0] and xq.shape[1] % 16 == 0 and wq.shape[1] % 16 == 0:
        offs = ends.to(torch.int32).clamp(max=xq.shape[0])
        w_rows = w_scale_inv.float()[:, None].expand(-1, wq.shape[1]).contiguous()
        return torch._scaled_grouped_mm(xq, wq.transpose(1, 2), row_scale_inv.float(), w_rows,
                                        offs=offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)
    return _dequantized_grouped_linear(xq, row_scale_inv, wq, w_scale_inv, ends)


def _dequantized_grouped_linear(xq, row_scale_inv, wq, w_scale_inv, ends) -> torch.Tensor:
    """The same product in fp32 from the dequantized operands, one matmul per group."""
    out = torch.zeros(xq.shape[0], wq.shape[1], dtype=torch.bfloat16, device=xq.device)
    x = xq.float() * row_scale_inv.float()[:, None]
    start = 0
    for g, end in enumerate(ends.tolist()):
        w = wq[g].float() * w_scale_inv[g].float()
        out[start:end] = (x[start:end] @ w.t()).to(torch.bfloat16)
        start = end
    return out


def block_dequantized(x: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """[R, K] bf16: x through Transformer Engine's blockwise recipe for activations (1 x 128
    blocks, power-of-two scales) and back: exactly its FP8 operand's values (a power-of-
    two scale keeps them bf16 values), for the bf16 grouped kernels (kernels/fp8_blocks.py;
    one launch on CUDA and under the interpreter, else the pure-torch reference). `fmt`:
    "e4m3", or "e5m2" (gradients under `--fp8-format hybrid`)."""
    if isinstance(x, torch.Tensor) and (x.is_cuda or interpreting()):
        return fake_quantize_rows(x, fmt)
    return fake_quantize_rows_reference(x, fmt)


def block_dequantized_columns(x: torch.Tensor, ends: torch.Tensor,
                              fmt: str = "e4m3") -> torch.Tensor:
    """[R, K] bf16: each group's rows (ending at `ends`) through the recipe's 128 x 1
    blocks, the columnwise copy TE makes of each expert's wgrad operand, and back,
    exactly; the rows past ends[-1] unspecified (one launch on CUDA and under the
    interpreter, else the pure-torch reference, which reads the ends on the host)."""
    _check_ends(ends, x.device)
    if x.is_cuda or interpreting():
        return fake_quantize_columns(x, ends, fmt)
    return fake_quantize_columns_reference(x, ends.tolist(), fmt)


def block_dequantized_weights(weight: torch.Tensor) -> torch.Tensor:
    """[E, N, K] bf16: each expert's weight through the blockwise recipe's 128 x 128 blocks
    and back, exactly (once per change of the weights; one launch on CUDA and under the
    interpreter, else the pure-torch reference)."""
    if isinstance(weight, torch.Tensor) and (weight.is_cuda or interpreting()):
        return fake_quantize_weights(weight)
    return fake_quantize_weights_reference(weight)
