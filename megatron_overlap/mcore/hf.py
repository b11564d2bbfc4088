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
Semantics mapped (config.json field -> Megatron): `hf_config.py`; a feature Megatron or
this loader does not reproduce exactly is a ValueError naming its field.
"""

from __future__ import annotations

import json
import os
import re

import torch

from ..ops import OverlapConfig
from .hf_config import hf_model_config, read_hf_config
from .models import gpt_model, model_spec
from .policy import LayerPolicy

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
