"""load_hf_checkpoint: tiny random transformers models (GraniteMoe, Qwen2-MoE, DeepSeek-V2)
saved to a folder and loaded into Megatron give transformers' logits, in fp32 on CPU gloo
ranks (TP1EP1, TP1EP2, TP2EP1; stock and overlapped), and in bf16 on a GPU at the
published widths.

Every weight of the tiny models is perturbed away from its initialization (norm weights
off 1, biases off 0), so a norm or bias the mapping dropped or misplaced shows in the
logits. One spawned pair of ranks runs every case (Megatron imported once per rank).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from dist_harness import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 200  # not a multiple of 128: the padded rows of Megatron's vocabulary are tested too
TOL = 1e-4  # max |Megatron - transformers| / max |transformers| in fp32

# GraniteMoe / Qwen2-MoE / DeepSeek-V2 configs: the published features at CPU widths
TINY = {
    "granite": dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
                    num_experts_per_tok=4, rms_norm_eps=1e-6, rope_theta=1.5e6,
                    attention_multiplier=0.125, embedding_multiplier=12.0,
                    residual_multiplier=0.22, logits_scaling=6.0, tie_word_embeddings=True,
                    max_position_embeddings=4096, router_aux_loss_coef=0.0),
    # GQA (2 KV heads for 4) to test the per-group QKV interleaving; layer 0 dense
    "qwen": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                 num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[0],
                 rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
                 max_position_embeddings=4096),
    "deepseek": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                     n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2,
                     first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32,
                     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                     routed_scaling_factor=1.5, topk_method="greedy", rms_norm_eps=1e-6,
                     max_position_embeddings=163840, tie_word_embeddings=False,
                     rope_theta=10000.0,
                     rope_scaling=dict(type="yarn", factor=40.0,
                                       original_max_position_embeddings=4096, beta_fast=32,
                                       beta_slow=1, mscale=0.707, mscale_all_dim=0.707)),
}
LAYOUTS = {"TP1EP1": (1, 1), "TP1EP2": (1, 2), "TP2EP1": (2, 1)}
POLICIES = ("stock", "interpret", "reference")


def transformers_classes():
    """{arch: (config class, ForCausalLM class)}. transformers imports the PyPI package
    `kernels`, which this repository's kernels/ folder (installed as
    megatron_overlap.kernels) shadows while the repository root is on sys.path (pytest
    run as `python -m pytest` from it): import with the root off the path."""
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != ROOT]
    try:
        import transformers.integrations.hub_kernels  # noqa: F401  (binds the real package)
        from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, GraniteMoeConfig,
                                  GraniteMoeForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM)
    finally:
        sys.path[:] = saved
    return {"granite": (GraniteMoeConfig, GraniteMoeForCausalLM),
            "qwen": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
            "deepseek": (DeepseekV2Config, DeepseekV2ForCausalLM)}


def tokens(batch: int = 2, seq: int = 16, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(7))


def save_hf_model(arch: str, folder: str, fields: dict, *, dtype=torch.float32,
                  perturb: bool = True, max_shard_size=None, device="cpu", seed: int = 0):
    """A random transformers model of `arch` saved to `folder` (safetensors); returns the
    model (eval, on `device`)."""
    config_cls, model_cls = transformers_classes()[arch]
    torch.manual_seed(seed)
    config = config_cls(**fields)
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(folder, **({} if max_shard_size is None
                                     else {"max_shard_size": max_shard_size}))
    return model.to(device=device, dtype=dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _megatron_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """[B, S, V] fp32 logits (TP shards gathered, vocabulary padding cut)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    device = next(model.parameters()).device
    ids = ids.to(device)
    positions = torch.arange(ids.shape[1], device=device).expand_as(ids).contiguous()
    with torch.no_grad():
        logits = model(ids, positions, None)  # [B, S, V_pad / TP]
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)
    return logits[..., :model.hf_vocab_size].float()


def _cases(rank, world, folders: dict, expected: dict):
    """Every (arch, layout, policy): max rel. diff of Megatron's logits to transformers'."""
    import mcore_shims

    mcore_shims.install()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_overlap.mcore import load_hf_checkpoint
    from megatron_overlap.mcore.layer import OverlapMoELayer
    from megatron_overlap.ops import OverlapConfig

    out = {}
    for layout, (tp, ep) in LAYOUTS.items():
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
        model_parallel_cuda_manual_seed(0)
        for arch, folder in folders.items():
            for policy in POLICIES if layout == "TP1EP1" else POLICIES[:2]:
                overlap = None if policy == "stock" else OverlapConfig(backend=policy)
                model = load_hf_checkpoint(folder, tp, ep, overlap=overlap).eval()
                got = _megatron_logits(model, tokens())
                if overlap is not None:  # every MoE layer ran the fused launch
                    moe = [m for m in model.modules() if isinstance(m, OverlapMoELayer)]
                    assert moe and all(m.last_rows is not None for m in moe), (arch, layout)
                out[(arch, layout, policy)] = _rel(got, expected[arch])
    # the prefill launcher on the checkpoint, ABBA, TP1EP2
    from megatron_overlap.mcore import prefill

    args = prefill.parse_args(["--hf", folders["qwen"], "--tp", "1", "--ep", "2", "--batch",
                               "2", "--seq", "16", "--iters", "2", "--warmup", "1", "--abba",
                               "--moe-overlap-backend", "interpret", "--preload", "mcore_shims"])
    out["prefill"] = prefill.run_all(args)[-1]
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("CPU gloo parity (the GPU one is test_logits_match_transformers_bf16_gpu)")
    folders, expected = {}, {}
    for arch, fields in TINY.items():
        folder = str(tmp_path_factory.mktemp(arch))
        # Qwen's folder sharded (model.safetensors.index.json), the others one file
        model = save_hf_model(arch, folder, dict(fields, vocab_size=VOCAB),
                              max_shard_size="100KB" if arch == "qwen" else None)
        with torch.no_grad():
            expected[arch] = model(tokens()).logits.float()
        folders[arch] = folder
    assert os.path.isfile(os.path.join(folders["qwen"], "model.safetensors.index.json"))
    ranks = run_ranks(2, _cases, folders, expected)
    worst = {k: max(r[k] for r in ranks) for k in ranks[0] if k != "prefill"}  # of 2 ranks
    return worst | {"prefill": ranks[0]["prefill"]}


@pytest.mark.parametrize("arch", TINY)
def test_logits_equal_transformers_on_one_rank(parity, arch):
    for policy in POLICIES:
        assert parity[(arch, "TP1EP1", policy)] < TOL, (policy, parity[(arch, "TP1EP1", policy)])


@pytest.mark.parametrize("layout", ["TP1EP2", "TP2EP1"])
@pytest.mark.parametrize("arch", TINY)
def test_logits_equal_transformers_split_over_two_ranks(parity, arch, layout):
    for policy in POLICIES[:2]:
        assert parity[(arch, layout, policy)] < TOL, (policy, parity[(arch, layout, policy)])


def test_prefill_runs_a_checkpoint_and_reports_its_routing_skew(parity):
    from megatron_overlap.mcore.prefill import report

    result = parity["prefill"]
    assert result["model"] == "qwen" and set(result["policies"]) == {"stock", "overlap"}
    rows = result["decisions_rank0"]
    assert [r["layer"] for r in rows] == [2]  # layer 1 of the tiny Qwen is dense
    # rank 0's 4 experts' share of the EP group's 2 x 16 tokens x top-2
    assert 0 < rows[0]["rows"] <= 2 * 16 * 2 and rows[0]["max_over_mean"] >= 1.0
    assert "x the mean" in report(result)


def test_unsupported_config_fields_are_named():
    from megatron_overlap.mcore.hf import hf_model_config

    classes = transformers_classes()
    bad = {"qwen": dict(use_sliding_window=True, sliding_window=64),
           "deepseek": dict(q_lora_rank=16), "granite": dict(attention_bias=True)}
    for arch, field in bad.items():
        hf = classes[arch][0](**dict(TINY[arch], vocab_size=VOCAB, **field))
        with pytest.raises(ValueError, match=next(iter(field))):
            hf_model_config(hf)


def test_builders_apply_granite_scalars_and_deepseek_latent_norm():
    from megatron_overlap.mcore.models import model_config, model_spec

    _, card = model_config("granite")
    assert (card.embedding_multiplier, card.residual_multiplier, card.logits_scaling) == \
        (12.0, 0.22, 6.0)
    for impl in ("local", "te"):
        config, _ = model_config("deepseek", impl=impl)
        assert config.qk_layernorm is False and config.q_lora_rank is None
    config, _ = model_config("deepseek", tiny=True)
    layer = model_spec(config, pp_rank=0).layer_specs[1]
    assert layer.submodules.self_attention.submodules.linear_kv_up_proj.__name__ == \
        "InputRMSNormColumnParallelLinear"


# Published widths (config.json of each model), two layers
PUBLISHED = {
    "granite": dict(TINY["granite"], hidden_size=1024, intermediate_size=512,
                    num_attention_heads=16, num_key_value_heads=8, num_local_experts=32,
                    num_experts_per_tok=8, attention_multiplier=0.015625, vocab_size=49155,
                    max_position_embeddings=131072),
    "qwen": dict(TINY["qwen"], hidden_size=2048, intermediate_size=5632,
                 moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                 num_attention_heads=16, num_key_value_heads=16, num_experts=60,
                 num_experts_per_tok=4, mlp_only_layers=[], vocab_size=151936,
                 max_position_embeddings=32768),
    "deepseek": dict(TINY["deepseek"], hidden_size=2048, intermediate_size=10944,
                     moe_intermediate_size=1408, num_attention_heads=16,
                     num_key_value_heads=16, n_routed_experts=64, num_experts_per_tok=6,
                     kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                     v_head_dim=128, routed_scaling_factor=1.0, vocab_size=102400),
}


def _gpu_case(rank, world, folder: str, reference: dict):
    import torch.distributed as dist  # noqa: F401  (process group set by the harness)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_overlap.mcore import load_hf_checkpoint
    from megatron_overlap.ops import OverlapConfig

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    out = {}
    for policy, overlap in (("stock", None), ("triton", OverlapConfig(backend="triton"))):
        model = load_hf_checkpoint(folder, overlap=overlap, dtype=torch.bfloat16).eval()
        out[policy] = _megatron_logits(model, tokens(2, 256, reference["vocab"])).cpu()
        del model
        torch.cuda.empty_cache()
    return out


def _rel_fro(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.gpu
@pytest.mark.parametrize("arch", PUBLISHED)
def test_logits_match_transformers_bf16_gpu(tmp_path, arch):
    """bf16 Megatron (stock and triton overlap) within twice transformers' own bf16 error
    (both against transformers in fp32; relative Frobenius norm, at least 1e-2)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    fields = dict(PUBLISHED[arch], num_hidden_layers=2)
    ids = tokens(2, 256, fields["vocab_size"])
    model = save_hf_model(arch, str(tmp_path), fields, device="cuda")
    with torch.no_grad():
        fp32 = model(ids.cuda()).logits.float().cpu()
        bf16 = model.to(torch.bfloat16)(ids.cuda()).logits.float().cpu()
    del model
    torch.cuda.empty_cache()
    bound = max(2 * _rel_fro(bf16, fp32), 1e-2)
    got = run_ranks(1, _gpu_case, str(tmp_path), {"vocab": fields["vocab_size"]},
                    backend="nccl")[0]
    for policy, logits in got.items():
        assert _rel_fro(logits, fp32) <= bound, (policy, _rel_fro(logits, fp32), bound)


def _spec_attention_names(rank, world):
    import argparse

    from megatron.core import parallel_state as ps

    from megatron_overlap.mcore import add_moe_overlap_args
    from megatron_overlap.mcore.models import model_config
    from megatron_overlap.mcore.spec import gpt_block_spec_from_args

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1)
    config, _ = model_config("deepseek", tiny=True)
    out = []
    for argv in ([], ["--moe-overlap", "--moe-overlap-backend", "reference"]):
        args = add_moe_overlap_args(argparse.ArgumentParser()).parse_args(argv)
        args.transformer_impl, args.num_experts, args.normalization = "local", 8, "RMSNorm"
        args.qk_l2_norm, args.moe_grouped_gemm = False, True
        attn = gpt_block_spec_from_args(args, config).layer_specs[1].submodules.self_attention
        out.append({k: getattr(getattr(attn.submodules, k), "__name__", "")
                    for k in ("linear_kv_up_proj", "linear_q_proj")})
    ps.destroy_model_parallel()
    return out


def test_megatron_lm_spec_places_deepseek_latent_norm_in_both_arms():
    # `--spec megatron_overlap.mcore moe_overlap_gpt_spec`, with and without --moe-overlap:
    # DeepSeek-V2-Lite's KV-latent norm on linear_kv_up_proj, none on the query input
    for names in run_ranks(1, _spec_attention_names)[0]:
        assert names["linear_kv_up_proj"].startswith("InputRMSNorm"), names
        assert not names["linear_q_proj"].startswith("InputRMSNorm"), names
