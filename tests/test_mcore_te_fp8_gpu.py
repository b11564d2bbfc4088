"""OverlapMoELayer under Transformer Engine's FP8 recipes on one Hopper GPU (device
machine, TE brought by tools/te_wheels.sh): `pytest -m gpu tests/test_mcore_te_fp8_gpu.py`.

Megatron's TE model with `fp8="e4m3"` (and "hybrid": e5m2 gradients) and each Hopper recipe (tensorwise = current
scaling, delayed, blockwise), one MoE layer of TEGroupedMLP experts: stock core-TE FP8
against the same model with --moe-overlap: tensorwise on the grouped FP8 experts in
training too (FP8 dgrad and wgrad, ops/fp8_train.py), blockwise on its exactly dequantized
operands in training too (ops/block_train.py), delayed on the grouped FP8 experts with
TE's scaling state (mcore/te_delayed.py). Checked: every MoE layer
fuses, and the logits, the loss and every parameter's gradient are no further from
core-TE FP8's than core-TE FP8's are from core-TE bf16's (FP8's own error), with a floor
at bf16's tolerance; also the logits in eval mode, where tensorwise runs FC1 and FC2 on
the grouped FP8 experts (mcore/fp8_experts.py) and blockwise its exactly dequantized
operands on the bf16 grouped kernels; under delayed, TE's scales and amax histories after
the same calls within 10% of stock's (norms). Skipped without CUDA, TE or an sm_90 GPU.
"""

import warnings

import pytest
import torch

from dist_harness import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")]


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _arm(model, tokens, positions, labels, fused: bool, fp8: str | None):
    """(logits, loss, gradients) of one arm: overlapped or stock, FP8 or bf16."""
    from megatron_overlap.mcore.convert import set_overlap_enabled

    set_overlap_enabled(model, fused)
    model.config.fp8 = fp8
    for m in model.modules():
        if hasattr(m, "config"):
            m.config.fp8 = fp8
    model.zero_grad(set_to_none=True)
    model.eval()  # (inference: tensorwise runs the grouped FP8 experts, fp8_experts.py)
    with torch.no_grad():
        served = model(tokens, positions, None).float()
    model.train()
    with torch.no_grad():  # (prefill in training mode: the op without a sink)
        logits = model(tokens, positions, None)
    loss = model(tokens, positions, None, labels=labels).float().mean()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return logits.detach().float(), float(loss), grads, served


def _scaling_state(model) -> list:
    """(tensor, a copy) of every TE module's delayed-scaling state: the scale, scale_inv and
    amax history of its forward and backward FP8 metadata (none under the other recipes)."""
    state = []
    for m in model.modules():
        for meta in getattr(m, "fp8_meta", {}).values():
            for name in ("scale", "scale_inv", "amax_history"):
                t = getattr(meta, name, None)
                if isinstance(t, torch.Tensor):
                    state.append((t, t.detach().clone()))
    return state


def _restore_scaling_state(state) -> None:
    with torch.no_grad():  # (in place: TE's quantizers hold views of these tensors)
        for tensor, saved in state:
            tensor.copy_(saved)


def _fp8_parity(rank, world, recipe, fmt):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_overlap.mcore.convert import fused_at_every_size
    from megatron_overlap.mcore.layer import OverlapMoELayer
    from megatron_overlap.mcore.models import build_model
    from megatron_overlap.mcore.policy import LayerPolicy
    from megatron_overlap.ops import OverlapConfig

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    model_parallel_cuda_manual_seed(3, force_reset_rng=True)
    torch.manual_seed(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = build_model("qwen", impl="te", overlap=OverlapConfig(backend="triton",
                                                                      sync_errors=True),
                            policy=LayerPolicy(fp8=True, fp8_blockwise=True),
                            num_layers=1, hidden_size=1024, moe_ffn_hidden_size=512,
                            num_moe_experts=16, vocab_size=1024, fp8=fmt,
                            fp8_recipe=recipe).cuda()
        layers = [m for m in model.modules() if isinstance(m, OverlapMoELayer)]
        g = torch.Generator().manual_seed(5)
        tokens = torch.randint(0, 1024, (2, 512), generator=g).cuda()
        positions = torch.arange(512).expand_as(tokens).contiguous().cuda()
        labels = torch.randint(0, 1024, (2, 512), generator=g).cuda()
        res = {"reasons": [m.unsupported_reason for m in layers]}
        with fused_at_every_size(model):
            bf16 = _arm(model, tokens, positions, labels, False, None)
            # one FP8 step first, then both arms from the same TE scaling state: delayed
            # scaling quantizes with scales its earlier calls' amax history made, so arms
            # run one after the other on the same modules would each see the other's
            # (measured: one warm-up step alone left stock's shared expert's FC1 weight
            # gradient underflowing to 0 and ours not)
            _arm(model, tokens, positions, labels, False, fmt)
            state = _scaling_state(model)
            stock = _arm(model, tokens, positions, labels, False, fmt)
            after_stock = [t.detach().clone() for t, _ in state]
            _restore_scaling_state(state)
            ours = _arm(model, tokens, positions, labels, True, fmt)
            # (delayed: TE's scales and amax histories after the same calls, ours against
            # stock's; empty under the other recipes)
            res["state"] = max([_rel(t, s) for (t, _), s in zip(state, after_stock)
                                if s.abs().max() > 0], default=0.0)
            res["own_fp8"] = [m._stacks.fc1_own_fp8._value is not None for m in layers]
            res["trained_grouped"] = [m.last_path.grouped_fp8 for m in layers]
            res["own_block"] = [m._stacks.fc1_own_block._value is not None for m in layers]
            res["fused"] = all(m.last_path.fused for m in layers)
            res["fp8_op"] = all(m.last_plan is not None for m in layers)
    res["warnings"] = [str(w.message) for w in caught if "megatron-overlap" in str(w.message)]
    res["logits"] = (_rel(ours[0], stock[0]), _rel(stock[0], bf16[0]))
    res["served"] = (_rel(ours[3], stock[3]), _rel(stock[3], bf16[3]))
    res["loss"] = (abs(ours[1] - stock[1]) / abs(stock[1]),
                   abs(stock[1] - bf16[1]) / abs(bf16[1]))
    res["same_params"] = sorted(ours[2]) == sorted(stock[2])
    res["grads"] = {n: (_rel(ours[2][n], stock[2][n]), _rel(stock[2][n], bf16[2][n]))
                    for n in stock[2] if n in ours[2]}
    ps.destroy_model_parallel()
    return res


@pytest.mark.parametrize("recipe, fmt", [
    ("tensorwise", "e4m3"), ("delayed", "e4m3"), ("blockwise", "e4m3"),
    ("tensorwise", "hybrid"), ("delayed", "hybrid"), ("blockwise", "hybrid")])  # (e5m2 grads)
def test_fp8_moe_layer_fuses_and_stays_within_fp8s_own_error_of_core_te_fp8(recipe, fmt):
    from megatron_overlap.optional import te_available

    if (why := te_available()) is not None:
        pytest.skip(f"Transformer Engine not importable: {why}")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the FP8 GEMM2 is built for Hopper's e4m3 wgmma")
    (r,) = run_ranks(1, _fp8_parity, recipe, fmt, backend="nccl")
    assert r["reasons"] == [None] and r["warnings"] == [], r
    assert r["fused"] and r["fp8_op"], r
    ours, fp8_error = r["logits"]
    assert ours <= max(fp8_error, 1e-2), r["logits"]
    # eval mode without gradients: tensorwise and delayed on the grouped FP8 experts,
    # blockwise on the bf16 grouped kernels with its exactly dequantized operands
    assert r["own_fp8"] == [recipe != "blockwise"], r["own_fp8"]
    assert r["trained_grouped"] == [True], r  # (the backward's call)
    assert r["state"] <= 0.1, r["state"]  # (delayed: TE's state advanced as stock's)
    assert r["own_block"] == [recipe == "blockwise"], r  # (eval: exact dequantization)
    assert r["served"][0] <= max(r["served"][1], 1e-2), r["served"]
    assert r["loss"][0] <= max(r["loss"][1], 1e-3), r["loss"]
    assert r["same_params"], r
    worst = max(r["grads"].items(), key=lambda kv: kv[1][0] / max(kv[1][1], 5e-2))
    assert worst[1][0] <= max(worst[1][1], 5e-2), worst
