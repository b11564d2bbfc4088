"""OverlapMoELayer over Transformer Engine experts on one GPU (device machine, TE brought
by tools/te_wheels.sh): `pytest -m gpu tests/test_mcore_te_gpu.py`.

The stock side is core-TE: Megatron-Core's own TE spec (TE attention and fused norms,
TEGroupedMLP experts over TE GroupedLinear), as Megatron-LM's default flags build it. The
overlapped side is the same model with --moe-overlap. Checked: every MoE layer fuses (no
fallback warning, the op ran), the forward agrees with stock in bf16, and a training
step's gradients of every parameter (router, FC1, FC2, biases, attention, embeddings)
agree with stock's. Skipped without CUDA or TE.
"""

import warnings

import pytest
import torch

from dist_harness import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")]


def _te_missing():
    from megatron_overlap.optional import te_available

    return te_available()


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def _te_model_parity(rank, world, name, bias):
    """Stock core-TE model against the same model overlapped: logits, then one training
    step's loss and every parameter's gradient; and what the MoE layers did."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_overlap.mcore.convert import fused_at_every_size, set_overlap_enabled
    from megatron_overlap.mcore.layer import OverlapMoELayer
    from megatron_overlap.mcore.models import build_model
    from megatron_overlap.ops import OverlapConfig
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    model_parallel_cuda_manual_seed(3, force_reset_rng=True)
    torch.manual_seed(3)
    config = OverlapConfig(backend="triton", sync_errors=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # one MoE layer (DeepSeek's first layer is dense): both arms route the same
        # tokens, so no bf16 difference upstream flips a top-k choice
        model = build_model(name, impl="te", overlap=config, num_layers=1 + (name == "deepseek"),
                            hidden_size=1024, moe_ffn_hidden_size=512, num_moe_experts=16,
                            add_bias_linear=bias, vocab_size=1024).cuda()
        layers = [m for m in model.modules() if isinstance(m, OverlapMoELayer)]
        g = torch.Generator().manual_seed(5)
        tokens = torch.randint(0, 1024, (2, 512), generator=g).cuda()
        positions = torch.arange(512).expand_as(tokens).contiguous().cuda()
        labels = torch.randint(0, 1024, (2, 512), generator=g).cuda()
        res = dict(te_experts=all(isinstance(m.experts, TEGroupedMLP) for m in layers),
                   layers=len(layers))
        model.eval()
        with torch.no_grad(), fused_at_every_size(model):
            logits = {}
            for fused in (False, True):
                set_overlap_enabled(model, fused)
                logits[fused] = model(tokens, positions, None).float()
            res["fused_in_eval"] = all(m.last_path.fused for m in layers)
        res["logits"] = _rel(logits[True], logits[False])
        model.train()
        step = {}
        with fused_at_every_size(model):
            for fused in (False, True):
                set_overlap_enabled(model, fused)
                model.zero_grad(set_to_none=True)
                loss = model(tokens, positions, None, labels=labels).float().mean()
                loss.backward()
                step[fused] = (float(loss), _grads(model))
            res["fused_in_training"] = all(m.last_path.fused for m in layers)
    ours = [str(w.message) for w in caught if "megatron-overlap" in str(w.message)]
    res["warnings"] = ours
    (loss0, g0), (loss1, g1) = step[False], step[True]
    res["loss"] = abs(loss1 - loss0) / abs(loss0)
    res["same_params"] = sorted(g0) == sorted(g1)
    res["grads"] = {n: _rel(g1[n], g0[n]) for n in g0 if n in g1}
    res["bias_grads"] = sorted(n for n in g0 if "experts" in n and "bias" in n)
    ps.destroy_model_parallel()
    return res


# (Megatron's shared experts take no bias: the biased case is Granite's, which has none)
@pytest.mark.parametrize("name,bias", [("qwen", False), ("granite", False), ("granite", True),
                                       ("deepseek", False)])
def test_core_te_model_with_moe_overlap_matches_stock_forward_and_training_gradients(name, bias):
    if (why := _te_missing()) is not None:
        pytest.skip(f"Transformer Engine not importable: {why}")
    (r,) = run_ranks(1, _te_model_parity, name, bias, backend="nccl")
    assert r["te_experts"] and r["layers"] >= 1, r
    assert r["warnings"] == [], r["warnings"]  # no fallback: every MoE layer fused
    assert r["fused_in_eval"] and r["fused_in_training"], r
    assert r["logits"] < 2e-2, r["logits"]
    assert r["same_params"] and r["loss"] < 1e-2, r
    if bias:
        assert r["bias_grads"], "expert biases got no gradient"
    worst = max(r["grads"].items(), key=lambda kv: kv[1])
    assert worst[1] < 5e-2, worst  # bf16 end to end, every parameter incl. router and biases
