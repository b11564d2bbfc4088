"""TEGroupedMLP under `--fp8-recipe tensorwise` in inference: FC1, the activation and FC2's
operands on the op's grouped FP8 path instead of TE's GroupedLinear.

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
as TE's cached FP8 weight workspaces.

Where it runs: calls in inference (eval mode, no gradient through the rows, probs or
experts; bf16 rows: the layer's `CallPath.grouped_fp8`) of fused layers whose experts
`own_fp8_refusal` takes, decided once at build: TEGroupedMLP, recipe tensorwise, no FC1 /
FC2 bias, bf16 / fp32 parameters, an activation the bf16 grouped path computes. Training and the other
recipes keep TE's own quantization (mcore/te_fp8.py): current scaling keeps no state,
so nothing of TE's scaling state is skipped here; delayed scaling's amax history is
TE's to update.
"""

from __future__ import annotations

import logging

import torch
from megatron.core.transformer.moe.experts import TEGroupedMLP

from ..ops import Fp8Scales, fp8_grouped_linear, quantize_fp8_groups, quantize_fp8_stack
from .experts import apply_probs_on_input, host_counts, routed_activation
from .te_fp8 import recipe_kind

log = logging.getLogger(__name__)


class Fp8Weights:
    """One weight stack's e4m3 data and per-expert scale_inv, quantized again only after
    one of its parameters changed (storage or version counter: an optimizer step, a
    load); holds the last one built."""

    def __init__(self):
        self._key = self._value = None

    def operand(self, weights: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        key = tuple((w.data_ptr(), w._version, tuple(w.shape)) for w in weights)
        if key != self._key:
            with torch.no_grad():
                self._value = quantize_fp8_stack(torch.stack([w.detach() for w in weights]))
            self._key = key
        return self._value


def own_fp8_refusal(experts) -> str | None:
    """Why FP8 experts `experts` keep TE's GroupedLinear in inference (None: the grouped
    FP8 path takes them; not FP8 at all: a reason too)."""
    if not isinstance(experts, TEGroupedMLP):
        return f"{type(experts).__name__} experts (TEGroupedMLP's are taken)"
    c = experts.config
    if recipe_kind(c) is None:
        return "not an FP8 layer"
    recipe = str(getattr(c.fp8_recipe, "value", c.fp8_recipe))
    if recipe != "tensorwise":
        return f"--fp8-recipe {recipe} (the grouped FP8 path runs tensorwise's current scaling)"
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


def grouped_fp8_note(layer) -> str | None:
    """At build, for a fused FP8 layer: `own_fp8_refusal` of its experts, logged either
    way (which path its inference takes); None for a layer not fused in FP8."""
    if layer.unsupported_reason is not None or not layer.config.fp8:
        return None
    why = own_fp8_refusal(layer.experts)
    log.info("moe-overlap layer %s: FP8 inference %s", layer.layer_number,
             "on the grouped FP8 experts" if why is None else f"on TE's GroupedLinear: {why}")
    return why


def _weights(module, experts: int) -> list[torch.Tensor]:
    return [getattr(module, f"weight{i}") for i in range(experts)]


def own_fp8_operands(experts, fc1: Fp8Weights, fc2: Fp8Weights, x: torch.Tensor,
                     tokens_per_expert, probs: torch.Tensor, device_counts=None,
                     valid_rows=None, token_index=None
                     ) -> tuple[torch.Tensor, torch.Tensor, Fp8Scales]:
    """(h [T, K] e4m3, FC2 weight [E, N, K] e4m3, their scales) of TEGroupedMLP `experts`
    on the expert-sorted rows x (or x[token_index], x the tokens before the permutation:
    gathered while quantizing): host `tokens_per_expert`, or None with `device_counts`
    (the rows past their sum, `valid_rows` on the device, are padding)."""
    if tokens_per_expert is not None:
        device_counts = torch.tensor(host_counts(tokens_per_expert)).to(x.device,
                                                                      non_blocking=True)
    ends = torch.cumsum(device_counts, 0)
    x, probs = apply_probs_on_input(experts.config, x, probs)
    e = experts.num_local_experts
    xq, _, x_rows = quantize_fp8_groups(x, ends, token_index)
    w1, w1_scale = fc1.operand(_weights(experts.linear_fc1, e))
    inter = fp8_grouped_linear(xq, x_rows, w1, w1_scale, ends)
    h = routed_activation(experts, inter, None, probs, valid_rows)
    hq, h_scale, _ = quantize_fp8_groups(h, ends)
    w2, w2_scale = fc2.operand(_weights(experts.linear_fc2, e))
    return hq, w2, Fp8Scales("tensor", h_scale, w2_scale)
