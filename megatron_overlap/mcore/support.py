"""What an MoE layer can fuse, decided when it is built: `unsupported_reason(layer)` is
None where the fused path runs, else the reason the layer stays stock (the build line
and `--moe-overlap-strict` report it). Nothing here waits for a forward."""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from .dispatch import OverlapAllGatherDispatcher
from .fc2_operands import unsupported_experts


def unsupported_reason(layer) -> str | None:
    """Why `layer` (an MoELayer with its OverlapConfig) cannot run the fused path here,
    or None: another dispatcher, the inference dispatcher, fp8 / fp4, experts
    `unsupported_experts` refuses, latent MoE, a dispatch backward overlapped with the
    experts' wgrad, or rows the Triton kernels cannot read."""
    c = layer.config
    # (OverlapAllGatherDispatcher: a layer adopted again)
    if type(layer.token_dispatcher) not in (MoEAllGatherTokenDispatcher,
                                            OverlapAllGatherDispatcher):
        name = type(layer.token_dispatcher).__name__
        return f"the {name} dispatcher (only allgather is fused)"
    if hasattr(layer, "_inference_token_dispatcher"):
        return "transformer_impl='inference_optimized' (its own dispatcher)"
    if c.fp8 or c.fp4:  # (TE's quantized GEMMs: the op's GEMM2 is bf16/fp16/fp32)
        return "fp8/fp4 experts (the fused GEMM2 runs bf16, fp16 or fp32)"
    if (why := unsupported_experts(layer.experts)) is not None:
        return why
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
    dtype = torch.bfloat16 if c.bf16 else torch.float16 if c.fp16 else c.params_dtype
    if ffn * dtype.itemsize % 16:
        return (f"an expert FFN width of {ffn} per rank in {str(dtype).removeprefix('torch.')} "
                f"({ffn * dtype.itemsize} B a row; the fused GEMM2 reads 16-byte multiples)")
    return None
