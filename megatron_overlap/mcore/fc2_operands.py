"""FC1 + activation and the FC2 operands of Megatron's experts, as the fused op reads them.

Three experts modules are fused:
    TEGroupedMLP        Megatron's default (`--transformer-impl transformer_engine
                        --moe-grouped-gemm`): TE grouped linears, FC2 one parameter per
                        expert (`linear_fc2.weight0 .. weight{E-1}`, `bias0 ..`).
    SequentialMLP       a loop of per-expert MLPs (local or TE linears).
    GroupedGemmExperts  this package's non-TE grouped experts (one stacked weight).

FC1 and the activation compute each module's own function. TEGroupedMLP's FC1 weights
(`linear_fc1.weight0 ..`) are read, like FC2's, as one stacked operand of a grouped GEMM
(`grouped_fc1_activation`, Megatron's activation after it): TE's GroupedLinear splits the
rows on the host and runs one GEMM per expert, which the grouped GEMM on device offsets
avoids (and with it the host sync). Where the activation is one only TE's forward
computes (GLU interleaving, the fused squared ReLU), TEGroupedMLP's forward runs as
Megatron wrote it with `linear_fc2` replaced, for that one call, by a module that
returns its input (`_FC2Input`). The op then computes FC2:
the per-expert weights stacked once and again only after they change
(`ExpertWeightStack`: a view where the layer packed them back to back), and an FC2 bias
folded into GEMM2 as one more column (`with_bias_columns`: y = x W^T + prob * b, where
stock adds it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

from ..ops import ExpertWeightStack, Fp8Scales, with_bias_columns
from .experts import (GroupedGemmExperts, apply_probs_on_input, bias_scale,
                      grouped_fc1_activation, host_counts, routed_activation, te_fc1_is_grouped)
from .fp8_experts import BlockWeights, Fp8Weights, own_block_operands, own_fp8_operands
from .te_fp8 import Fp8WeightStack, fp8_refusal, recipe_kind, te_fp8_fc2

FUSED_EXPERTS = (TEGroupedMLP, SequentialMLP, GroupedGemmExperts)


class FC2Operands(NamedTuple):
    """h [T, K'] (FC1 + activation, probabilities applied) and weight [E, N, K'], where
    K' = K, or K + BIAS_COLUMNS with an FC2 bias folded in; under TE's FP8 recipes both
    e4m3 with their `scales`, and `sink`, TE's FC2 node that runs their backward
    (mcore/te_fp8.py; None without gradients)."""

    h: torch.Tensor
    weight: torch.Tensor
    scales: Fp8Scales | None = None
    sink: torch.Tensor | None = None


@dataclass
class OperandStacks:
    """One layer's cached expert operands: FC1's weight (TEGroupedMLP) and FC2's; under FP8
    TE's e4m3 FC2 weights (training) or FC1's and FC2's quantized by the grouped FP8
    path (inference, mcore/fp8_experts.py)."""

    fc1: ExpertWeightStack = field(default_factory=ExpertWeightStack)
    fc2: ExpertWeightStack = field(default_factory=ExpertWeightStack)
    fc2_fp8: Fp8WeightStack = field(default_factory=Fp8WeightStack)
    fc1_own_fp8: Fp8Weights = field(default_factory=Fp8Weights)
    fc2_own_fp8: Fp8Weights = field(default_factory=Fp8Weights)
    fc1_own_block: BlockWeights = field(default_factory=BlockWeights)
    fc2_own_block: BlockWeights = field(default_factory=BlockWeights)


class _FC2Input(torch.nn.Module):
    """Stands in for TEGroupedMLP.linear_fc2 for one forward: returns FC2's input."""

    def forward(self, x, m_splits):
        return x, None


def unsupported_experts(experts) -> str | None:
    """Why the op cannot take over FC2 of `experts` (None: it can)."""
    if not isinstance(experts, FUSED_EXPERTS):
        return (f"{type(experts).__name__} experts (TEGroupedMLP, SequentialMLP or "
                "GroupedGemmExperts are fused)")
    if not isinstance(experts, TEGroupedMLP):
        return None
    fc2 = experts.linear_fc2
    if experts._with_fused_impl:
        return "TEGroupedMLP on TE's op fuser (use_transformer_engine_op_fuser)"
    if experts.activation_recompute:
        return "TEGroupedMLP with recomputed activations (recompute_modules 'moe_act')"
    if experts.offload_expert_fc1 or experts.offload_moe_act or experts.offload_fused_group_mlp:
        return "TEGroupedMLP with fine-grained activation offloading"
    if getattr(fc2, "single_grouped_weight", False) or not hasattr(fc2, "weight0"):
        return "TEGroupedMLP whose FC2 is one grouped weight (single_grouped_weight)"
    return fp8_refusal(experts.config, fc2)


def fc2_params(experts):
    """(FC2 weights, FC2 biases or None) of `experts`, in expert order: E [N, K] and E [N]
    parameters, or GroupedGemmExperts' [E, N, K] and [E, N]."""
    if isinstance(experts, GroupedGemmExperts):
        return experts.fc2_weight, experts.fc2_bias
    if isinstance(experts, SequentialMLP):
        fc2s = [expert.linear_fc2 for expert in experts.local_experts]
        biases = [fc2.bias for fc2 in fc2s]
        return [fc2.weight for fc2 in fc2s], None if biases[0] is None else biases
    fc2 = experts.linear_fc2
    e = experts.num_local_experts
    biases = [getattr(fc2, f"bias{i}") for i in range(e)] if fc2.use_bias else None
    return [getattr(fc2, f"weight{i}") for i in range(e)], biases


def te_fc1_params(experts):
    """(FC1 weights, FC1 biases or None) of TEGroupedMLP `experts`: E [G*F, H], E [G*F]."""
    fc1 = experts.linear_fc1
    e = experts.num_local_experts
    biases = [getattr(fc1, f"bias{i}") for i in range(e)] if fc1.use_bias else None
    return [getattr(fc1, f"weight{i}") for i in range(e)], biases


def _pack(weights) -> None:
    if len(weights) < 2 or len({(w.shape, w.dtype, w.device) for w in weights}) != 1:
        return
    with torch.no_grad():
        packed = torch.stack([w.detach() for w in weights])
        for w, view in zip(weights, packed.unbind(0)):
            w.data = view


def pack_expert_weights(experts) -> None:
    """Put the E per-expert FC2 weights (and TEGroupedMLP's FC1 weights) back to back in
    one storage each (values unchanged), so `ExpertWeightStack` reads them as a view.
    Call at construction, before an optimizer or DDP holds the parameters (which may move
    them again: then the stack copies once after each change)."""
    if isinstance(experts, GroupedGemmExperts):
        return  # (already one parameter each)
    _pack(fc2_params(experts)[0])
    if te_fc1_is_grouped(experts):
        _pack(te_fc1_params(experts)[0])


def _te_fc1_activation(experts, x, counts: list[int], probs) -> torch.Tensor:
    """TEGroupedMLP.forward with FC2 standing aside: FC1 + activation as stock computes them."""
    fc2 = experts.linear_fc2
    experts.linear_fc2 = _FC2Input()
    try:
        h, _ = experts(x, torch.tensor(counts), probs)
    finally:
        experts.linear_fc2 = fc2
    return h


def _fc1_activation(experts, stacks, x, tokens_per_expert, probs, device_counts, valid_rows):
    if isinstance(experts, GroupedGemmExperts):
        return experts.fc1_activation(x, tokens_per_expert, probs, routed_activation,
                                      device_counts, valid_rows)
    if te_fc1_is_grouped(experts):
        weights, biases = te_fc1_params(experts)
        weight = stacks.fc1.operand(weights).to(x.dtype)
        bias = None if biases is None else torch.stack(biases)  # (E x G*F: a small copy)
        return grouped_fc1_activation(experts, weight, bias, x, tokens_per_expert, probs,
                                      routed_activation, device_counts, valid_rows)
    counts = host_counts(tokens_per_expert)
    if isinstance(experts, TEGroupedMLP):
        return _te_fc1_activation(experts, x, counts, probs)
    x, probs = apply_probs_on_input(experts.config, x, probs)
    hs = []
    for expert, xe, pe in zip(experts.local_experts, torch.split(x, counts),
                              torch.split(probs, counts)):
        intermediate, bias = expert.linear_fc1(xe)
        hs.append(routed_activation(expert, intermediate, bias, pe))
    return torch.cat(hs)


def fc2_operands(experts, stacks: OperandStacks, x: torch.Tensor, tokens_per_expert,
                 probs: torch.Tensor, device_counts: torch.Tensor | None = None,
                 valid_rows: torch.Tensor | None = None,
                 token_index: torch.Tensor | None = None,
                 grouped_fp8: bool = False) -> FC2Operands:
    """FC1 + activation of the expert-sorted rows x and the FC2 weight of `experts`.

    tokens_per_expert may be None where `device_counts` is given and the experts run FC1
    without the host counts (GroupedGemmExperts, TEGroupedMLP by `te_fc1_is_grouped`);
    x's rows past their sum (`valid_rows`, on the device) are then padding, h's rows there
    unspecified. Gradients reach every parameter, the biases' included. Under TE's FP8
    autocast TEGroupedMLP runs the grouped FP8 path where the caller found the call takes
    it (`grouped_fp8`: inference, `own_fp8_refusal` None), else TE's FC1 and FC2
    quantization (`te_fp8_fc2`). `token_index`: the rows are x[token_index] (x the tokens
    before the permutation), which the grouped FP8 path gathers while quantizing; any
    other path gathers first.
    """
    block = grouped_fp8 and recipe_kind(experts.config) == "block"
    if token_index is not None and (not grouped_fp8 or block
                                    or experts.config.moe_apply_probs_on_input):
        # (gathered first: the probabilities scale the rows before any quantization; the
        # blockwise path reads gathered rows)
        x, token_index = x.index_select(0, token_index), None
    if block:
        return FC2Operands(*own_block_operands(
            experts, stacks.fc1_own_block, stacks.fc2_own_block, x, tokens_per_expert, probs,
            device_counts, valid_rows))
    if grouped_fp8:
        return FC2Operands(*own_fp8_operands(
            experts, stacks.fc1_own_fp8, stacks.fc2_own_fp8, x, tokens_per_expert, probs,
            device_counts, valid_rows, token_index))
    if isinstance(experts, TEGroupedMLP) and experts.config.fp8:
        return FC2Operands(*te_fp8_fc2(experts, stacks.fc2_fp8, x,
                                       host_counts(tokens_per_expert), probs))
    h = _fc1_activation(experts, stacks, x, tokens_per_expert, probs, device_counts,
                        valid_rows)
    weights, biases = fc2_params(experts)
    weight = stacks.fc2.operand(weights, biases).to(h.dtype)
    if biases is not None:
        h = with_bias_columns(h, bias_scale(experts.config, probs))
    return FC2Operands(h, weight)
