"""Two local (non-TE) modules the builders' specs need from Megatron-Core 0.19.

SDPAttention: core attention through torch's scaled_dot_product_attention. The local
`DotProductAttention` materializes the [b, heads, S, S] scores (tens of GB at S = 16k
prefill) and cannot serve multi-latent attention at all (MLA passes `k_channels` /
`v_channels` it does not accept, and its V head differs from Q/K). This
module is a drop-in `core_attention` with the same constructor and forward contract that
calls `F.scaled_dot_product_attention` (flash / memory-efficient kernels on CUDA, the
math kernel on CPU). It changes no weights and no MoE work: the stock and overlapped
models both use it.

SequenceParallelNorm: the local spec's RMSNorm / LayerNorm is `WrappedTorchNorm`, which
refuses sequence parallelism (its weight gradients would miss the TP all-reduce), and
Megatron needs sequence parallelism for MoE with TP. This builder makes the same torch
norm and marks its parameters `sequence_parallel`, the attribute Megatron's gradient
finalization all-reduces over TP (as its fused norms do).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class SDPAttention(MegatronModule):
    """query [sq, b, np, hk], key [sk, b, ng, hk], value [sk, b, ng, hv] -> [sq, b, np * hv].

    np query heads per TP rank, ng key/value groups (GQA: np % ng == 0). Causal masking
    comes from `attn_mask_type` when no mask is given; a given boolean mask follows
    Megatron's convention (True = masked out). softmax_scale: None = 1/sqrt(hk).
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection=None, k_channels: int | None = None, v_channels: int | None = None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism")
        if config.apply_query_key_layer_scaling or config.softmax_type != "vanilla":
            raise ValueError("SDPAttention supports the vanilla softmax without query-key "
                             "layer scaling")
        if config.window_size is not None:
            raise ValueError("SDPAttention does not support sliding-window attention")
        self.attn_mask_type = attn_mask_type
        self.k_channels = k_channels or config.kv_channels
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(self.k_channels)
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **unused):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention takes no packed sequences and no attention bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        sq, b, heads, _ = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        if k.shape[1] != heads:  # GQA: each key/value group serves heads / ng query heads
            k = k.repeat_interleave(heads // k.shape[1], dim=1)
            v = v.repeat_interleave(heads // v.shape[1], dim=1)
        mask = None if attention_mask is None else ~attention_mask.bool()
        causal = mask is None and mask_type == AttnMaskType.causal
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal, scale=self.softmax_scale)  # [b, heads, sq, hv]
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * v.shape[-1])


def SequenceParallelNorm(config, hidden_size: int, eps: float = 1e-5, **unused):
    """torch RMSNorm / LayerNorm per config.normalization, on the model's device and dtype,
    usable with sequence parallelism (a LayerNormBuilder, like WrappedTorchNorm)."""
    if config.normalization not in ("RMSNorm", "LayerNorm"):
        raise ValueError("SequenceParallelNorm supports RMSNorm and LayerNorm, got "
                         f"{config.normalization}")
    cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
    device = None if config.use_cpu_initialization else torch.cuda.current_device()
    norm = cls(hidden_size, eps=eps, device=device, dtype=config.params_dtype)
    for p in norm.parameters():
        p.sequence_parallel = config.sequence_parallel
    return norm
