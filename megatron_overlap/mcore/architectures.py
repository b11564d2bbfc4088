"""What the published architectures need beyond Megatron-Core 0.19's GPTModel and specs.

ScaledGPTModel: Granite's three scalars. GraniteMoe scales the token embeddings by
`embedding_multiplier` (12), each sublayer's output by `residual_multiplier` (0.22) before
its residual add, and divides the logits by `logits_scaling` (6). Megatron's nearest
switches are MuP's (`use_mup`, `mup_embedding_mult`, `mup_output_mult`), which also change
initialization and learning rates and have no residual multiplier, so they stay off; the
scalars are forward hooks on the embedding, on every layer's attention and MLP (their
output and bias, which the bias-dropout-add then adds to the residual), and on the output
layer (before the loss, as in transformers).

with_latent_kv_norm: DeepSeek-V2-Lite's RMSNorm on the KV latent (kv_a_layernorm, the
`kv_lora_rank`-wide part of the KV down-projection). With `q_lora_rank` null Megatron-Core
places it only through TE's fused norm + linear, and only under `qk_layernorm`, which then
also fuses a norm into `linear_q_proj` that DeepSeek-V2-Lite does not have (MLA's
QKNormConfigResolver). So the builders keep `qk_layernorm` off and give
`linear_kv_up_proj` its input norm instead: a subclass of whatever linear the spec holds
(Megatron's ColumnParallelLinear locally, TEColumnParallelLinear under TE) that
RMS-normalizes its input first. Its weight is `linear_kv_up_proj.layer_norm_weight`, the
name TE's fused module gives the same weight.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec


def _scale_output(factor: float, divide: bool = False):
    """Forward hook: the module's output (a tensor or an (output, bias) tuple) scaled."""
    def scale(t):
        if t is None:
            return None
        return t / factor if divide else t * factor

    def hook(module, args, output):
        if isinstance(output, tuple):
            return tuple(scale(t) if isinstance(t, torch.Tensor) else t for t in output)
        return scale(output)
    return hook


class ScaledGPTModel(GPTModel):
    """GPTModel with GraniteMoe's scalars (1.0 = not applied; see the module docstring).

    embedding_multiplier: embeddings x it. residual_multiplier: each attention and MLP
    output (and bias) x it before the residual add. logits_scaling: logits / it.
    Other arguments: GPTModel's.
    """

    def __init__(self, *args, embedding_multiplier: float = 1.0,
                 residual_multiplier: float = 1.0, logits_scaling: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        for name, v in (("embedding_multiplier", embedding_multiplier),
                        ("residual_multiplier", residual_multiplier),
                        ("logits_scaling", logits_scaling)):
            if not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        self.embedding_multiplier = embedding_multiplier
        self.residual_multiplier = residual_multiplier
        self.logits_scaling = logits_scaling
        if self.pre_process and embedding_multiplier != 1.0:
            self.embedding.register_forward_hook(_scale_output(embedding_multiplier))
        if residual_multiplier != 1.0:
            for layer in self.decoder.layers:
                layer.self_attention.register_forward_hook(_scale_output(residual_multiplier))
                layer.mlp.register_forward_hook(_scale_output(residual_multiplier))
        if self.post_process and logits_scaling != 1.0:
            self.output_layer.register_forward_hook(_scale_output(logits_scaling, divide=True))


@functools.cache
def input_rms_norm(linear_cls: type) -> type:
    """`linear_cls` (a Megatron or TE column-parallel linear) with an RMSNorm on its input:
    weight `layer_norm_weight` [input_size] (ones at init), eps config.layernorm_epsilon,
    computed in fp32 as transformers' DeepSeek RMSNorm does. Cached: one class per base."""

    class InputRMSNormLinear(linear_cls):
        def __init__(self, input_size, output_size, *args, config, **kwargs):
            super().__init__(input_size, output_size, *args, config=config, **kwargs)
            device = None if config.use_cpu_initialization else torch.cuda.current_device()
            self.layer_norm_weight = torch.nn.Parameter(
                torch.ones(input_size, dtype=config.params_dtype, device=device))
            # replicated over TP; with sequence parallelism each rank norms its own tokens,
            # so the gradient is all-reduced over TP like the other norms'
            self.layer_norm_weight.sequence_parallel = config.sequence_parallel
            self.layer_norm_eps = config.layernorm_epsilon

        def forward(self, input_, *args, **kwargs):
            x = input_.float()  # [s, b, kv_lora_rank]
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.layer_norm_eps)
            x = self.layer_norm_weight * x.to(input_.dtype)
            return super().forward(x, *args, **kwargs)

    name = f"InputRMSNorm{linear_cls.__name__}"
    InputRMSNormLinear.__name__ = InputRMSNormLinear.__qualname__ = name
    return InputRMSNormLinear


def with_latent_kv_norm(block):
    """A copy of a GPT block spec whose MLA layers normalize the KV latent in
    `linear_kv_up_proj` (see the module docstring). Needs `qk_layernorm` off (Megatron
    then leaves kv_layernorm an identity and takes linear_kv_up_proj from the spec)."""
    def layer(spec):
        attn = spec.submodules.self_attention
        sub = attn.submodules
        if not hasattr(sub, "linear_kv_up_proj"):  # not MLA
            return spec
        base = sub.linear_kv_up_proj
        if isinstance(base, ModuleSpec):
            base = dataclasses.replace(base, module=input_rms_norm(base.module))
        else:
            base = input_rms_norm(base)
        sub = dataclasses.replace(sub, linear_kv_up_proj=base)
        attn = dataclasses.replace(attn, submodules=sub)
        return dataclasses.replace(spec, submodules=dataclasses.replace(
            spec.submodules, self_attention=attn))

    return dataclasses.replace(block, layer_specs=[layer(s) for s in block.layer_specs])


def with_latent_kv_norm_where_needed(config, block):
    """`with_latent_kv_norm(block)` for MLA without a query LoRA and without qk_layernorm
    (DeepSeek-V2-Lite's layout), else `block` unchanged: the one rule the builders, the
    checkpoint loader and Megatron-LM's `--spec moe_overlap_gpt_spec` share."""
    if (getattr(config, "multi_latent_attention", False)
            and getattr(config, "q_lora_rank", None) is None
            and not getattr(config, "qk_layernorm", False)):
        return with_latent_kv_norm(block)
    return block


__all__ = ["ScaledGPTModel", "input_rms_norm", "with_latent_kv_norm",
           "with_latent_kv_norm_where_needed"]
