"""The FC2 operands the op reads: per-expert weights stacked once, expert biases as a column.

Megatron's experts keep FC2 as E separate parameters (TE's grouped linear: `weight0 ..
weight{E-1}`, SequentialMLP: one linear per expert); the op reads one [E, N, K] tensor.
`ExpertWeightStack` builds it once and again only when a parameter changed (its storage
or its version counter: an optimizer step, a load), and routes the gradient of the stack
back to each expert's own parameter. Where the E parameters already lie back to back in
one storage (the layer puts them there, `pack_expert_params`) the stack is a view of it,
so nothing is copied even after an optimizer step.

Expert biases (Megatron's `add_bias_linear`): stock adds `bias[e] * prob[row]` to FC2's
output rows (TEGroupedMLP._apply_bias, MLP.forward with a per-token scale), before the
combine. `with_bias_columns` folds that into GEMM2 itself: x gains the column prob (then
zeros to keep rows 16-byte aligned) and W the column bias, so y = [x, p] @ [W, b]^T =
x W^T + p b, summed in GEMM2's fp32 accumulator. The augmented weight is cached the same
way; x's copy is one pass per call (only where biases exist).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: columns appended to x and W for a bias: the scale, then zeros up to 16 bytes of bf16
BIAS_COLUMNS = 8


def _key(tensors: Sequence[torch.Tensor]) -> tuple:
    return tuple((t.data_ptr(), t._version, tuple(t.shape), t.dtype) for t in tensors)


def _back_to_back(weights: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A [E, N, K] view of weights that lie back to back, in order, in one storage."""
    first = weights[0]
    if not all(w.is_contiguous() and w.shape == first.shape and w.dtype == first.dtype
               and w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               for w in weights):
        return None
    step = first.numel()
    start = first.storage_offset()
    if any(w.storage_offset() != start + e * step for e, w in enumerate(weights)):
        return None
    return torch.as_strided(first.detach(), (len(weights), *first.shape),
                            (step, *first.stride()), start)


def stacked(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """[E, N, K] of the E weights [N, K], detached: a view where they lie back to back in
    one storage (`pack_expert_weights` put them there), else a stacked copy."""
    if not weights or len({(tuple(w.shape), w.dtype, w.device) for w in weights}) != 1:
        raise ValueError(f"weights must be one or more tensors of one shape, dtype and "
                         f"device, got {[(tuple(w.shape), w.dtype) for w in weights]}")
    view = _back_to_back(weights)
    return view if view is not None else torch.stack([w.detach() for w in weights])


class _Cached(torch.autograd.Function):
    """The cached operand as a function of its sources, for autograd: its gradient goes
    back to each weight (and bias) it was built from."""

    @staticmethod
    def forward(ctx, value, layout, *sources):
        ctx.layout = layout  # (stacked weights?, stacked biases?, K, has biases)
        return value.detach()  # a new alias per call, so each call's graph has its own node

    @staticmethod
    def backward(ctx, grad):
        stacked_w, stacked_b, k, has_bias = ctx.layout
        gw = grad[..., :k]
        grads = [gw] if not stacked_w else list(gw.unbind(0))
        if has_bias:
            gb = grad[..., k]
            grads += [gb] if not stacked_b else list(gb.unbind(0))
        return (None, None, *grads)


def _as_list(t) -> list[torch.Tensor]:
    return [t] if isinstance(t, torch.Tensor) else list(t)


class ExpertWeightStack:
    """Caches one layer's FC2 operand; holds no tensor but the last one built."""

    def __init__(self):
        self._key = self._value = None

    def operand(self, weights, biases=None) -> torch.Tensor:
        """The op's FC2 weight: [E, N, K] from an [E, N, K] tensor or E [N, K] weights, or
        with biases ([E, N] or E [N]) [E, N, K + BIAS_COLUMNS] = [W, b, 0...] (see
        `with_bias_columns`). Built again only when a source changed (a view of weights
        that lie back to back, without biases); gradients reach every source."""
        stacked_w = not isinstance(weights, torch.Tensor)
        stacked_b = biases is not None and not isinstance(biases, torch.Tensor)
        ws = _as_list(weights)
        bs = [] if biases is None else _as_list(biases)
        if not ws or any(w.dim() != (2 if stacked_w else 3) for w in ws):
            raise ValueError("weights must be an [E, N, K] tensor or E >= 1 [N, K] tensors")
        if len({w.shape for w in ws}) != 1:
            raise ValueError(f"the E expert weights must share one shape, got "
                             f"{sorted({tuple(w.shape) for w in ws})}")
        if bs and (any(b.dim() != (1 if stacked_b else 2) for b in bs)
                   or len({b.shape for b in bs}) != 1):
            raise ValueError("biases must be an [E, N] tensor or E [N] tensors of one shape")
        key = _key(ws + bs)
        if key != self._key:
            self._value = self._build(ws, bs, stacked_w, stacked_b)
            self._key = key
        layout = (stacked_w, stacked_b, ws[0].shape[-1], bool(bs))
        return _Cached.apply(self._value, layout, *ws, *bs)

    @staticmethod
    def _build(ws: list[torch.Tensor], bs: list[torch.Tensor], stacked_w: bool,
               stacked_b: bool) -> torch.Tensor:
        if not stacked_w:
            weight = ws[0].detach()
        else:
            weight = _back_to_back(ws)
            if weight is None:
                weight = torch.stack([w.detach() for w in ws])
        if not bs:
            return weight
        bias = torch.stack([b.detach() for b in bs]) if stacked_b else bs[0].detach()
        if bias.shape != weight.shape[:2]:
            raise ValueError(f"biases must be [E, N] = {tuple(weight.shape[:2])}, got "
                             f"{tuple(bias.shape)}")
        pad = weight.new_zeros(*weight.shape[:2], BIAS_COLUMNS - 1)
        return torch.cat([weight, bias.to(weight.dtype)[..., None], pad], dim=2)


def with_bias_columns(x: torch.Tensor, bias_scale: torch.Tensor) -> torch.Tensor:
    """[T, K + BIAS_COLUMNS] = [x, bias_scale, 0...] in x's dtype (autograd-aware)."""
    if bias_scale.shape != (x.shape[0],):
        raise ValueError(f"bias_scale must be [T] = [{x.shape[0]}] (one scale per row of x), "
                         f"got {tuple(bias_scale.shape)}")
    pad = x.new_zeros(x.shape[0], BIAS_COLUMNS - 1)
    return torch.cat([x, bias_scale.to(x.dtype)[:, None], pad], dim=1)
