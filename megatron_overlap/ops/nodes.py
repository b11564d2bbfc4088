"""The op's autograd nodes: the launch of a prepared call (`forward`, the overlapped
kernels or the reference path) and its backward.

    Gemm2GatherRS  bf16 / fp16 / fp32 operands: the combine's backward (each row's token
                   gradient, an all-gather under a group), then GEMM2's dgrad and wgrad
                   as grouped GEMMs (grouped.py)
    SinkGatherRS   FP8 operands, or a `grad_sink` given: the same rows' gradient handed
                   to the caller's node (`grad_sink`: TE's GroupedLinear, the grouped FP8
                   experts'), which runs dgrad and wgrad in its recipe; x and W carry
                   no gradient

Both give probs their gradient from y (dL/dp = <g, y>, y in row order).
"""

from __future__ import annotations

import torch

from . import launcher
from .grouped import grouped_mm, grouped_wgrad
from .reference import all_gather, reference_forward
from .validation import aligned


def forward(x, weight, probs, counts_dev, table, launch):
    """(out, y) of a prepared launch: the overlapped kernels or the reference path."""
    counts, group, world = launch.counts, launch.group, launch.world
    scales = launch.call.scales
    if launch.buffer is None:  # (the rows past the counts' sum are padding)
        return reference_forward(x[:sum(counts)], weight, counts_dev, counts, table, probs,
                                 group, world, scales)
    out = torch.empty(table.shape[0] // world, weight.shape[1], dtype=launch.call.out_dtype,
                      device=x.device)
    y = launcher.launch(launch.buffer, aligned(x), aligned(weight), launch.routing,
                        launch.launch_plan, probs, out, fork=launch.routing.routed,
                        scales=scales)
    return out, y


class Gemm2GatherRS(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, probs, counts_dev, token_index, table, launch):
        out, y = forward(x, weight, probs, counts_dev, table, launch)
        ctx.meta = (launch.counts, launch.group, launch.world)
        ctx.save_for_backward(x, weight, probs, counts_dev, token_index,
                              _y_for_probs(y, probs, launch))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, probs, counts_dev, token_index, y = ctx.saved_tensors
        counts, group, world = ctx.meta
        grad_rows, grad_probs = _rows_gradient(grad_out, token_index, probs, y, group, world,
                                               ctx.needs_input_grad[2])
        grad_x = grad_w = None
        # (grouped.py pads operands whose rows are not 16-byte multiples: any N, K)
        if ctx.needs_input_grad[0]:  # dx[rows of e] = dy W[e]: [T, N] @ [N, K]
            grad_x = grouped_mm(grad_rows, weight, counts_dev, counts)
        if ctx.needs_input_grad[1]:  # dW[e] = dy_e^T x_e, every expert in one grouped GEMM
            grad_w = grouped_wgrad(grad_rows, x, counts_dev, counts)
        return grad_x, grad_w, grad_probs, None, None, None, None


class SinkGatherRS(torch.autograd.Function):
    """Operands whose GEMM2 backward is the caller's (FP8, or blockwise's dequantized
    bf16): the output from x and W, and in backward dL/dy (each row's token gradient,
    probabilities applied) handed to `sink`, whose node runs dgrad and wgrad in its
    recipe."""

    @staticmethod
    def forward(ctx, sink, probs, x, weight, counts_dev, token_index, table, launch):
        out, y = forward(x, weight, probs, counts_dev, table, launch)
        ctx.meta = (launch.group, launch.world, None if sink is None else sink.dtype)
        ctx.save_for_backward(probs, token_index, _y_for_probs(y, probs, launch))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        probs, token_index, y = ctx.saved_tensors
        group, world, sink_dtype = ctx.meta
        grad_rows, grad_probs = _rows_gradient(grad_out, token_index, probs, y, group, world,
                                               ctx.needs_input_grad[1])
        grad_sink = None if sink_dtype is None else grad_rows.to(sink_dtype)
        return grad_sink, grad_probs, None, None, None, None, None, None


def _y_for_probs(y, probs, launch):
    """GEMM2's y in row order where the probabilities need a gradient (dL/dp = <g, y>)."""
    if probs is None or not probs.requires_grad:
        return None
    dest = None if launch.routing is None else launch.routing.dest
    return y if dest is None else y[dest.long()]  # (token-major y: back to row order)


def _rows_gradient(grad_out, token_index, probs, y, group, world: int, probs_grad: bool):
    """(dL/dy [T, N]: each row's token gradient, probabilities applied; dL/dprobs)."""
    grad_rows = _gathered_rows(grad_out, token_index, group, world)  # [T, N]
    grad_probs = None
    if probs is not None:
        if probs_grad:
            grad_probs = (grad_rows.float() * y.float()).sum(1).to(probs.dtype)
        grad_rows = grad_rows * probs.to(grad_rows.dtype)[:, None]
    return grad_rows, grad_probs


def _gathered_rows(grad_out, token_index, group, world: int) -> torch.Tensor:
    """[T, N] the output gradient of each row's token: the gradient of a reduce-scatter is
    an all-gather, then each row reads its token's."""
    grad_out = grad_out.contiguous()
    full = grad_out
    if world > 1:
        full = grad_out.new_empty(grad_out.shape[0] * world, grad_out.shape[1])
        all_gather(full, grad_out, group=group)
    return full[token_index.long()]
