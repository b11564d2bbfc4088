"""The layer's one-pass helper kernels and run-time predicates, as public op functions.

The Megatron integration (`megatron_overlap.mcore`) uses only names exported from
`megatron_overlap.ops`; these are the ones it needs besides the operator itself:

    gather_rows(src, index, valid)           out[r] = src[index[r]] for r < valid (device)
    permute_rows(x, index)                   x.index_select(0, index), atomic-free backward
    weighted_swiglu(inter, probs, ...)       silu(g) * u * p of the experts' FC1 output
    add_gated_shared_(out, shared, logit)    out += sigmoid(logit) * shared, in place
    interpreting()                           Triton kernels run under the interpreter
    capturing(t)                             t's stream is being captured (CUDA graph)

Each kernel function checks here what every one of them needs (tensors, on a device its
Triton kernel runs on: CUDA, or CPU under the interpreter) and leaves the shapes and
dtypes to the kernel's own wrapper, which names the argument too (`permute_rows` runs
anywhere: off the kernels' devices its backward is torch's). Shapes, dtypes and rounding
are documented in `kernels/gather_rows.py`, `kernels/sum_rows.py`, `kernels/swiglu.py`
and `kernels/gated_add.py`, each beside its pure-torch reference.
"""

from __future__ import annotations

import math

import torch

from ..kernels import gated_add as _gated_add
from ..kernels import gather_rows as _gather_rows
from ..kernels import sum_rows as _sum_rows
from ..kernels import swiglu as _swiglu
from . import config as _config
from .validation import capturing as _capturing


def _kernel_runs_on(t: torch.Tensor) -> bool:
    """The Triton kernels run on t's device: CUDA, or CPU under the interpreter."""
    return t.is_cuda or (t.device.type == "cpu" and interpreting())


def _check_tensors(fn: str, **tensors) -> None:
    """TypeError naming the argument that is not a tensor; ValueError naming one on a
    device the Triton kernels do not run on (None values are optional arguments)."""
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not _kernel_runs_on(t):
            raise ValueError(f"{fn}: {name} is on {t.device}; its Triton kernel runs on "
                             f"CUDA tensors, or on CPU ones with TRITON_INTERPRET=1 set "
                             f"before triton is imported")


def gather_rows(src: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[R, H] rows of src [N, H] in `index` order (index: int64 [R]): row r < valid is
    src[index[r]], later rows are unspecified. `valid`: one integer tensor on the device,
    read there, so the host never waits for the row count; every index below it must lie
    in [0, N). Example: src rows a, b, c; index [2, 0, 1, 1], valid 2 -> [c, a, ?, ?]."""
    _check_tensors("gather_rows", src=src, index=index, valid=valid)
    return _gather_rows.gather_rows(src, index, valid)


class _PermuteRows(torch.autograd.Function):
    """index_select forward; backward sums each source row's gradient rows (module doc)."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.src_shape = x.shape
        return x.index_select(0, index)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        if not _kernel_runs_on(grad) or grad.dtype not in _sum_rows.DTYPES:
            return grad.new_zeros(ctx.src_shape).index_add_(0, index, grad), None  # torch's
        rows = grad.reshape(grad.shape[0], math.prod(grad.shape[1:]))  # [R, H]: flat rows
        return _sum_rows.sum_rows_by_index(rows, index, ctx.src_shape[0]).view(
            ctx.src_shape), None


def permute_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x.index_select(0, index) (same bits), for x [N, ...] and index int64 [R] in [0, N),
    whose gradient is each source row's rows summed without atomics: in fp32, in
    ascending row order (the same bits every run), rounded once to x's dtype; 0 for a
    row not selected. torch's backward, `index_add_`, adds by atomics in x's dtype.
    Off CUDA (CPU without the interpreter), and for fp64, the backward is torch's.
    Example: x rows a, b, c; index [2, 0, 2] -> [c, a, c]; gradient rows g0, g1, g2 ->
    [g1, 0, g0 + g2]."""
    for name, t in (("x", x), ("index", index)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"permute_rows: {name} must be a torch.Tensor, got "
                            f"{type(t).__name__}")
    if index.dim() != 1 or index.dtype != torch.int64:
        raise ValueError(f"permute_rows: index must be int64 [R], got {tuple(index.shape)} "
                         f"{index.dtype}")
    return _PermuteRows.apply(x, index)


def weighted_swiglu(inter: torch.Tensor, probs: torch.Tensor, out: torch.Tensor | None = None,
                    valid_rows: torch.Tensor | None = None) -> torch.Tensor:
    """silu(g) * u * p per row, for inter [T, 2K] = [gate g | up u] (Megatron's GLU
    layout) and probs [T] -> [T, K] in inter's dtype (fp32 math, rounded once); into
    `out` (contiguous [T, K], inter's dtype) when given. `valid_rows`: one integer on the
    device; rows at or past it are not computed (out keeps what it held there)."""
    _check_tensors("weighted_swiglu", inter=inter, probs=probs, out=out,
                   valid_rows=valid_rows)
    return _swiglu.weighted_swiglu(inter, probs, out=out, valid_rows=valid_rows)


def add_gated_shared_(out: torch.Tensor, shared: torch.Tensor,
                      logit: torch.Tensor) -> torch.Tensor:
    """out += sigmoid(logit) * shared per token, in place (fp32 math, rounded once to
    out's dtype); returns out. out, shared: contiguous [..., H] of one shape, floating
    dtype and device; logit: one floating value per token ([...] or [..., 1])."""
    _check_tensors("add_gated_shared_", out=out, shared=shared, logit=logit)
    return _gated_add.add_gated_shared_(out, shared, logit)


def interpreting() -> bool:
    """Whether Triton kernels run under its CPU interpreter (TRITON_INTERPRET=1, which
    must be set before triton is imported): the one-pass kernels then run on CPU tensors
    too, where the layer otherwise takes torch's path."""
    return _config.interpreting()


def capturing(t: torch.Tensor) -> bool:
    """Whether t's device stream is being captured into a CUDA graph (False on CPU): the
    layer then takes the path a replay reproduces."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"capturing: t must be a torch.Tensor, got {type(t).__name__}")
    return _capturing(t)


__all__ = ["add_gated_shared_", "capturing", "gather_rows", "interpreting", "permute_rows",
           "weighted_swiglu"]
