"""TEGroupedMLP's FP8 experts on the grouped path instead of TE's GroupedLinear: FC1, the
activation and FC2's operands (tensorwise, delayed and blockwise, inference and training).

TE's GroupedLinear quantizes one expert at a time: per expert an amax, a scale and a cast
of its input, host-split views after a host sync, hundreds of launches per layer with
128 experts (one H100, Qwen 4 x 4096: FC2's forward without its GEMM 3.2 of its 4.1 ms).
Here each step is one or two launches over all experts, on the counts on the device:

    x -> quantize_fp8_groups (each expert's rows one tensor: TE's current scaling)
      -> fp8_grouped_linear with FC1's e4m3 weights (torch's scaled grouped GEMM)
      -> the layer's activation with the probabilities (as the bf16 path's)
      -> quantize_fp8_groups -> the op's FP8 GEMM2 with FC2's e4m3 weights, combine, RS

The quantization is TE's recipe, bit for bit (kernels/fp8_rows.py: per expert amax, scale
448 / amax, a saturating round to nearest): the same e4m3 operands and scales TE's
forward makes, only the GEMMs are other implementations of the same product (fp32
accumulation). The weights are quantized once per change of a parameter (`Fp8Weights`),
as TE's cached FP8 weight workspaces. Delayed scaling quantizes with the scales in TE's
`fp8_meta` instead and records the amaxes there, each linear inside TE's own forward
bracket (mcore/te_delayed.py), so TE's scaling state advances as under its
GroupedLinear; its weights are quantized at every call, as TE's.

Training (`--fp8-format e4m3`: gradients in e4m3; TE's wgrad not deferred) runs FP8
dgrad and wgrad under the same current scaling (ops/fp8_train.py); under Megatron's fused
gradient accumulation the weight gradients are added into each parameter's main_grad as
TE's and Megatron's linears add them (`_main_grad_accumulation`). Blockwise runs another
way (`own_block_operands`): its power-of-two block scales make the dequantized operands
exactly the FP8 ones in bf16, on the bf16 grouped kernels, and in training each GEMM's
operands are blocked as TE's recipe blocks them (ops/block_train.py).

Which calls: decided once at build (`GroupedFp8`, from `own_fp8_refusal` and
`own_fp8_training_refusal`): TEGroupedMLP, no FC1 / FC2 bias, bf16 / fp32 parameters, an
activation the bf16 grouped path computes; delayed scaling a TE GroupedLinear exposing
its per-GEMM slots (`delayed_refusal`). Under `--fp8-format hybrid` the gradients are
e5m2, as TE's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.experts import TEGroupedMLP

from ..ops import (DelayedScales, Fp8Rows, Fp8Scales, Fp8Stack, block_dequantized,
                   block_dequantized_weights, block_expert_linear, fp8_expert_linear,
                   quantize_fp8_groups, quantize_fp8_stack, scaled_grouped_mm_refusal,
                   stacked, with_transposed)
from .experts import apply_probs_on_input, grouped_fc1_activation, host_counts, routed_activation
from .te_delayed import delayed_refusal, linear_scaling
from .te_fp8 import block_scales_exact, recipe_kind, recipe_name, reuses_weight_workspace

log = logging.getLogger(__name__)


class _PerChange:
    """A value built from a weight stack (`ops.stacked`: the packed weights' view, no bf16
    copy), built again only after one of its parameters changed (storage or version
    counter: an optimizer step, a load); holds the last one built."""

    def __init__(self):
        self._key = self._value = None

    def _built(self, weights: list[torch.Tensor], build):
        key = tuple((w.data_ptr(), w._version, tuple(w.shape)) for w in weights)
        if key != self._key:
            with torch.no_grad():
                self._value = build(stacked(weights))
            self._key = key
        return self._value


class Fp8Weights(_PerChange):
    """A weight stack's e4m3 data and per-expert scale_inv (`Fp8Stack`), with its
    transpose once a backward asked. Under delayed scaling (`delayed`: the weights'
    scales and amax slots) quantized as TE's GroupedLinear quantizes its weights: at
    each call where Megatron's TEGroupedLinear passes TE no `is_first_microbatch=False`
    (a step's first microbatch), with the scales of that moment, recording their amax;
    the others read that stack as it is (`reuse`)."""

    def operand(self, weights: list[torch.Tensor], transposed: bool = False,
                delayed: DelayedScales | None = None, reuse: bool = False) -> Fp8Stack:
        if delayed is None:
            value = self._built(weights, lambda stack: Fp8Stack(*quantize_fp8_stack(stack)))
        elif reuse and self._value is not None:
            value = self._value
        else:
            with torch.no_grad():
                value = Fp8Stack(*quantize_fp8_stack(stacked(weights), delayed))
            self._key = None  # (not current scaling's stack of these weights)
        self._value = with_transposed(value) if transposed else value
        return self._value


#: the recipes the grouped FP8 experts take (delayed with TE's scaling state, te_delayed.py;
#: blockwise through exact dequantization onto the bf16 grouped kernels, `own_block_operands`)
GROUPED_RECIPES = ("tensorwise", "delayed", "blockwise")


class BlockWeights(_PerChange):
    """A weight stack through the blockwise recipe's 128 x 128 blocks and back (bf16,
    exactly its e4m3 values)."""

    def operand(self, weights: list[torch.Tensor]) -> torch.Tensor:
        return self._built(weights, block_dequantized_weights)


def own_fp8_refusal(experts) -> str | None:
    """Why FP8 experts `experts` keep TE's GroupedLinear in inference (None: the grouped
    FP8 path takes them; not FP8 at all: a reason too)."""
    if not isinstance(experts, TEGroupedMLP):
        return f"{type(experts).__name__} experts (TEGroupedMLP's are taken)"
    c = experts.config
    if recipe_kind(c) is None:
        return "not an FP8 layer"
    recipe = recipe_name(c)
    if recipe not in GROUPED_RECIPES:
        return (f"--fp8-recipe {recipe} (the grouped FP8 path runs tensorwise's current "
                f"scaling, delayed scaling and blockwise's power-of-two blocks)")
    if recipe != "blockwise" and (why := scaled_grouped_mm_refusal()) is not None:
        return why
    if recipe == "delayed" and (why := (delayed_refusal(experts.linear_fc1)
                                        or delayed_refusal(experts.linear_fc2))):
        return why
    if recipe == "blockwise" and c.moe_apply_probs_on_input:
        return "blockwise with moe_apply_probs_on_input (TE quantizes the rows after the probabilities)"
    if experts.linear_fc1.use_bias or experts.linear_fc2.use_bias:
        return "expert biases (TE adds them in its FP8 GEMMs' epilogue)"
    if (c.moe_mlp_glu_interleave_size is not None
            or getattr(c, "use_fused_weighted_squared_relu", False)):
        return "an activation only TE's forward computes"
    weights = (experts.linear_fc1.weight0, experts.linear_fc2.weight0)
    if not all(type(w) is torch.nn.Parameter and w.dtype in (torch.bfloat16, torch.float32)
               for w in weights):
        return "FP8 or non-bf16 / fp32 expert parameters (TE's fp8_model_init keeps them quantized)"
    ffn = experts.linear_fc2.weight0.shape[1]
    if c.hidden_size % 16 or ffn % 16:
        return f"hidden {c.hidden_size} / FFN {ffn} not multiples of 16 (FP8 GEMM rows)"
    return None


def own_fp8_training_refusal(experts) -> str | None:
    """Why FP8 experts `experts` keep TE's GroupedLinear in training (None: the grouped
    FP8 path trains them): `own_fp8_refusal`, or a format or option of TE's backward."""
    why = own_fp8_refusal(experts)
    if why is not None:
        return why
    c = experts.config
    fmt = str(getattr(c.fp8, "value", c.fp8))
    if fmt not in ("e4m3", "hybrid"):
        return f"--fp8-format {fmt} (the grouped FP8 experts train e4m3 and hybrid)"
    if getattr(c, "delay_wgrad_compute", False):
        return "delay_wgrad_compute (TE's GroupedLinear defers its wgrad)"
    return None


@dataclass(frozen=True)
class GroupedFp8:
    """Which calls of a layer the grouped FP8 experts take, decided at build: `kind` the
    recipe's scaling kind ("tensor", "block"; None: the layer is not fused in FP8, nothing
    is taken), and why inference / training keep TE's GroupedLinear (None: taken)."""

    kind: str | None = None
    inference_refusal: str | None = None
    training_refusal: str | None = None

    def takes(self, experts, inference: bool, dtype: torch.dtype) -> bool:
        """Does this call (inference or training, rows of `dtype`) take the grouped path?
        Blockwise only while TE's recipe scales by powers of two (`block_scales_exact`)."""
        refusal = self.inference_refusal if inference else self.training_refusal
        return (self.kind is not None and refusal is None and dtype == torch.bfloat16
                and (self.kind != "block" or block_scales_exact(experts)))


def grouped_fp8_note(layer) -> GroupedFp8:
    """At build: the `GroupedFp8` of a layer (its experts' `own_fp8_refusal` and
    `own_fp8_training_refusal` where it is fused in FP8), logged in one line."""
    if layer.unsupported_reason is not None or not layer.config.fp8:
        return GroupedFp8()
    why, why_training = own_fp8_refusal(layer.experts), own_fp8_training_refusal(layer.experts)
    paths = [f"{mode} on " + ("the grouped FP8 experts" if reason is None
                              else f"TE's GroupedLinear ({reason})")
             for mode, reason in (("inference", why), ("training", why_training))]
    log.info("moe-overlap layer %s: FP8 %s", layer.layer_number, "; ".join(paths))
    return GroupedFp8(recipe_kind(layer.config), why, why_training)


def _weights(module, experts: int) -> list[torch.Tensor]:
    return [getattr(module, f"weight{i}") for i in range(experts)]


def _main_grad_accumulation(config, weights: list[torch.Tensor]):
    """Under Megatron's fused gradient accumulation, where the parameters have main_grad
    (Megatron's DDP): a `wgrad_into` adding the weight gradients there and returning what
    Megatron's linears return (a placeholder, the parameter marked
    `grad_added_to_main_grad`, so DDP does not add it again); else None (autograd)."""
    if not config.gradient_accumulation_fusion or not all(
            hasattr(w, "main_grad") for w in weights):
        return None

    def into(grads: list[torch.Tensor]) -> list:
        torch._foreach_add_([w.main_grad for w in weights],
                            [g.to(w.main_grad.dtype) for g, w in zip(grads, weights)])
        out = []
        for w, g in zip(weights, grads):
            if not hasattr(w, "grad_added_to_main_grad"):
                out.append(None)
                continue
            w.grad_added_to_main_grad = True
            make = torch.zeros if getattr(w, "zero_out_wgrad", False) else torch.empty
            out.append(make(w.main_grad.shape, dtype=g.dtype, device=g.device))
        return out
    return into


def block_gradients(experts, x: torch.Tensor) -> bool:
    """Does a blockwise call on rows (or tokens) x build the training nodes: gradients on,
    to x or to the experts' parameters? Else x is blocked once at the tokens (the layer)
    and FC1 reads it as it is; the nodes block the rows themselves and keep the raw ones
    for the wgrad's 128 x 1 blocks."""
    return torch.is_grad_enabled() and (x.requires_grad or any(
        p.requires_grad for p in experts.parameters()))


def _grad_format(config) -> str:
    """The gradients' FP8 format: e5m2 under `--fp8-format hybrid`, else e4m3."""
    return "e5m2" if str(getattr(config.fp8, "value", config.fp8)) == "hybrid" else "e4m3"


def own_block_operands(experts, fc1: BlockWeights, fc2: BlockWeights, x: torch.Tensor,
                       tokens_per_expert, probs: torch.Tensor, device_counts=None,
                       valid_rows=None) -> tuple[torch.Tensor, torch.Tensor, None, object]:
    """(h [T, K], FC2 weight [E, N, K], None, FC2's grad sink or None) of TEGroupedMLP
    `experts` under the blockwise recipe, on the bf16 grouped kernels, which sum the
    exactly dequantized operands' products in fp32 as TE's block-scaled GEMM: FC1's and
    FC2's weights and h through the recipe's blocks and back (kernels/fp8_blocks.py).
    Without gradients x is already through its 1x128 blocks (`ops.block_dequantized`, at
    the tokens, before the permutation copies them); with them (`block_gradients`) FC1
    and FC2's sink are `ops.block_expert_linear` nodes, which quantize x, dL/dy and the
    wgrad's columns as TE's recipe does."""
    e, c = experts.num_local_experts, experts.config
    w1s, w2s = _weights(experts.linear_fc1, e), _weights(experts.linear_fc2, e)
    w1, w2 = fc1.operand(w1s), fc2.operand(w2s)
    if not block_gradients(experts, x):
        h = grouped_fc1_activation(experts, w1, None, x, tokens_per_expert, probs,
                                   routed_activation, device_counts, valid_rows)
        return block_dequantized(h), w2, None, None
    counts = None if tokens_per_expert is None else host_counts(tokens_per_expert)
    if counts is not None:
        device_counts = torch.tensor(counts).to(x.device, non_blocking=True)
    fmt = _grad_format(c)
    inter = block_expert_linear(x, device_counts, w1, w1s, counts, grad_format=fmt,
                                wgrad_into=_main_grad_accumulation(c, w1s))
    h = routed_activation(experts, inter, None, probs, valid_rows)
    sink = block_expert_linear(h, device_counts, w2, w2s, counts, compute=False,
                               grad_format=fmt, wgrad_into=_main_grad_accumulation(c, w2s))
    return block_dequantized(h.detach()), w2, None, sink


def own_fp8_operands(experts, fc1: Fp8Weights, fc2: Fp8Weights, x: torch.Tensor,
                     tokens_per_expert, probs: torch.Tensor, device_counts=None,
                     valid_rows=None, token_index=None
                     ) -> tuple[torch.Tensor, torch.Tensor, Fp8Scales, torch.Tensor | None]:
    """(h [T, K] e4m3, FC2 weight [E, N, K] e4m3, their scales, FC2's grad sink or None)
    of TEGroupedMLP `experts` on the expert-sorted rows x (or x[token_index], x the tokens
    before the permutation: gathered while quantizing, in inference): host
    `tokens_per_expert`, or None with `device_counts` (the rows past their sum,
    `valid_rows` on the device, are padding). Where gradients flow, FC1 and FC2's sink
    run FP8 dgrad and wgrad (ops/fp8_train.py). Current scaling, or delayed scaling
    with TE's state (each linear in TE's forward bracket, `_scaling`)."""
    if tokens_per_expert is not None:
        device_counts = torch.tensor(host_counts(tokens_per_expert)).to(x.device,
                                                                      non_blocking=True)
    ends = torch.cumsum(device_counts, 0)
    x, probs = apply_probs_on_input(experts.config, x, probs)
    e, c = experts.num_local_experts, experts.config
    w1s, w2s = _weights(experts.linear_fc1, e), _weights(experts.linear_fc2, e)
    grads = torch.is_grad_enabled()
    grad_dtype = torch.float8_e5m2 if _grad_format(c) == "e5m2" else torch.float8_e4m3fn
    fc1_grads = grads and (x.requires_grad or any(w.requires_grad for w in w1s))
    delayed = recipe_name(c) == "delayed"
    with linear_scaling(experts.linear_fc1, delayed, x, grad_dtype, fc1_grads) as q1:
        x_rows = Fp8Rows(*quantize_fp8_groups(x.detach(), ends, token_index,
                                              delayed=q1.inputs))
        w1 = fc1.operand(w1s, grads, q1.weights, reuses_weight_workspace(experts.linear_fc1))
        inter = fp8_expert_linear(x, ends, w1, w1s, x_rows,
                                  wgrad_into=_main_grad_accumulation(c, w1s), grad=q1.grad)
    h = routed_activation(experts, inter, None, probs, valid_rows)
    fc2_grads = grads and (h.requires_grad or any(w.requires_grad for w in w2s))
    with linear_scaling(experts.linear_fc2, delayed, h, grad_dtype, fc2_grads) as q2:
        h_rows = Fp8Rows(*quantize_fp8_groups(h.detach(), ends, delayed=q2.inputs))
        w2 = fc2.operand(w2s, grads, q2.weights, reuses_weight_workspace(experts.linear_fc2))
    sink = None
    if fc2_grads:
        sink = fp8_expert_linear(h, ends, w2, w2s, h_rows, compute=False,
                                 wgrad_into=_main_grad_accumulation(c, w2s), grad=q2.grad)
    for linear in (experts.linear_fc1, experts.linear_fc2):
        if hasattr(linear, "is_first_microbatch"):  # (as Megatron's TEGroupedLinear after
            linear.is_first_microbatch = False      # each call: TE's cache is read next)
    return h_rows.data, w2.data, Fp8Scales("tensor", h_rows.scale_inv, w2.scale_inv), sink
