"""Hugging Face checkpoints -> Megatron-Core GPTModels of the three paper models.

    model = load_hf_checkpoint("/models/Qwen1.5-MoE-A2.7B", tp=2, ep=1,
                               overlap=OverlapConfig(backend="triton"))
    logits = model(tokens, positions, None)[..., :model.hf_vocab_size]

A local folder (config.json + *.safetensors, one file or sharded with
model.safetensors.index.json; nothing is downloaded) of GraniteMoeForCausalLM,
Qwen2MoeForCausalLM or DeepseekV2ForCausalLM becomes the GPTModel `build_model` builds for
that architecture (models.py: same specs, dispatcher, experts and overlap), with the
widths of its config.json and this rank's TP x EP slice of its weights. Megatron parallel
state must be initialized first, as for any Megatron-Core model.

Megatron's layouts the weights take (shapes per rank; tp = TP size, H hidden, F expert FFN):
- QKV: one `linear_qkv` [(nh + 2 ng) d / tp, H], rows interleaved per query group
  [q heads of group g; k_g; v_g] (the bias likewise), TP splitting whole groups.
- gated FC1 ([gate; up], Megatron's stride-2 column parallelism): every rank holds
  [gate_shard; up_shard]: `linear_fc1` [2F/tp, H], GroupedGemmExperts' fc1_weight
  [E_local, 2F/tp, H]; FC2 is row-parallel ([H, F/tp]).
- experts: EP rank r holds global experts r E_local .. (r + 1) E_local - 1.
- embeddings / output layer: vocab padded with zero rows to a multiple of 128 tp, split
  by rows (logits past `hf_vocab_size` are padding).
- MLA: linear_q_proj = q_proj, linear_kv_down_proj = kv_a_proj_with_mqa ([latent; rope]),
  linear_kv_up_proj = kv_b_proj with kv_a_layernorm as its input norm
  (architectures.with_latent_kv_norm).
Semantics mapped (config.json field -> Megatron): `_granite`, `_qwen`, `_deepseek` below;
a feature Megatron or this loader does not reproduce exactly is a ValueError naming its
field.
"""

from __future__ import annotations

import json
import os
import re

import torch

from ..ops import OverlapConfig
from .models import CONFIGS, IMPLS, ModelCard, gpt_model, model_spec
from .policy import LayerPolicy

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


class _Safetensors:
    """Tensors of a folder's *.safetensors by name (sharded through the index or not)."""

    def __init__(self, path: str):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self.files = {k: os.path.join(path, v) for k, v in weight_map.items()}
        else:
            from safetensors import safe_open

            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"{path!r} has no *.safetensors files")
            self.files = {}
            for file in files:
                with safe_open(os.path.join(path, file), framework="pt") as f:
                    self.files.update(dict.fromkeys(f.keys(), os.path.join(path, file)))
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str, index: int | None = None) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.files:
            raise KeyError(f"the checkpoint has no tensor {name!r}")
        self.used.add(name)
        with safe_open(self.files[name], framework="pt") as f:
            return f.get_tensor(name) if index is None else f.get_slice(name)[index]


def _expert(st: _Safetensors, name: str, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e of a layer: ([gate; up] [2F, H], down [H, F])."""
    if name == "granite":
        p = f"model.layers.{layer}.block_sparse_moe."
        return st.get(p + "input_linear.weight", e), st.get(p + "output_linear.weight", e)
    p = f"model.layers.{layer}.mlp.experts."
    if p + "gate_up_proj" in st:  # transformers 5's in-memory layout, if saved as such
        return st.get(p + "gate_up_proj", e), st.get(p + "down_proj", e)
    p += f"{e}."
    return (torch.cat([st.get(p + "gate_proj.weight"), st.get(p + "up_proj.weight")]),
            st.get(p + "down_proj.weight"))


def _mlp(st: _Safetensors, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.cat([st.get(prefix + "gate_proj.weight"), st.get(prefix + "up_proj.weight")]),
            st.get(prefix + "down_proj.weight"))


def _qkv(st: _Safetensors, prefix: str, suffix: str, groups: int) -> torch.Tensor:
    """[q; k; v] rows regrouped per query group: [q_g; k_g; v_g] for g = 0..ng-1."""
    q, k, v = (st.get(f"{prefix}{x}_proj.{suffix}") for x in "qkv")
    q, k, v = (t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v))
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def _full_tensor(st, name, arch, param, config, experts_first: int) -> torch.Tensor:
    """The unsharded HF tensor behind Megatron parameter `name` (this rank's experts)."""
    if name == "embedding.word_embeddings.weight":
        return _pad_rows(st.get("model.embed_tokens.weight"), param.shape[0] * _tp_size(param))
    if name == "output_layer.weight":
        return _pad_rows(st.get("lm_head.weight"), param.shape[0] * _tp_size(param))
    if name == "decoder.final_layernorm.weight":
        return st.get("model.norm.weight")
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if m is None:
        raise KeyError(name)
    i, rest = int(m.group(1)), m.group(2)
    hf = f"model.layers.{i}."
    moe = "block_sparse_moe." if arch == "granite" else "mlp."
    norms = {"input_layernorm.weight": "input_layernorm.weight",
             "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
             "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
             "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
             "self_attention.linear_kv_up_proj.layer_norm_weight":
                 "self_attn.kv_a_layernorm.weight"}
    if rest in norms:
        return st.get(hf + norms[rest])
    attn = {"self_attention.linear_proj.weight": "self_attn.o_proj.weight",
            "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
            "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
            "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
            "mlp.router.weight":
                moe + ("router.layer.weight" if arch == "granite" else "gate.weight"),
            "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight"}
    if rest in attn:
        return st.get(hf + attn[rest])
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        return _qkv(st, hf + "self_attn.", rest.rsplit(".", 1)[1], config.num_query_groups)
    if rest.startswith(("mlp.linear_fc", "mlp.shared_experts.linear_fc")):
        shared = {"qwen": "mlp.shared_expert.", "deepseek": "mlp.shared_experts."}
        fc1, fc2 = _mlp(st, hf + (shared[arch] if "shared" in rest else "mlp."))
        return fc1 if "linear_fc1" in rest else fc2
    if rest in ("mlp.experts.fc1_weight", "mlp.experts.fc2_weight"):  # GroupedGemmExperts
        local = range(experts_first, experts_first + param.shape[0])  # [E_local, ...]
        pairs = [_expert(st, arch, i, e) for e in local]
        return torch.stack([p[0] if "fc1" in rest else p[1] for p in pairs])
    m = (re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight", rest)
         or re.fullmatch(r"mlp\.experts\.linear_fc([12])\.weight(\d+)", rest))
    if m is not None:  # SequentialMLP / TEGroupedMLP
        j, fc = ((int(m.group(1)), m.group(2)) if "local_experts" in rest
                 else (int(m.group(2)), m.group(1)))
        return _expert(st, arch, i, experts_first + j)[int(fc) - 1]
    raise KeyError(name)


def _is_expert(param) -> bool:
    return getattr(param, "allreduce", True) is False


def _tp_size(param) -> int:
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        return 1
    return (ps.get_expert_tensor_parallel_world_size() if _is_expert(param)
            else ps.get_tensor_model_parallel_world_size())


def _shard(full: torch.Tensor, param, gated_fc1: bool = False) -> torch.Tensor:
    """This rank's slice of `full` by Megatron's partition attributes. Gated FC1 ([gate;
    up], stride 2 in Megatron's attributes, whatever a TE module records): each rank
    takes its shard of both halves."""
    from megatron.core import parallel_state as ps

    tp = _tp_size(param)
    if tp == 1:
        return full
    rank = (ps.get_expert_tensor_parallel_rank() if _is_expert(param)
            else ps.get_tensor_model_parallel_rank())
    dim = param.partition_dim
    stride = 2 if gated_fc1 else getattr(param, "partition_stride", 1)
    return torch.cat([part.chunk(tp, dim)[rank] for part in full.chunk(stride, dim)], dim)


def load_hf_weights(model, path: str, arch: str) -> None:
    """Copy a Hugging Face folder's weights into `model` (built for its config on this
    rank's TP x EP slice). Every parameter must be found, and every checkpoint tensor of
    the model's layers used (else ValueError: a feature the mapping would drop)."""
    from megatron.core import parallel_state as ps

    st = _Safetensors(path)
    config = model.config
    per_rank = config.num_moe_experts // ps.get_expert_model_parallel_world_size()
    first = ps.get_expert_model_parallel_rank() * per_rank
    with torch.no_grad():
        for name, param in model.named_parameters():
            try:
                full = _full_tensor(st, name, arch, param, config, first)
            except KeyError as e:
                raise ValueError(f"no checkpoint tensor for Megatron parameter {name} "
                                 f"({e.args[0]})") from None
            gated = bool(config.gated_linear_unit
                         and re.search(r"(linear_fc1\.weight|fc1_weight)", name))
            local = _shard(full, param, gated)
            if local.shape != param.shape:
                raise ValueError(f"{name}: checkpoint gives {tuple(local.shape)} on this rank, "
                                 f"the model has {tuple(param.shape)}")
            param.copy_(local.to(param.dtype))
    layers = config.num_layers
    mine = range(first, first + per_rank)
    unused = []
    for name in st.files:
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if (name in st.used or "rotary_emb" in name or (m and int(m.group(1)) >= layers)
                or (name == "lm_head.weight" and model.share_embeddings_and_output_weights)):
            continue
        e = re.search(r"\.experts\.(\d+)\.", name)
        if e and int(e.group(1)) not in mine:
            continue
        unused.append(name)
    if unused:
        raise ValueError(f"checkpoint tensors with no Megatron parameter: {unused[:8]}"
                         + (f" and {len(unused) - 8} more" if len(unused) > 8 else ""))


def load_hf_checkpoint(path: str, tp: int = 1, ep: int = 1, *,
                       overlap: OverlapConfig | None = None, impl: str = "local",
                       num_layers: int | None = None, dtype: torch.dtype | None = None,
                       experts: str = "grouped", attention: str = "sdpa",
                       device: torch.device | str | None = None,
                       policy: LayerPolicy | None = None, **overrides):
    """GPTModel of the Hugging Face model in folder `path`, with its weights, for TP x EP.

    num_layers: None = all (config.json num_hidden_layers); fewer keeps the first ones.
    dtype: parameter dtype (None: bf16 on CUDA, fp32 on CPU, as the builders). impl,
    experts, overlap, policy, attention: as `build_model`. overrides: TransformerConfig fields.
    device: where the model is returned (None: the current CUDA device where there is
    one, as Megatron-LM's get_model moves it, else the CPU; Megatron builds some
    parameters, the shared-expert gate among them, on the CPU whatever its config says).
    The model's `hf_vocab_size` is the checkpoint's vocabulary (logits past it are
    padding), `hf_arch` the models.py name of its architecture.
    """
    hf = read_hf_config(path)
    if impl == "te":
        overrides.setdefault("moe_grouped_gemm", experts == "grouped")
    arch, config, card = hf_model_config(hf, tp, ep, num_layers, impl=impl, dtype=dtype,
                                         **overrides)
    spec = model_spec(config, experts=experts, overlap=overlap, attention=attention,
                      policy=policy)
    if device is None:
        device = (torch.device("cuda", torch.cuda.current_device())
                  if torch.cuda.is_available() else torch.device("cpu"))
    model = gpt_model(config, card, spec, card.vocab_size).to(device)
    load_hf_weights(model, path, arch)
    model.hf_vocab_size, model.hf_arch = card.vocab_size, arch
    return model
