"""What an MoE layer can fuse, decided when it is built: `unsupported_reason(layer)` is
None where the fused path runs, else the reason the layer stays stock (the build line
and `--moe-overlap-strict` report it); the session it launches on, its kernels compiled
(`warmed`); what a call can be captured with (`capture_refusal`) and what the stock
experts launch beyond the fused path (`stock_launches`, the fuse-or-not's n)."""

from __future__ import annotations

from itertools import chain

import torch
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from ..ops import OverlapSession
from .dispatch import OverlapAllGatherDispatcher, rows_bound
from .experts import in_inference, te_fc1_is_grouped
from .fc2_operands import unsupported_experts
from .te_fp8 import recipe_kind


def unsupported_reason(layer) -> str | None:
    """Why `layer` (an MoELayer with its OverlapConfig) cannot run the fused path here,
    or None: another dispatcher, the inference dispatcher, fp8 / fp4 outside TE's Hopper
    recipes over TEGroupedMLP (`te_fp8.fp8_refusal`), experts `unsupported_experts` refuses, latent MoE, a dispatch backward overlapped with the
    experts' wgrad, or rows the Triton kernels cannot read."""
    c = layer.config
    # (OverlapAllGatherDispatcher: a layer adopted again)
    if type(layer.token_dispatcher) not in (MoEAllGatherTokenDispatcher,
                                            OverlapAllGatherDispatcher):
        name = type(layer.token_dispatcher).__name__
        return f"the {name} dispatcher (only allgather is fused)"
    if hasattr(layer, "_inference_token_dispatcher"):
        return "transformer_impl='inference_optimized' (its own dispatcher)"
    if (c.fp8 or c.fp4) and not isinstance(layer.experts, TEGroupedMLP):
        return (f"fp8/fp4 {type(layer.experts).__name__} experts (FP8 fuses TEGroupedMLP "
                f"under TE's recipes)")
    if (why := unsupported_experts(layer.experts)) is not None:  # (FP8: te_fp8.fp8_refusal)
        return why
    if (c.fp8 or c.fp4) and not layer.policy.fp8:
        return ("FP8 experts without --moe-overlap-fp8 (LayerPolicy(fp8=True)): the fused "
                "FP8 layer is opt-in (measured at parity with core-TE FP8)")
    if recipe_kind(c) == "block" and not layer.policy.fp8_blockwise:
        return ("--fp8-recipe blockwise without --moe-overlap-fp8-blockwise: the fused "
                "blockwise layer measured 0.64x-0.85x core-TE FP8's forward on one H100 "
                "(its block-scaled GEMM2 runs at half bf16's rate)")
    if c.moe_latent_size:
        return "latent MoE projections"
    if c.overlap_dispatch_backward_with_experts_wgrad:
        return "overlap_dispatch_backward_with_experts_wgrad"
    if layer.overlap_config.backend == "reference":
        return None
    return row_bytes_refusal(c)


def row_bytes_refusal(c) -> str | None:
    """The Triton backends read FC2's input [rows, K] by tensor descriptors, whose rows
    must be 16-byte multiples; K = the expert FFN width on this rank, in the dtype the
    layer computes in (Megatron's --bf16 / --fp16, else params_dtype)."""
    ffn = (c.moe_ffn_hidden_size or c.ffn_hidden_size) // (c.expert_tensor_parallel_size or 1)
    dtype = torch.float8_e4m3fn if c.fp8 else layer_dtype(c)
    if ffn * dtype.itemsize % 16:
        return (f"an expert FFN width of {ffn} per rank in {str(dtype).removeprefix('torch.')} "
                f"({ffn * dtype.itemsize} B a row; the fused GEMM2 reads 16-byte multiples)")
    return None


def layer_dtype(c) -> torch.dtype:
    """The dtype the layer computes in (Megatron's --bf16 / --fp16, else params_dtype)."""
    return torch.bfloat16 if c.bf16 else torch.float16 if c.fp16 else c.params_dtype


def warmed(layer, session: OverlapSession) -> OverlapSession:
    """`session` with the Triton kernels `layer` launches compiled (at build, not in its
    first forward's planning), in the dtype it computes in (FP8: its recipe's kernels);
    y token-major where every expert is local. Nothing compiles off CUDA."""
    c = layer.config
    if session.device.type == "cuda" and layer.overlap_config.backend in ("auto", "triton"):
        kinds = [recipe_kind(c)]
        grouped = getattr(layer, "_grouped", None)
        if kinds[0] == "block" and grouped is not None and grouped.inference_refusal is None:
            kinds.append(None)  # (blockwise inference runs the bf16 kernels)
        for kind in kinds:
            session.warm_up(c.hidden_size, c.moe_router_topk, layer_dtype(c),
                            config=layer.overlap_config, fp8=kind,
                            token_major=layer.num_local_experts == c.num_moe_experts)
    return session


#: TE's launches per expert and quantized input: current scaling an amax and a cast,
#: blockwise one kernel
TE_QUANTIZE_LAUNCHES = {"tensor": 2, "block": 1}


def stock_launches(layer, grouped_fp8: bool = False) -> int:
    """Kernel launches the stock experts make per call beyond the fused path's: TE's
    GroupedLinear runs one GEMM per local expert in FC2, and in FC1 where the fused
    path groups it (`te_fc1_is_grouped`, or the grouped FP8 experts: `grouped_fp8`),
    and under FP8 on the grouped path it also quantizes FC1's and FC2's inputs one expert
    at a time, where that path quantizes all experts in two launches each; a grouped
    GEMM runs one."""
    if not isinstance(layer.experts, TEGroupedMLP):
        return 0
    if grouped_fp8:
        quantize = TE_QUANTIZE_LAUNCHES[recipe_kind(layer.config)]
        return layer.num_local_experts * (2 + 2 * quantize)
    return layer.num_local_experts * (2 if te_fc1_is_grouped(layer.experts) else 1)


def capture_refusal(layer, hidden_states, host_counts: bool) -> str | None:
    """Why this call of `layer`, captured into a CUDA graph, could not replay the routing
    of each replay (None: it can). It can where nothing reaches the host: inference, and
    the counts kept on the device (every expert local or the rows padded, grouped
    experts, no capacity factor; `moe_permute_fusion` does not matter, the fused path
    never takes TE's permute)."""
    c = layer.config
    if not in_inference(layer, chain((hidden_states,), layer.parameters())):
        return "gradients (capture the forward in eval mode under torch.no_grad)"
    if layer.num_local_experts != c.num_moe_experts and rows_bound(
            hidden_states.shape[0], c.moe_router_topk, layer.num_local_experts,
            c.num_moe_experts) is None:
        return ("expert parallelism with a loose bound of the rows (top-k x EP > "
                "MAX_PADDING x top-k: the rows are counted on the host)")
    if c.moe_expert_capacity_factor:
        return "a capacity factor (the rows are split on the host)"
    if host_counts:
        return f"{type(layer.experts).__name__} experts (they split the rows on the host)"
    if layer.policy.host_counts:
        return "LayerPolicy.host_counts"
    return None
