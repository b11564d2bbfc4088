"""FC2 of TEGroupedMLP under Transformer Engine's FP8 recipes, as the fused op takes it.

Megatron's TEGroupedMLP.forward runs as written: the rows padded to the recipe's
alignment (`quantization_padding`), FC1 in FP8, the activation with the probabilities,
then `linear_fc2` (TE's GroupedLinear) with its forward GEMM skipped. TE quantizes FC2's
input per expert and its weights exactly as in its own forward (current scaling's amax,
delayed scaling's amax history and scale, blockwise 1x128 / 128x128 blocks, cached
workspaces), so its scaling state advances as stock's and a run can switch
`--moe-overlap` between checkpoints; its autograd node is kept, and TE runs FC2's dgrad
and wgrad in the recipe's formats in the backward. The op computes the GEMM TE skipped,
with the combine and reduce-scatter, from the e4m3 data and scale_inv TE made, the
padding rows dropped; its backward hands dL/dy to TE's node (`grad_sink`).

    recipe (Megatron --fp8-recipe)   TE quantizer                     op's Fp8Scales.kind
    tensorwise                       Float8CurrentScaling, per expert  "tensor" (E x scales)
    delayed                          DelayedScaling, per expert        "tensor"
    blockwise                        Float8BlockScaling 1x128/128x128  "block"
    mxfp8, custom, fp4               -                                 stock (`fp8_refusal`)

Where the grouped FP8 experts take a call (mcore/fp8_experts.py: tensorwise, delayed
and blockwise, inference and training), TE's GroupedLinear does not run and this module
is not used; it runs what they refuse (`delay_wgrad_compute`, blockwise with fp32
scales, a GroupedLinear without TE 2.x's delayed-scaling slots, FP8 parameters, ...).

How the GEMM is skipped: TE's GroupedLinear calls `general_grouped_gemm` through its
module's globals; for the one FC2 call that name is a function that records the
quantized operands (A: weights, B: inputs) and computes nothing (`_gemm_skipped`).
TE's output buffer is allocated and never written; its rows are never read.
"""

from __future__ import annotations

import contextlib
import sys
from typing import NamedTuple

import torch

from ..ops import Fp8Scales

#: Megatron's --fp8-recipe -> the op's scaling kind (the recipes whose GEMM2 the op runs)
RECIPE_KINDS = {"tensorwise": "tensor", "delayed": "tensor", "blockwise": "block"}
_GEMM = "general_grouped_gemm"
E4M3 = torch.float8_e4m3fn


class Fp8FC2(NamedTuple):
    """The op's FP8 GEMM2 operands: x [T, K] and weight [E, N, K] e4m3, their scales, and
    `sink` ([T, N], TE's FC2 node with the padding rows dropped; None without grads)."""

    x: torch.Tensor
    weight: torch.Tensor
    scales: Fp8Scales
    sink: torch.Tensor | None


def recipe_name(config) -> str:
    """Megatron's --fp8-recipe of `config` as a string (its enum's value)."""
    return str(getattr(config.fp8_recipe, "value", config.fp8_recipe))


def recipe_kind(config) -> str | None:
    """The op's scaling kind for Megatron config `config` (None: not FP8)."""
    if not config.fp8:
        return None
    return RECIPE_KINDS.get(recipe_name(config))


def fp8_refusal(config, fc2) -> str | None:
    """Why FC2 `fc2` of a TEGroupedMLP under `config` cannot run on the op in FP8 (None:
    it can, or the layer is not FP8)."""
    if config.fp4:
        return "fp4 experts (the fused GEMM2 takes e4m3 with TE's Hopper recipes)"
    if not config.fp8:
        return None
    recipe = recipe_name(config)
    if recipe not in RECIPE_KINDS:
        return (f"--fp8-recipe {recipe} (the fused GEMM2 takes "
                f"{', '.join(RECIPE_KINDS)}; mxfp8 is Blackwell's)")
    if getattr(fc2, "use_bias", False):
        return "an FC2 bias under FP8 (TE adds it in its FP8 GEMM's epilogue)"
    if not config.bf16:
        return ("FP8 with fp16 / fp32 activations (the fused FP8 GEMM2 writes bf16, as "
                "TE's FP8 recipes run under --bf16)")
    if gemm_module(fc2) is None:
        return (f"{type(fc2).__name__} calls no module-level {_GEMM} (a Transformer "
                f"Engine other than 2.x)")
    return None


def autocast_refusal(experts) -> str | None:
    """Why this call of FP8 TEGroupedMLP `experts` runs stock (None: it fuses): TE's FP8
    autocast is off (a layer called outside Megatron's FP8 context: TE would compute FC2
    in bf16, which the fused FP8 path cannot take). Read from the FP8 state TE's
    GroupedLinear reads (its module's `FP8GlobalStateManager`)."""
    if not experts.config.fp8:
        return None
    state = getattr(gemm_module(experts.linear_fc2), "FP8GlobalStateManager", None)
    if state is not None and not state.is_fp8_enabled():
        return "an FP8 layer called outside TE's FP8 autocast (TE computes it in bf16)"
    return None


def block_scales_exact(experts) -> bool:
    """Whether TE's blockwise recipe in force scales activations and weights by powers of
    two (its default; NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 turns it off), which the grouped
    blockwise path needs to dequantize exactly, gradients included. Read from the recipe
    TE's GroupedLinear reads (its module's `FP8GlobalStateManager`); True where none can
    be read."""
    state = getattr(gemm_module(experts.linear_fc2), "FP8GlobalStateManager", None)
    recipe = getattr(state, "get_fp8_recipe", lambda: None)()
    return all(getattr(getattr(recipe, name, None), "power_2_scale", True)
               for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"))


def gemm_module(fc2):
    """The module whose `general_grouped_gemm` FC2's forward calls: that of the class in
    fc2's MRO defining `forward` next to it (TE's grouped_linear under Megatron's
    TEGroupedLinear), else None."""
    for cls in type(fc2).__mro__:
        module = sys.modules.get(cls.__module__)
        if "forward" in vars(cls) and callable(getattr(module, _GEMM, None)):
            return module
    return None


@contextlib.contextmanager
def _gemm_skipped(fc2, captured: dict):
    """FC2's forward with its GEMM replaced by a record of the quantized operands."""
    module = gemm_module(fc2)
    real = getattr(module, _GEMM)

    def record(weights, inputs, out, *args, **kwargs):
        if not all(map(is_fp8, inputs)):  # (TE outside its FP8 autocast: its bf16 GEMM,
            return real(weights, inputs, out, *args, **kwargs)  # nothing captured)
        captured["weights"] = [rowwise(t) for t in weights]
        captured["inputs"] = [rowwise(t) for t in inputs]
        return out, None, None

    setattr(module, _GEMM, record)
    try:
        yield
    finally:
        setattr(module, _GEMM, real)


def is_fp8(tensor) -> bool:
    """Is `tensor` one of TE's FP8 storages (`rowwise` reads it)?"""
    return hasattr(tensor, "_rowwise_data") or hasattr(tensor, "_data")


def rowwise(storage) -> tuple[torch.Tensor, torch.Tensor]:
    """(rowwise data, its scale_inv) of a TE FP8 tensor: `Float8TensorStorage` (`_data`,
    `_scale_inv`) or `Float8BlockwiseQTensorStorage` (`_rowwise_data`,
    `_rowwise_scale_inv`). Read at the GEMM: in training TE drops the inputs' rowwise copy
    right after it (`update_usage(rowwise_usage=False)`, keeping the columnwise one for
    the wgrad)."""
    if hasattr(storage, "_rowwise_data"):
        return storage._rowwise_data, storage._rowwise_scale_inv
    return storage._data, storage._scale_inv


class _CapturingFC2(torch.nn.Module):
    """Stands in for TEGroupedMLP.linear_fc2 for one forward: runs it with its GEMM
    skipped and keeps its quantized operands, (padded) splits, and whether TE quantized
    the weights again (`requantized`)."""

    def __init__(self, fc2):
        super().__init__()
        object.__setattr__(self, "fc2", fc2)  # (not a submodule: no parameters twice)
        self.captured: dict = {}
        self.splits: list[int] | None = None
        self.requantized = True

    def forward(self, h, m_splits):
        self.splits = list(m_splits)
        self.requantized = not reuses_weight_workspace(self.fc2)
        with _gemm_skipped(self.fc2, self.captured):
            return self.fc2(h, m_splits)


def reuses_weight_workspace(fc2) -> bool:
    """Does this call of Megatron's TEGroupedLinear `fc2` read TE's cached FP8 weights
    as they are? Where it passes TE `is_first_microbatch=False` (after a step's first
    microbatch; in inference after the first call) over bf16 / fp32 parameters; FP8
    parameters change in place, so never."""
    weight = getattr(fc2, "weight0", None)
    return (getattr(fc2, "is_first_microbatch", None) is False
            and not getattr(fc2, "disable_parameter_transpose_cache", False)
            and type(weight) is torch.nn.Parameter)


class Fp8WeightStack:
    """One layer's FC2 weights as the op reads them: TE's e4m3 weights stacked [E, N, K]
    with their scales, built again only where TE quantized them again or handed other
    tensors (holds the last stack only)."""

    def __init__(self):
        self._key = self._value = None

    def operand(self, kind: str, weights: list, requantized: bool) -> tuple:
        """(weight [E, N, K] e4m3, w_scale_inv) of TE's (data, scale_inv) per expert."""
        data = [d for d, _ in weights]
        key = (kind, tuple(d.data_ptr() for d in data))
        if requantized or key != self._key:
            if kind == "tensor":
                scale = torch.cat([s.reshape(1) for _, s in weights])
            else:
                scale = torch.stack([s for _, s in weights])
            self._value = (torch.stack(data).view(E4M3), scale.float())
            self._key = key
        return self._value


class _KeepPadded(torch.nn.Module):
    """Stands in for TEGroupedMLP.quantization_unpadding for one forward: keeps the
    unpadded splits and returns the (never written) padded rows as they are."""

    counts: list[int] | None = None

    def forward(self, out, counts):
        self.counts = list(counts)
        return out


class _DropPadding(torch.autograd.Function):
    """[T, N] rows of TE's padded FC2 output (values unused); backward puts each row's
    gradient at its padded place, zeros on the padding rows (as Fp8Unpadding's)."""

    @staticmethod
    def forward(ctx, padded, places):
        ctx.save_for_backward(places)
        ctx.padded_rows = padded.shape[0]
        return padded.new_empty(places.shape[0], padded.shape[1])

    @staticmethod
    def backward(ctx, grad):
        (places,) = ctx.saved_tensors
        out = grad.new_zeros(ctx.padded_rows, grad.shape[1])
        return out.index_copy_(0, places, grad), None


def padded_places(counts: list[int], padded: list[int], device) -> torch.Tensor | None:
    """[T] int64: each row's place among the padded rows (each expert's rows first, its
    padding after), on `device`; None where nothing is padded."""
    if counts == padded:
        return None
    shift, run = [], 0
    for c, p in zip(counts, padded):
        shift.append(run)
        run += p - c
    shifts = torch.tensor(shift, dtype=torch.int64).to(device, non_blocking=True)
    sizes = torch.tensor(counts, dtype=torch.int64).to(device, non_blocking=True)
    rows = sum(counts)
    return (torch.arange(rows, device=device)
            + torch.repeat_interleave(shifts, sizes, output_size=rows))


def _back_to_back(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """One [sum m_e, K] view of per-expert [m_e, K] tensors that TE allocated back to
    back, in order, in one storage (its bulk allocation), else None."""
    first = parts[0]
    if not all(p.is_contiguous() and p.shape[1:] == first.shape[1:]
               and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               for p in parts):
        return None
    offset, rows = first.storage_offset(), 0
    for p in parts:
        if p.storage_offset() != offset + rows * first.stride(0):
            return None
        rows += p.shape[0]
    return torch.as_strided(first, (rows, *first.shape[1:]), first.stride(), offset)


def _joined(parts: list[torch.Tensor], counts: list[int], places) -> torch.Tensor:
    """[T, K]: the first counts[e] rows of each per-expert tensor (the padding after
    them dropped): a view, one row gather (`places`), or one copy."""
    joined = _back_to_back(parts)
    if joined is not None:
        return joined if places is None else joined.index_select(0, places)
    return torch.cat([p[:c] for p, c in zip(parts, counts)])


def input_operand(kind: str, inputs: list, counts: list[int],
                  places: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [T, K] e4m3, x_scale_inv) from TE's per-expert quantized FC2 inputs ((data,
    scale_inv) each, `rowwise`): their data joined, the padding rows dropped; one scale
    per expert ("tensor") or the 1x128 scales of the kept rows ("block", [KB, T])."""
    x = _joined([data for data, _ in inputs], counts, places)
    if kind == "tensor":
        scale = torch.cat([s.reshape(1) for _, s in inputs])
    else:
        scale = torch.cat([s[:, :c] for (_, s), c in zip(inputs, counts)], dim=1)
    return x.view(E4M3), scale.float()


def te_fp8_fc2(experts, weights: Fp8WeightStack, x: torch.Tensor, counts: list[int],
               probs: torch.Tensor) -> Fp8FC2:
    """TEGroupedMLP `experts`' forward on the expert-sorted rows x (host `counts`, its
    probs) under TE's FP8 autocast, FC2's GEMM left to the op: its operands (the
    weights through the layer's `weights` stack) and sink."""
    fc2, unpadding = experts.linear_fc2, getattr(experts, "quantization_unpadding", None)
    capture, keep = _CapturingFC2(fc2), _KeepPadded()
    experts.linear_fc2 = capture
    if unpadding is not None:
        experts.quantization_unpadding = keep
    try:
        out, _ = experts(x, torch.tensor(counts), probs)
    finally:
        experts.linear_fc2 = fc2
        if unpadding is not None:
            experts.quantization_unpadding = unpadding
    if not capture.captured:
        raise RuntimeError(f"{type(fc2).__name__}'s forward computed no FP8 GEMM (is TE's "
                           f"FP8 autocast on?): the fused FP8 path cannot take its operands")
    padded = capture.splits
    unpadded = keep.counts if keep.counts is not None else padded
    kind = recipe_kind(experts.config)
    places = padded_places(unpadded, padded, x.device)
    fp8_x, x_scale = input_operand(kind, capture.captured["inputs"], unpadded, places)
    weight, w_scale = weights.operand(kind, capture.captured["weights"], capture.requantized)
    sink = None
    if out.requires_grad:
        sink = out if places is None else _DropPadding.apply(out, places)
    return Fp8FC2(fp8_x, weight, Fp8Scales(kind, x_scale, w_scale), sink)
