"""GPTModel builders for the paper's three MoE models (random weights, no hub access).

Every number is the model's published config.json (cited per builder); the MoE shapes
(hidden, expert FFN, experts, top-k) come from `megatron_overlap.shapes`, which holds the
same values. All three use Megatron-Core's allgather dispatcher and one of two block specs:

- impl="te": Megatron's Transformer Engine GPT spec, as Megatron-LM's default flags build
  it (TE attention, fused norm + linear, TEGroupedMLP experts): the core-TE baseline.
- impl="local" (the default; no TE needed): Megatron's local spec with three
  substitutions: GroupedGemmExperts (grouped GEMMs through torch._grouped_mm;
  `experts="sequential"` keeps Megatron's SequentialMLP), SDPAttention as core attention
  and SequenceParallelNorm as norm (modules.py says why: the local attention cannot run
  MLA and materializes S x S; the local torch norm refuses sequence parallelism).

`overlap=OverlapConfig(...)` installs OverlapMoELayer; `overlap=None` keeps Megatron's
MoELayer (the stock baseline on the same model).

Megatron parallel state (tp, ep) must be initialized before building, as for any
Megatron-Core model. `tiny=True` shrinks every width (same architecture features) for CPU
tests and demos.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from ..ops import OverlapConfig
from ..optional import te_available
from ..shapes import MODELS
from .architectures import ScaledGPTModel, with_latent_kv_norm_where_needed
from .modules import SDPAttention, SequenceParallelNorm
from .policy import LayerPolicy
from .spec import with_grouped_experts, with_overlap_moe


@dataclasses.dataclass(frozen=True)
class ModelCard:
    """What GPTModel needs besides the TransformerConfig."""

    vocab_size: int  # published, before Megatron's padding to a multiple of 128 * TP
    max_position_embeddings: int
    rotary_base: float
    tie_embeddings: bool
    # GraniteMoe's scalars (architectures.ScaledGPTModel); 1.0 = none
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0


#: Widths for `tiny=True`: CPU-sized, divisible by TP and EP up to 4, features kept.
TINY = {
    "granite": dict(hidden_size=64, num_attention_heads=8, num_query_groups=4,
                    moe_ffn_hidden_size=32, num_moe_experts=8, moe_router_topk=4,
                    softmax_scale=1.0 / 8),
    "qwen": dict(hidden_size=64, num_attention_heads=4, num_query_groups=4,
                 moe_ffn_hidden_size=32, num_moe_experts=8, moe_router_topk=2,
                 moe_shared_expert_intermediate_size=128),
    "deepseek": dict(hidden_size=64, num_attention_heads=4, num_query_groups=4,
                     ffn_hidden_size=128, moe_ffn_hidden_size=32, num_moe_experts=8,
                     moe_router_topk=3, moe_shared_expert_intermediate_size=64,
                     kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16),
}
TINY_VOCAB = 256


IMPLS = ("local", "te")


def _common(key: str, tp: int, ep: int, num_layers: int, impl: str = "local") -> dict:
    shape = MODELS[key]
    cuda = torch.cuda.is_available()
    return dict(
        num_layers=num_layers, hidden_size=shape.hidden, moe_ffn_hidden_size=shape.expert_ffn,
        num_moe_experts=shape.experts, moe_router_topk=shape.topk,
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        sequence_parallel=tp > 1,  # Megatron requires it for MoE with TP
        moe_token_dispatcher_type="allgather",
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        # "te": Megatron-LM's default (--transformer-impl transformer_engine), whose MoE
        # experts are TEGroupedMLP only with --moe-grouped-gemm (SequentialMLP without)
        transformer_impl="transformer_engine" if impl == "te" else "local",
        moe_grouped_gemm=impl == "te",
        params_dtype=torch.bfloat16 if cuda else torch.float32, bf16=cuda,
        moe_router_dtype="fp32",  # the published routers take their softmax in fp32
        # Megatron-LM's launch default (--bias-swiglu-fusion, off with
        # --no-bias-swiglu-fusion): SwiGLU and the routing weights in one compiled kernel.
        # Eager, the activation is five passes over FC1's output, a third of a layer's
        # GPU time (measured on one H200). CPU runs stay eager (no compiler there).
        bias_activation_fusion=cuda,
        use_cpu_initialization=not cuda,
    )


def granite_config(tp: int = 1, ep: int = 1, num_layers: int = 24, impl: str = "local",
                  **overrides):
    """ibm-granite/granite-3.1-1b-a400m-instruct config.json: hidden 1024, 24 layers, 16
    heads / 8 KV heads, expert FFN 512, 32 experts top-8 (softmax over the top-8 logits),
    RMSNorm eps 1e-6, rope_theta 1.5e6, vocab 49155 (tied), 131072 positions,
    router_aux_loss_coef 0.

    embedding_multiplier 12, residual_multiplier 0.22 and logits_scaling 6 are in the
    ModelCard: `build_model` applies them through ScaledGPTModel (architectures.py; not
    Megatron's MuP switches, which also change initialization and have no residual
    multiplier). attention_multiplier 0.015625 is exact, as softmax_scale.
    """
    cfg = _common("granite", tp, ep, num_layers, impl)
    cfg.update(num_attention_heads=16, num_query_groups=8, ffn_hidden_size=512,
               layernorm_epsilon=1e-6, softmax_scale=0.015625, moe_router_pre_softmax=False,
               moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    cfg.update(overrides)
    return TransformerConfig(**cfg), ModelCard(49155, 131072, 1.5e6, True,
                                               embedding_multiplier=12.0,
                                               residual_multiplier=0.22, logits_scaling=6.0)


def qwen_config(tp: int = 1, ep: int = 1, num_layers: int = 24, impl: str = "local",
                  **overrides):
    """Qwen/Qwen1.5-MoE-A2.7B config.json: hidden 2048, 24 layers, 16 heads (16 KV), QKV
    bias, expert FFN 1408, 60 experts top-4 with softmax before top-k and no
    renormalization (norm_topk_prob false), shared expert 5632 with a sigmoid gate, RMSNorm
    eps 1e-6, rope_theta 1e6, vocab 151936 (untied), router_aux_loss_coef 0.001,
    max_position_embeddings 32768 (the value published with the Chat config; the
    architecture numbers are identical)."""
    cfg = _common("qwen", tp, ep, num_layers, impl)
    cfg.update(num_attention_heads=16, num_query_groups=16, ffn_hidden_size=5632,
               add_qkv_bias=True, layernorm_epsilon=1e-6, moe_router_pre_softmax=True,
               moe_shared_expert_intermediate_size=5632, moe_shared_expert_gate=True,
               moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.001)
    cfg.update(overrides)
    return TransformerConfig(**cfg), ModelCard(151936, 32768, 1e6, False)


def deepseek_config(tp: int = 1, ep: int = 1, num_layers: int = 27, impl: str = "local",
                    **overrides):
    """deepseek-ai/DeepSeek-V2-Lite config.json: hidden 2048, 27 layers, the first dense
    (first_k_dense_replace 1, intermediate 10944), 16 heads of MLA (q_lora_rank null,
    kv_lora_rank 512, qk_nope 128 + qk_rope 64, v 128), expert FFN 1408, 64 experts top-6
    (softmax, greedy, no renormalization, routed_scaling_factor 1), 2 shared experts =
    2816, RMSNorm eps 1e-6, YaRN rope (theta 1e4, factor 40, 4096 original positions,
    beta_fast 32, beta_slow 1, mscale = mscale_all_dim = 0.707), vocab 102400 (untied),
    163840 positions, sequence aux loss 0.001.

    The RMSNorm on the 512-wide KV latent (kv_a_layernorm) is `linear_kv_up_proj`'s
    input norm on both impls (`model_spec` -> architectures.with_latent_kv_norm), with
    `qk_layernorm` off: with q_lora_rank null, Megatron-Core 0.19's `qk_layernorm` places
    the KV norm only through TE's fused norm + linear and also puts a norm on
    linear_q_proj's input, which DeepSeek-V2-Lite does not have.
    """
    cfg = _common("deepseek", tp, ep, num_layers, impl)
    cfg.update(num_attention_heads=16, num_query_groups=16, ffn_hidden_size=10944,
               layernorm_epsilon=1e-6, moe_router_pre_softmax=True,
               moe_shared_expert_intermediate_size=2 * MODELS["deepseek"].expert_ffn,
               moe_layer_freq=[0] + [1] * (num_layers - 1),
               moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.001,
               q_lora_rank=None, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64,
               v_head_dim=128, qk_layernorm=False, rope_type="yarn", rotary_base=10000,
               rotary_scaling_factor=40, original_max_position_embeddings=4096,
               beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707)
    cfg.update(overrides)
    return MLATransformerConfig(**cfg), ModelCard(102400, 163840, 10000, False)


CONFIGS = {"granite": granite_config, "qwen": qwen_config, "deepseek": deepseek_config}


def padded_vocab(vocab: int, tp: int, multiple: int = 128) -> int:
    """Megatron-LM's default padding: a multiple of 128 * TP (the embedding splits by TP)."""
    step = multiple * tp
    return -(-vocab // step) * step


def with_local_modules(block, sdpa: bool):
    """A copy of a local block spec with SequenceParallelNorm for its torch norms and,
    when `sdpa`, SDPAttention as core attention (see modules.py for why)."""
    memo = {}

    def norm(builder):
        return SequenceParallelNorm if builder is WrappedTorchNorm else builder

    def layer(spec):
        if id(spec) not in memo:
            sub = spec.submodules
            attn = sub.self_attention
            if sdpa:
                attn = dataclasses.replace(attn, submodules=dataclasses.replace(
                    attn.submodules, core_attention=SDPAttention))
            sub = dataclasses.replace(sub, self_attention=attn,
                                      input_layernorm=norm(sub.input_layernorm),
                                      pre_mlp_layernorm=norm(sub.pre_mlp_layernorm))
            memo[id(spec)] = dataclasses.replace(spec, submodules=sub)
        return memo[id(spec)]

    return dataclasses.replace(block, layer_specs=[layer(s) for s in block.layer_specs],
                               layer_norm=norm(block.layer_norm))


def model_config(name: str, tp: int = 1, ep: int = 1, num_layers: int | None = None, *,
                 tiny: bool = False, impl: str = "local", **overrides):
    """(TransformerConfig, ModelCard) of `name` for a TP x EP layout (no weights built).

    num_layers: None = the published depth (2 when tiny). tiny: CPU-sized widths (TINY).
    impl: "local" (Megatron's local modules) or "te" (Transformer Engine, Megatron-LM's
    default). overrides: TransformerConfig fields.
    """
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(CONFIGS)}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if tp < 1 or ep < 1:
        raise ValueError(f"tp and ep must be >= 1, got tp={tp} ep={ep}")
    depth = num_layers if num_layers is not None else (2 if tiny else None)
    kwargs = {**(TINY[name] if tiny else {}), **overrides}
    if depth is not None:
        kwargs["num_layers"] = depth
    config, card = CONFIGS[name](tp, ep, impl=impl, **kwargs)
    if config.num_moe_experts % ep:
        raise ValueError(f"EP={ep} does not divide the {config.num_moe_experts} experts of {name}")
    return config, card


def model_spec(config, *, experts: str = "grouped", overlap: OverlapConfig | None = None,
               attention: str = "sdpa", pp_rank: int | None = None,
               policy: LayerPolicy | None = None):
    """The block spec the builders use. config.transformer_impl "transformer_engine":
    Megatron's TE GPT block spec as Megatron-LM builds it (TE attention and norms,
    TEGroupedMLP experts, or TE SequentialMLP with experts="sequential"). "local": its
    local spec with SequenceParallelNorm, SDPAttention (or "local" DotProductAttention)
    and GroupedGemmExperts (or "sequential" SequentialMLP). Both: MLA with q_lora_rank
    None and qk_layernorm off gets the KV-latent norm (with_latent_kv_norm). `overlap`
    given: OverlapMoELayer in place of MoELayer."""
    if experts not in ("grouped", "sequential"):
        raise ValueError(f"experts must be 'grouped' or 'sequential', got {experts!r}")
    if config.transformer_impl == "transformer_engine":
        if config.moe_grouped_gemm != (experts == "grouped"):
            raise ValueError(f"experts={experts!r} with the TE spec needs moe_grouped_gemm="
                             f"{experts == 'grouped'} in the config (TEGroupedMLP or "
                             "SequentialMLP is Megatron's choice from it)")
        if (why := te_available()) is not None:
            raise RuntimeError(f"impl='te' needs Transformer Engine "
                               f"(pip install megatron-overlap[te]): {why}")
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=True,
                                          normalization=config.normalization, pp_rank=pp_rank)
        spec = with_latent_kv_norm_where_needed(config, spec)
        return spec if overlap is None else with_overlap_moe(spec, overlap, policy)
    if attention not in ("sdpa", "local"):
        raise ValueError(f"attention must be 'sdpa' or 'local', got {attention!r}")
    if attention == "local" and config.multi_latent_attention:
        raise ValueError("Megatron-Core 0.19's local DotProductAttention cannot run MLA "
                         "(no k_channels / v_channels); use attention='sdpa'")
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                      normalization=config.normalization, pp_rank=pp_rank)
    spec = with_latent_kv_norm_where_needed(
        config, with_local_modules(spec, sdpa=attention == "sdpa"))
    if experts == "grouped":
        spec = with_grouped_experts(spec)
    return spec if overlap is None else with_overlap_moe(spec, overlap, policy)


def build_model(name: str, tp: int = 1, ep: int = 1, num_layers: int | None = None, *,
                experts: str = "grouped", overlap: OverlapConfig | None = None,
                attention: str = "sdpa", tiny: bool = False, vocab_size: int | None = None,
                impl: str = "local", policy: LayerPolicy | None = None,
                **overrides) -> GPTModel:
    """GPTModel of `name` ("granite", "qwen", "deepseek") for a TP x EP layout.

    num_layers: None = the published depth. impl: "local" (Megatron's local modules) or
    "te" (Transformer Engine throughout, as Megatron-LM's default builds it: core-TE).
    experts: "grouped" (GroupedGemmExperts; TEGroupedMLP with impl="te") or "sequential"
    (Megatron's SequentialMLP). overlap: None = stock MoELayer; an
    OverlapConfig installs OverlapMoELayer with it (and `policy`, the layers' LayerPolicy;
    None = its defaults). attention: "sdpa" (SDPAttention) or
    "local" (Megatron's DotProductAttention; not for MLA, which it cannot run in 0.19).
    tiny: CPU-sized widths (TINY). vocab_size: None = published (256 when tiny), padded
    to a multiple of 128 * TP. overrides: TransformerConfig fields. Parameters are on
    CUDA when available (Megatron's parallel state must be initialized).
    """
    if impl == "te":
        overrides.setdefault("moe_grouped_gemm", experts == "grouped")
    config, card = model_config(name, tp, ep, num_layers, tiny=tiny, impl=impl, **overrides)
    spec = model_spec(config, experts=experts, overlap=overlap, attention=attention,
                      policy=policy)
    vocab = vocab_size or (TINY_VOCAB if tiny else card.vocab_size)
    return gpt_model(config, card, spec, vocab)


def gpt_model(config, card: ModelCard, spec, vocab_size: int) -> GPTModel:
    """The GPTModel of a config, card and block spec: vocab padded to a multiple of
    128 * TP, rope, tied embeddings as the card says, ScaledGPTModel where the card has
    Granite's scalars."""
    scalars = dict(embedding_multiplier=card.embedding_multiplier,
                   residual_multiplier=card.residual_multiplier,
                   logits_scaling=card.logits_scaling)
    cls, extra = ((GPTModel, {}) if all(v == 1.0 for v in scalars.values())
                  else (ScaledGPTModel, scalars))
    return cls(config=config, transformer_layer_spec=spec,
               vocab_size=padded_vocab(vocab_size, config.tensor_model_parallel_size),
               max_sequence_length=card.max_position_embeddings,
               share_embeddings_and_output_weights=card.tie_embeddings,
               position_embedding_type="rope", rotary_base=card.rotary_base, **extra)


def build_granite(tp: int = 1, ep: int = 1, num_layers: int | None = None, **kwargs) -> GPTModel:
    """Granite-3.1-1B-A400M (see `granite_config`); kwargs as `build_model`."""
    return build_model("granite", tp, ep, num_layers, **kwargs)


def build_qwen(tp: int = 1, ep: int = 1, num_layers: int | None = None, **kwargs) -> GPTModel:
    """Qwen1.5-MoE-A2.7B (see `qwen_config`); kwargs as `build_model`."""
    return build_model("qwen", tp, ep, num_layers, **kwargs)


def build_deepseek(tp: int = 1, ep: int = 1, num_layers: int | None = None, **kwargs) -> GPTModel:
    """DeepSeek-V2-Lite (see `deepseek_config`); kwargs as `build_model`."""
    return build_model("deepseek", tp, ep, num_layers, **kwargs)
