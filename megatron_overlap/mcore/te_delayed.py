"""Transformer Engine's delayed scaling kept in step by the grouped FP8 experts.

Under `--fp8-recipe delayed` each GEMM of TE's GroupedLinear quantizes its operands with
scales that earlier steps' amaxes made, and records this step's amaxes for the next
update. The state is the module's `fp8_meta`: per GEMM i, slots `i * 3 + 0` (input) and
`i * 3 + 1` (weight) of "scaling_fwd", and `i * 2 + 0` (dL/dy) of "scaling_bwd" (TE's
`_offsets` and `_num_fp8_tensors_per_gemm`); a slot's scale is `scale[slot]`, its amax
goes to `amax_history[0, slot]`. TE's FP8GlobalStateManager reduces the amaxes and
updates the scales: the forward's when TE's autocast exits, over every module that
`prepare_forward` registered; the backward's in the backward of the step's first FP8
module (`is_first_fp8_module`, claimed in the forward).

The grouped path (mcore/fp8_experts.py) runs each linear inside the bracket TE's own
forward runs, `prepare_forward` ... `end_forward` (`linear_scaling`): the module's
fp8_meta made and registered, activation recompute's saved state handled as TE handles
it, and the first-module claim where gradients flow. The quantization reads and writes
the same slots through strided views (`ops.DelayedScales`), so TE's scaling state
advances as under stock's GroupedLinear, and a run can switch `--moe-overlap` on or off
between checkpoints. The scale update itself stays TE's.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from ..ops import DelayedScales, GradFp8
from .te_fp8 import gemm_module

#: what the grouped path reads of TE's GroupedLinear under delayed scaling
_TE_NAMES = ("prepare_forward", "end_forward", "_offsets", "_num_fp8_tensors_per_gemm",
             "num_gemms")


class LinearScaling(NamedTuple):
    """How one grouped FP8 linear quantizes: its inputs' and weights' delayed scales (None:
    current scaling, each tensor's own amax) and its dL/dy (`GradFp8`)."""

    inputs: DelayedScales | None
    weights: DelayedScales | None
    grad: GradFp8


def delayed_refusal(linear) -> str | None:
    """Why TE GroupedLinear `linear` cannot keep its delayed scaling state through the
    grouped path (None: it can)."""
    missing = [name for name in _TE_NAMES if not hasattr(linear, name)]
    if missing:
        return (f"--fp8-recipe delayed with a {type(linear).__name__} without "
                f"{', '.join(missing)} (TE 2.x's per-GEMM delayed-scaling slots)")
    state = getattr(gemm_module(linear), "FP8GlobalStateManager", None)
    needed = ("is_first_fp8_module", "reduce_and_update_fp8_tensors")
    if not all(hasattr(state, name) for name in needed):
        return "--fp8-recipe delayed without TE's FP8GlobalStateManager amax reduction"
    return None


def _slots(meta, first: int, step: int, gemms: int) -> DelayedScales:
    """The scales and amax slots first, first + step, ... of one fp8_meta (views)."""
    end = first + step * gemms
    return DelayedScales(meta.scale[first:end:step], meta.amax_history[0][first:end:step])


def _scaling(linear, grad_dtype: torch.dtype, grads: bool) -> LinearScaling:
    gemms, per, offsets = linear.num_gemms, linear._num_fp8_tensors_per_gemm, linear._offsets
    fwd = linear.fp8_meta["scaling_fwd"]
    inputs = _slots(fwd, offsets["input"], per["fwd"], gemms)
    weights = _slots(fwd, offsets["weight"], per["fwd"], gemms)
    if not grads:
        return LinearScaling(inputs, weights, GradFp8(grad_dtype))
    state = gemm_module(linear).FP8GlobalStateManager
    after = None
    if state.is_first_fp8_module():  # (as TE's forward claims it: its backward reduces)
        def after():
            state.reduce_and_update_fp8_tensors(forward=False)
    grad = _slots(linear.fp8_meta["scaling_bwd"], offsets["grad_output"], per["bwd"], gemms)
    return LinearScaling(inputs, weights, GradFp8(grad_dtype, grad, after))


def linear_scaling(linear, delayed: bool, x: torch.Tensor, grad_dtype: torch.dtype,
                   grads: bool):
    """The bracket of one call of TE GroupedLinear `linear` on rows `x`, yielding its
    `LinearScaling`: under delayed scaling TE's forward bracket and state (module doc),
    else current scaling's (no state, nothing to bracket). `grads`: gradients flow
    through this call."""
    if delayed:
        return _delayed_linear(linear, x, grad_dtype, grads)
    return contextlib.nullcontext(LinearScaling(None, None, GradFp8(grad_dtype)))


@contextlib.contextmanager
def _delayed_linear(linear, x: torch.Tensor, grad_dtype: torch.dtype, grads: bool):
    linear.prepare_forward(x, num_gemms=linear.num_gemms)
    try:
        yield _scaling(linear, grad_dtype, grads)
    finally:
        linear.end_forward()
