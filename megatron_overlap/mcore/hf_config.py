"""Hugging Face config.json -> the Megatron TransformerConfig and model card of the three
paper models (GraniteMoe, Qwen2-MoE, DeepSeek-V2): `hf_model_config`. The semantics
mapped, field by field, are `_granite`, `_qwen`, `_deepseek`; a feature Megatron or the
loader (`hf.py`) does not reproduce exactly is a ValueError naming its field.
"""

from __future__ import annotations

import json
import os

import torch

from .models import CONFIGS, IMPLS, ModelCard

#: config.json model_type -> (models.py name, transformers' config class name)
ARCHITECTURES = {"granitemoe": ("granite", "GraniteMoeConfig"),
                 "qwen2_moe": ("qwen", "Qwen2MoeConfig"),
                 "deepseek_v2": ("deepseek", "DeepseekV2Config")}


def read_hf_config(path: str):
    """transformers' config object of a local model folder (config.json; no download)."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path!r} has no config.json (a local Hugging Face model folder)")
    with open(file) as f:
        model_type = json.load(f).get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"config.json model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    import transformers

    cls = getattr(transformers, ARCHITECTURES[model_type][1])
    return cls.from_pretrained(path, local_files_only=True)


def _unsupported(field: str, value, why: str):
    raise ValueError(f"config.json {field}={value!r}: {why}")


def _rope(hf) -> tuple[float, dict]:
    """(rope_theta, scaling parameters with 'rope_type') from transformers 5's
    rope_parameters or 4's rope_theta / rope_scaling."""
    params = getattr(hf, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params["rope_theta"] = hf.rope_theta
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        _unsupported("partial_rotary_factor", params["partial_rotary_factor"],
                     "partial rotary embeddings are not mapped")
    return float(params["rope_theta"]), params


def _plain_rope(hf) -> float:
    theta, params = _rope(hf)
    if params["rope_type"] != "default":
        _unsupported("rope_scaling", params, "only unscaled RoPE is mapped for this architecture")
    return theta


def _common_checks(hf):
    if getattr(hf, "hidden_act", "silu") != "silu":
        _unsupported("hidden_act", hf.hidden_act, "the experts are SwiGLU (silu) only")
    heads_dim = getattr(hf, "head_dim", None)
    return {} if heads_dim in (None, hf.hidden_size // hf.num_attention_heads) else \
        {"kv_channels": heads_dim}


def _granite(hf, num_layers: int) -> tuple[dict, ModelCard]:
    """GraniteMoe: softmax over the top-k logits (Megatron's pre_softmax off), attention
    scale attention_multiplier (not 1/sqrt(d)), the three scalars in the card."""
    if getattr(hf, "attention_bias", False):
        _unsupported("attention_bias", True, "Megatron's QKV bias is mapped for Qwen only")
    cfg = dict(_common_checks(hf), hidden_size=hf.hidden_size,
               num_attention_heads=hf.num_attention_heads,
               num_query_groups=hf.num_key_value_heads, ffn_hidden_size=hf.intermediate_size,
               moe_ffn_hidden_size=hf.intermediate_size, num_moe_experts=hf.num_local_experts,
               moe_router_topk=hf.num_experts_per_tok, moe_router_pre_softmax=False,
               layernorm_epsilon=hf.rms_norm_eps, softmax_scale=float(hf.attention_multiplier))
    card = ModelCard(hf.vocab_size, hf.max_position_embeddings, _plain_rope(hf),
                     bool(hf.tie_word_embeddings),
                     embedding_multiplier=float(hf.embedding_multiplier),
                     residual_multiplier=float(hf.residual_multiplier),
                     logits_scaling=float(hf.logits_scaling))
    return cfg, card


def _qwen(hf, num_layers: int) -> tuple[dict, ModelCard]:
    """Qwen2-MoE: softmax over all experts then top-k (pre_softmax); norm_topk_prob
    renormalizes the top-k, which equals Megatron's softmax over the top-k logits
    (pre_softmax off); shared expert with a sigmoid gate; QKV bias (qkv_bias)."""
    if getattr(hf, "use_sliding_window", False):
        _unsupported("use_sliding_window", True, "sliding-window attention is not mapped")
    dense = set(getattr(hf, "mlp_only_layers", None) or [])
    step = getattr(hf, "decoder_sparse_step", 1)
    freq = [0 if (i in dense or (i + 1) % step) else 1 for i in range(num_layers)]
    shared = getattr(hf, "shared_expert_intermediate_size", 0) or None
    cfg = dict(_common_checks(hf), hidden_size=hf.hidden_size,
               num_attention_heads=hf.num_attention_heads,
               num_query_groups=hf.num_key_value_heads, ffn_hidden_size=hf.intermediate_size,
               moe_ffn_hidden_size=hf.moe_intermediate_size, num_moe_experts=hf.num_experts,
               moe_router_topk=hf.num_experts_per_tok,
               moe_router_pre_softmax=not hf.norm_topk_prob,
               moe_shared_expert_intermediate_size=shared,
               moe_shared_expert_gate=shared is not None,
               add_qkv_bias=bool(getattr(hf, "qkv_bias", True)),
               layernorm_epsilon=hf.rms_norm_eps, moe_layer_freq=freq,
               moe_aux_loss_coeff=float(getattr(hf, "router_aux_loss_coef", 0.0)))
    card = ModelCard(hf.vocab_size, hf.max_position_embeddings, _plain_rope(hf),
                     bool(hf.tie_word_embeddings))
    return cfg, card


def _deepseek(hf, num_layers: int) -> tuple[dict, ModelCard]:
    """DeepSeek-V2: MLA without a query LoRA, softmax then greedy top-k without
    renormalization, x routed_scaling_factor; dense layers before first_k_dense_replace;
    YaRN RoPE (Megatron's YarnRotaryEmbedding: same ramp, cos/sin x mscale ratio, softmax
    scale x mscale_all_dim's mscale squared, as transformers' yarn_apply_mscale)."""
    if hf.q_lora_rank is not None:
        _unsupported("q_lora_rank", hf.q_lora_rank, "the query LoRA (DeepSeek-V2, not -Lite) "
                     "is not mapped")
    if getattr(hf, "topk_method", "greedy") != "greedy" and (hf.n_group or 1) > 1:
        _unsupported("topk_method", hf.topk_method, "group-limited routing takes each group's "
                     "max in DeepSeek-V2 and a top-k sum in Megatron")
    if getattr(hf, "norm_topk_prob", False):
        _unsupported("norm_topk_prob", True, "transformers' DeepseekV2 ignores it and "
                     "DeepSeek's own code renormalizes: ambiguous")
    if getattr(hf, "scoring_func", "softmax") != "softmax":
        _unsupported("scoring_func", hf.scoring_func, "only softmax routing is mapped")
    if getattr(hf, "attention_bias", False):
        _unsupported("attention_bias", True, "MLA projections take no bias in Megatron")
    if getattr(hf, "moe_layer_freq", 1) != 1:
        _unsupported("moe_layer_freq", hf.moe_layer_freq, "transformers' DeepseekV2 ignores it")
    theta, rope = _rope(hf)
    if rope["rope_type"] == "yarn":
        rope_cfg = dict(rope_type="yarn", rotary_scaling_factor=float(rope["factor"]),
                        original_max_position_embeddings=int(
                            rope["original_max_position_embeddings"]),
                        beta_fast=float(rope.get("beta_fast") or 32),
                        beta_slow=float(rope.get("beta_slow") or 1),
                        mscale=float(rope.get("mscale") or 1.0),
                        mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0))
        if rope.get("attention_factor") is not None or rope.get("truncate", True) is not True:
            _unsupported("rope_scaling", rope, "yarn attention_factor / truncate are not mapped")
        if not (rope.get("mscale") and rope.get("mscale_all_dim")):
            _unsupported("rope_scaling", rope, "yarn needs mscale and mscale_all_dim here "
                         "(transformers' fallback mscale differs from Megatron's)")
    elif rope["rope_type"] == "default":
        rope_cfg = dict(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0,
                        mscale_all_dim=0.0)
    else:
        _unsupported("rope_scaling", rope, "only yarn or unscaled RoPE is mapped")
    shared = hf.moe_intermediate_size * (hf.n_shared_experts or 0) or None
    freq = [0 if i < hf.first_k_dense_replace else 1 for i in range(num_layers)]
    scaling = float(hf.routed_scaling_factor)
    cfg = dict(hidden_size=hf.hidden_size, num_attention_heads=hf.num_attention_heads,
               num_query_groups=hf.num_attention_heads, ffn_hidden_size=hf.intermediate_size,
               moe_ffn_hidden_size=hf.moe_intermediate_size, num_moe_experts=hf.n_routed_experts,
               moe_router_topk=hf.num_experts_per_tok, moe_router_pre_softmax=True,
               moe_router_topk_scaling_factor=None if scaling == 1.0 else scaling,
               moe_shared_expert_intermediate_size=shared, moe_layer_freq=freq,
               layernorm_epsilon=hf.rms_norm_eps, q_lora_rank=None, kv_lora_rank=hf.kv_lora_rank,
               qk_head_dim=hf.qk_nope_head_dim, qk_pos_emb_head_dim=hf.qk_rope_head_dim,
               v_head_dim=hf.v_head_dim, qk_layernorm=False, rotary_base=theta, **rope_cfg)
    if getattr(hf, "hidden_act", "silu") != "silu":
        _unsupported("hidden_act", hf.hidden_act, "the experts are SwiGLU (silu) only")
    card = ModelCard(hf.vocab_size, hf.max_position_embeddings, theta, bool(hf.tie_word_embeddings))
    return cfg, card


_MAPPERS = {"granite": _granite, "qwen": _qwen, "deepseek": _deepseek}


def hf_model_config(hf, tp: int = 1, ep: int = 1, num_layers: int | None = None, *,
                    impl: str = "local", dtype: torch.dtype | None = None, **overrides):
    """(name, TransformerConfig, ModelCard) for transformers config `hf` on TP x EP:
    the models.py builder of its architecture with config.json's numbers.
    overrides: further TransformerConfig fields."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    name = ARCHITECTURES[hf.model_type][0]
    depth = hf.num_hidden_layers if num_layers is None else num_layers
    if not 1 <= depth <= hf.num_hidden_layers:
        raise ValueError(f"num_layers must be in 1..{hf.num_hidden_layers} (config.json "
                         f"num_hidden_layers), got {num_layers}")
    cfg, card = _MAPPERS[name](hf, depth)
    if dtype is not None:
        cfg.update(params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    cfg.update(perform_initialization=False)  # every weight comes from the checkpoint
    cfg.update(overrides)
    config, _ = CONFIGS[name](tp, ep, depth, impl=impl, **cfg)
    if config.num_moe_experts % ep:
        raise ValueError(f"EP={ep} does not divide the {config.num_moe_experts} experts")
    return name, config, card
