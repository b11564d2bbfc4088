"""Training through the blockwise recipe's exact dequantization (`--fp8-recipe blockwise`).

TE's `Float8BlockScaling` scales every block by a power of two, so each FP8 operand
dequantized to bf16 is exactly that operand (kernels/fp8_blocks.py), and a bf16 grouped
GEMM of dequantized operands, accumulating in fp32, is the product TE's block-scaled GEMM
computes, to the order of the fp32 sums. TE's GroupedLinear quantizes each of a
linear's three GEMMs' operands its own way, per expert tensor (`tex.split_quantize`),
and so does this node:

    forward  y[g]  = x[g] W_g^T    x in 1 x 128 blocks (along K), W in 128 x 128
    dgrad    dx[g] = dy[g] W_g     dy in 1 x 128 blocks (along N), W's same blocks
    wgrad    dW_g  = dy[g]^T x[g]  dy and x in 128 x 1 blocks: each expert's rows in
                                   blocks of 128 from its first row (the columnwise copies)

on `torch._grouped_mm` (ops/grouped.py). Gradients are e4m3, or e5m2 under
`--fp8-format hybrid` (`grad_format`). The weights come dequantized (`weight`, [E, N, K],
built once per change by the caller); their gradients go to `params`, the E parameters
they were made from, as TE's go to its weights (the quantization's gradient is the
identity, as in TE).

    y = block_expert_linear(x, counts_dev, w1, params1)            # FC1
    sink = block_expert_linear(h, counts_dev, w2, params2, compute=False)

With `compute=False` the forward is the caller's (the op's bf16 GEMM2 on
`block_dequantized(h)`), the output is the node the op hands dL/dy to (`grad_sink`).
`wgrad_into` as in ops/fp8_train.py (Megatron's fused gradient accumulation).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .fp8_groups import block_dequantized, block_dequantized_columns
from .fp8_train import weight_gradients
from .grouped import grouped_mm, grouped_wgrad, offsets

#: the gradients' formats TE's blockwise recipe uses (`--fp8-format e4m3 | hybrid`)
GRAD_FORMATS = ("e4m3", "e5m2")


class _BlockExpertLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts_dev, counts, weight, compute, grad_format, wgrad_into, *params):
        ctx.save_for_backward(x, counts_dev)  # (raw rows: the wgrad's blocks are columns)
        ctx.counts, ctx.weight, ctx.grad_format, ctx.wgrad_into = (counts, weight,
                                                                   grad_format, wgrad_into)
        ctx.param_dtypes = [p.dtype for p in params]
        if compute:
            return grouped_mm(block_dequantized(x.contiguous()), weight.transpose(1, 2),
                              counts_dev, counts)
        return x.new_empty(x.shape[0], weight.shape[1])

    @staticmethod
    def backward(ctx, dy):
        x, counts_dev = ctx.saved_tensors
        dy, fmt, counts = dy.contiguous(), ctx.grad_format, ctx.counts
        dx = None
        if ctx.needs_input_grad[0]:
            dx = grouped_mm(block_dequantized(dy, fmt), ctx.weight, counts_dev, counts)
        dws = [None] * len(ctx.param_dtypes)
        if any(ctx.needs_input_grad[7:]):
            ends = offsets(counts_dev, dy.device)
            dw = grouped_wgrad(block_dequantized_columns(dy, ends, fmt),
                               block_dequantized_columns(x.contiguous(), ends),
                               counts_dev, counts)
            dws = weight_gradients(dw, ctx.wgrad_into, ctx.param_dtypes)
        return (dx, None, None, None, None, None, None, *dws)


def _check(x, counts_dev, counts, weight, params, grad_format) -> None:
    if grad_format not in GRAD_FORMATS:
        raise ValueError(f"grad_format must be one of {GRAD_FORMATS}, got {grad_format!r}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or weight.dtype != torch.bfloat16:
        raise ValueError(f"weight must be the dequantized stack [E, N, K] bf16, got "
                         f"{getattr(weight, 'shape', type(weight).__name__)}")
    e, n, k = weight.shape
    if len(params) != e or any(tuple(p.shape) != (n, k) for p in params):
        raise ValueError(f"params must be the stack's {e} weights of [{n}, {k}], got "
                         f"{[tuple(p.shape) for p in params]}")
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be [R, {k}] bf16 (the stack's K), got {tuple(x.shape)} {x.dtype}")
    if counts_dev.numel() != e or (counts is not None and len(counts) != e):
        raise ValueError(f"counts_dev / counts must give the {e} experts' rows, got "
                         f"{counts_dev.numel()} / {None if counts is None else len(counts)}")


def block_expert_linear(x: torch.Tensor, counts_dev: torch.Tensor, weight: torch.Tensor,
                        params: Sequence[torch.Tensor], counts: list[int] | None = None,
                        compute: bool = True, grad_format: str = "e4m3",
                        wgrad_into: Callable[[list[torch.Tensor]], list] | None = None
                        ) -> torch.Tensor:
    """[R, N] bf16: y[rows of g] = x[rows of g] W_g^T through the blockwise recipe's
    operands (module doc): x [R, K] bf16 raw rows sorted by expert, `counts_dev` [E] rows
    per expert on x's device (`counts` on the host, optional: a host split where the
    grouped kernel is not the path), `weight` [E, N, K] the dequantized 128 x 128 blocks
    of `params` (`block_dequantized_weights`). The rows past the counts' sum are padding
    (their output and gradient unspecified). `compute=False`: the output is only the node
    of the caller's GEMM (the op's `grad_sink`)."""
    _check(x, counts_dev, counts, weight, params, grad_format)
    return _BlockExpertLinear.apply(x, counts_dev, counts, weight, compute, grad_format,
                                    wgrad_into, *params)
