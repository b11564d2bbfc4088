"""A gated shared expert joined to the routed output in one pass (`add_gated_shared_`):
where it applies, and the join. OverlapMoELayer's `shared_experts_compute` runs the
shared expert ungated and its `postprocess` calls `join` with the gate's logits."""

from __future__ import annotations

from itertools import chain

import torch

from ..ops import add_gated_shared_, interpreting
from .experts import in_inference

#: the steps one forward call must run together: the ungated output waits on the layer
#: between them, so steps that other calls may interleave cannot hold it
_ONE_CALL = {"route", "expert_compute", "postprocess"}
#: Megatron's `cuda_graph_impl` values under which an inference forward may join
_JOINING_GRAPHS = ("none", "transformer_engine")


def gate_joins(layer, hidden_states) -> bool:
    """Does `layer` join its gated shared expert in one pass this call? Where the overlap
    may run, in inference (`in_inference`), on CUDA or under the interpreter, with
    Megatron's plain shared expert (not its own overlap), and in one forward call. Under
    Megatron's "local" or full-iteration CUDA graphs it does not (their captures may hold
    the shared expert, gated); TE's per-layer graphs replay only in training (Megatron's
    `_should_call_te_cudagraph`), where no join runs, so a TE-graph model still joins in
    eval."""
    steps = getattr(layer, "fwd_execution_map", ())  # a list, or one step's name
    if not (layer.overlap_enabled and layer.unsupported_reason is None
            and layer.use_shared_expert and not layer.shared_expert_overlap
            and not layer.shared_experts_recompute
            and getattr(layer.shared_experts, "use_shared_expert_gate", False)
            and getattr(layer.config, "cuda_graph_impl", "none") in _JOINING_GRAPHS
            and not isinstance(steps, str) and _ONE_CALL <= set(steps)):
        return False
    return (in_inference(layer, chain((hidden_states,), layer.shared_experts.parameters()))
            and (hidden_states.is_cuda or interpreting()))


def join(output, ungated, logits, routed_by_op: bool):
    """output + ungated * sigmoid(logits): in place in one pass where `output` is the fused
    op's fresh tensor (`routed_by_op`), else Megatron's multiply and add (its bits)."""
    if (routed_by_op and output.dtype == ungated.dtype and output.is_contiguous()
            and ungated.is_contiguous()):
        return add_gated_shared_(output, ungated, logits)
    return output + ungated * torch.sigmoid(logits)
