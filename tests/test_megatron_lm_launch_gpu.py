"""Megatron-LM's default flags with real Transformer Engine, on one GPU (device machine, TE
brought by tools/te_wheels.sh): `pytest -m gpu tests/test_megatron_lm_launch_gpu.py`.

The CPU twin is tests/test_megatron_lm_launch.py (TE's modules replaced by doubles there).
Here Megatron-LM's parser takes a line with its defaults (`--transformer-impl
transformer_engine`, biases on) plus `--moe-grouped-gemm` (TEGroupedMLP; with biases
Megatron's TEGroupedMLP needs `--no-bias-dropout-fusion`) and `--spec megatron_overlap.mcore
moe_overlap_gpt_spec --moe-overlap`; core_v0.19's GPTModelBuilder builds the model. Checked:
every MoE layer is OverlapMoELayer over TEGroupedMLP, no fallback warning, the op ran, and
one bf16 forward + backward agrees with the stock model of the same line without
`--moe-overlap` (same weights). Skipped without CUDA or TE.
"""

import pytest
import torch

from dist_harness import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")]

LINE = ["--num-layers", "2", "--hidden-size", "1024", "--num-attention-heads", "8",
        "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512",
        "--seq-length", "1024", "--max-position-embeddings", "1024", "--micro-batch-size", "2",
        "--moe-grouped-gemm", "--moe-token-dispatcher-type", "allgather", "--swiglu",
        "--no-bias-dropout-fusion", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1023", "--bf16",
        "--spec", "megatron_overlap.mcore", "moe_overlap_gpt_spec",
        # Megatron-LM's default gradient-accumulation fusion needs Apex's CUDA extension
        # (the device has no Apex: its ColumnParallelLinear refuses to build without it)
        "--no-gradient-accumulation-fusion"]
OVERLAP = ["--moe-overlap", "--moe-overlap-backend", "triton",
           "--moe-overlap-fuse", "always"]


def _te_missing():
    from megatron_overlap.optional import te_available

    return te_available()


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _default_flags_scenario(rank, world):
    import sys
    import warnings

    import mcore_shims  # (Python 3.11 only: typing.override; a no-op on 3.12 with CUDA)

    mcore_shims.install_megatron_training()
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import unset_global_variables
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron_overlap.mcore import moe_overlap_args_provider

    def build(argv):
        unset_global_variables()
        destroy_num_microbatches_calculator()
        sys.argv = ["pretrain_gpt.py", *argv]
        args = parse_and_validate_args(extra_args_provider=moe_overlap_args_provider(None))
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(args.seed)
        model = GPTModelBuilder(gpt_config_from_args(args)).build_model(
            ProcessGroupCollection.use_mpu_process_groups())
        return args, model.cuda().bfloat16()

    def step(model):
        g = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, 1023, (2, 1024), generator=g).cuda()
        labels = torch.randint(0, 1023, (2, 1024), generator=g).cuda()
        model.zero_grad(set_to_none=True)
        loss = model(tokens, torch.arange(1024, device="cuda").expand(2, 1024), None,
                     labels=labels)
        loss.float().mean().backward()
        return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                               if p.grad is not None}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args, model = build(LINE + OVERLAP)
        loss, grads = step(model)
        torch.cuda.synchronize()
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    _, stock = build(LINE)
    stock.load_state_dict(model.state_dict())
    ref_loss, ref_grads = step(stock)
    return dict(
        impl=args.transformer_impl, bias=args.add_bias_linear,
        layers=[(type(m).__name__, type(m.experts).__name__) for m in layers],
        fused=[m.last_rows is not None for m in layers],
        fallback=[str(w.message) for w in caught if "megatron-overlap" in str(w.message)],
        loss=_rel(loss, ref_loss), grads={k: _rel(grads[k], ref_grads[k]) for k in ref_grads},
        names=sorted(grads) == sorted(ref_grads))


def test_megatron_lm_default_flags_with_te_fuse_every_moe_layer_over_te_grouped_mlp():
    if (why := _te_missing()) is not None:
        pytest.skip(f"Transformer Engine: {why}")
    r = run_ranks(1, _default_flags_scenario, backend="nccl")[0]
    assert r["impl"] == "transformer_engine" and r["bias"] is True
    assert r["layers"] == [("OverlapMoELayer", "TEGroupedMLP")] * 2, r["layers"]
    assert r["fallback"] == [] and all(r["fused"]), r
    assert r["names"] and r["loss"] < 2e-2, r["loss"]
    worst = max(r["grads"], key=r["grads"].get)
    assert r["grads"][worst] < 5e-2, (worst, r["grads"][worst])
