"""Blockwise FP8 TEGroupedMLP trained through exact dequantization (ops/block_train.py), on CPU.

TE's FP8 GroupedLinear is the double of tests/te_fp8_double.py (TE's quantizers emulated,
its backward in float64 from the forward's FP8 operands). Checked: under `--fp8-recipe
blockwise` (e4m3, and hybrid's e5m2 gradients) a training call runs no GEMM of TE's
GroupedLinear; output, input and every parameter gradient are no further from stock
FP8's than stock FP8's are from stock bf16's; Megatron's fused gradient accumulation
gets the weight gradients in main_grad. `block_expert_linear`'s forward, dgrad and wgrad
are the float64 products of the operands TE's recipe makes for each GEMM (1x128 rows,
128x128 weight blocks, 128x1 columns from each expert's first row), and the kernels that
make them equal TE's quantizer emulated, bit for bit.
"""

import pytest
import torch

from dist_harness import run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backends")


def _scenarios(rank, world):
    import mcore_shims
    import te_fp8_double

    mcore_shims.install()
    te_fp8_double.install()
    from megatron.core import parallel_state as ps
    from test_mcore_fp8_training import _arms, _errors
    from test_mcore_te_fp8 import _fp8_config, _fp8_spec

    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    g = torch.Generator().manual_seed(31 + rank)
    x = (torch.randn(12, 2, 32, generator=g) * 2).bfloat16()
    grad = torch.randn(12, 2, 32, generator=g).bfloat16()
    spec, found = _fp8_spec(), {}
    te_fp8_double.FP8GlobalStateManager.enabled = False  # (TE outside its autocast: bf16)
    try:
        bf16, _, _, _ = _arms(spec, _fp8_config(world, "blockwise"), x, grad, "reference")
    finally:
        te_fp8_double.FP8GlobalStateManager.enabled = True
    for fmt, backend in (("e4m3", "reference"), ("e4m3", "interpret"),
                         ("hybrid", "reference")):
        config = _fp8_config(world, "blockwise", fp8=fmt)
        stock, ours, layer, gemms = _arms(spec, config, x, grad, backend)
        found[(fmt, backend)] = dict(
            ours=_errors(ours, stock), fp8=_errors(stock, bf16), gemms=gemms,
            fused=layer.last_path.fused, grouped=layer.last_path.grouped_fp8,
            names=sorted(ours[2]) == sorted(stock[2]),
            refusal=layer.grouped_fp8_training_refusal)
    found["main_grad"] = _main_grad(spec, world, x, grad)
    ps.destroy_model_parallel()
    return found


def _main_grad(spec, world, x, grad):
    """Under gradient_accumulation_fusion with DDP's main_grad: FC1's and FC2's weight
    gradients added there (twice over two backwards), placeholders in .grad."""
    from test_mcore_layer import _run
    from test_mcore_te_fp8 import _fp8_config, _opt_in

    from megatron_overlap.mcore.spec import with_overlap_moe
    from megatron_overlap.ops import OverlapConfig

    config = _fp8_config(world, "blockwise")
    torch.manual_seed(1234)
    layer = with_overlap_moe(spec, OverlapConfig(backend="reference"), _opt_in())(
        config=config)
    plain = _run(layer, x, grad)[2]
    config.gradient_accumulation_fusion = True
    names = [f"experts.{fc}.weight{i}" for fc in ("linear_fc1", "linear_fc2")
             for i in range(layer.experts.linear_fc1.num_gemms)]
    params = dict(layer.named_parameters())
    for n in names:
        params[n].main_grad = torch.zeros(params[n].shape, dtype=torch.float32)
        params[n].grad_added_to_main_grad = False
    _run(layer, x, grad)
    _run(layer, x, grad)
    err = max(float((params[n].main_grad - plain[n].float() * 2).abs().max()
                    / (plain[n].float() * 2).abs().max()) for n in names)
    return dict(added=all(params[n].grad_added_to_main_grad for n in names), err=err,
                placeholder=all(params[n].grad is not None for n in names))


@pytest.fixture(scope="module", params=[1, 2], ids=["TP1EP1", "TP1EP2"])
def runs(request):
    return run_ranks(request.param, _scenarios)


def test_blockwise_training_runs_no_te_gemm_and_matches_stock_fp8(runs):
    """e4m3 and hybrid: FC1, GEMM2 and every backward GEMM on the bf16 grouped kernels
    over the recipe's exactly dequantized operands; output and every gradient no further
    from stock FP8's than stock FP8's are from stock bf16's."""
    for r in runs:
        for key in (("e4m3", "reference"), ("e4m3", "interpret"), ("hybrid", "reference")):
            res = r[key]
            assert res["fused"] and res["grouped"] and res["gemms"] == 0, (key, res)
            assert res["refusal"] is None and res["names"], (key, res)
            # (FP8's own error, or a floor: the forward's operands are the double's, an
            # e4m3 step; the double's backward multiplies the forward's operands and an
            # unquantized dL/dy, TE's and ours requantize both, 128 x 1 for the wgrad, a
            # step each: e4m3's 2^-4, hybrid's e5m2 2^-3)
            floor = dict(out=2 ** -4)
            step = 3 * 2 ** -4 if key[0] == "hybrid" else 2 ** -3
            for name, err in res["ours"].items():
                bound = max(res["fp8"][name], floor.get(name, step))
                assert err <= bound, (key, name, err, res["fp8"][name])
            assert res["fp8"]["out"] > 0 and res["fp8"]["dx"] > 0, res


def test_blockwise_fused_gradient_accumulation_adds_into_main_grad(runs):
    for r in runs:
        res = r["main_grad"]
        assert res["added"] and res["placeholder"], res
        assert res["err"] < 1e-2, res


def _columns(t, counts, fmt):
    """float64 of each group's rows through TE's 128x1 blocks (its columnwise copy)."""
    from megatron_overlap.kernels.fp8_quant import dequantize_blockwise, quantize_blockwise

    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    parts = [dequantize_blockwise(*quantize_blockwise(p.t().contiguous(), 1, dtype), 1).t()
             for p in t.split(counts) if p.shape[0]]
    return torch.cat(parts)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_block_expert_linear_gemms_are_the_float64_products_of_the_recipes_operands(fmt):
    """forward x(1x128) W(128x128)^T, dgrad dy(1x128) W, wgrad dy(128x1)^T x(128x1), each
    group's columns blocked from its first row; an empty group and a group past 128 rows
    (a second, partial column block)."""
    from megatron_overlap.kernels.fp8_quant import dequantize_blockwise, quantize_blockwise
    from megatron_overlap.ops import block_dequantized_weights, block_expert_linear

    g = torch.Generator().manual_seed(12)
    counts = [9, 0, 150, 30]
    x = (torch.randn(sum(counts), 256, generator=g) * 3).bfloat16().requires_grad_(True)
    params = [(torch.randn(160, 256, generator=g) * 0.2).bfloat16().requires_grad_(True)
              for _ in counts]
    weight = block_dequantized_weights(torch.stack([p.detach() for p in params]))
    y = block_expert_linear(x, torch.tensor(counts), weight, params, grad_format=fmt)
    # (rows of magnitudes far apart: a 128 x 1 block holds values its scale makes
    # subnormal or zero where the row's own 1 x 128 block keeps them)
    dy = (torch.randn(y.shape, generator=g) * torch.logspace(-14, -3, y.shape[0])[:, None]
          ).bfloat16()
    y.backward(dy)
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    rows = dequantize_blockwise(*quantize_blockwise(x.detach(), 1), 1)
    dy_rows = dequantize_blockwise(*quantize_blockwise(dy, 1, dtype), 1)
    expert = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    w = weight.double()[expert]
    for got, want in ((y, torch.einsum("rk,rnk->rn", rows, w)),
                      (x.grad, torch.einsum("rn,rnk->rk", dy_rows, w))):
        assert (got.double() - want).abs().max() <= 2 ** -7 * want.abs().max()
    dy_cols, x_cols = _columns(dy, counts, fmt), _columns(x.detach(), counts, "e4m3")
    for e, p in enumerate(params):
        part = expert == e
        want = dy_cols[part].t() @ x_cols[part]
        assert (p.grad.double() - want).abs().max() <= 2 ** -7 * want.abs().max().clamp_min(1e-30)
    assert (params[1].grad == 0).all()  # (the empty group)
    # the columnwise blocks are not the rowwise ones here: this check tells them apart
    assert not torch.equal(dy_cols, dy_rows)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_block_kernels_are_tes_quantizer_exactly_in_bf16(fmt):
    """Rows (1x128), each group's columns (128x1 from its first row) and 128x128 weight
    blocks, interpreted, against TE's quantizer emulated: subnormal values of the format,
    a zero block, an empty group, a partial last block, rows past the last group."""
    from megatron_overlap.kernels.fp8_blocks import (
        fake_quantize_columns, fake_quantize_columns_reference, fake_quantize_rows,
        fake_quantize_rows_reference, fake_quantize_weights, fake_quantize_weights_reference)

    g = torch.Generator().manual_seed(13)
    x = (torch.randn(300, 200, generator=g)
         * torch.logspace(-7, 3, 300)[:, None]).bfloat16()  # (small rows: subnormals)
    x[:40, :128] = 0
    ends = [0, 33, 33, 200, 290]  # (10 rows past the last group)
    assert torch.equal(fake_quantize_rows(x, fmt), fake_quantize_rows_reference(x, fmt))
    cols = fake_quantize_columns(x, torch.tensor(ends, dtype=torch.int32), fmt)
    want = fake_quantize_columns_reference(x, ends, fmt)
    assert torch.equal(cols[:290], want[:290]) and (cols[:290] != x[:290]).any()
    w = (torch.randn(3, 300, 200, generator=g) * torch.logspace(-30, 2, 300)[None, :, None])
    w[1, :128, :128] = 0
    assert torch.equal(fake_quantize_weights(w), fake_quantize_weights_reference(w))


@pytest.mark.parametrize("bad, match", [
    (dict(grad_format="e4m4"), "grad_format must be one of"),
    (dict(params=[torch.zeros(16, 32)] * 3), "params must be the stack's 4 weights"),
    (dict(counts_dev=torch.tensor([4, 4])), "counts_dev / counts must give the 4 experts"),
    (dict(weight=torch.zeros(4, 16, 32)), "weight must be the dequantized stack"),
    (dict(x=torch.zeros(8, 32)), "x must be \\[R, 32\\] bf16"),
])
def test_block_expert_linear_refuses_bad_arguments_by_name(bad, match):
    from megatron_overlap.ops import block_expert_linear

    args = dict(x=torch.zeros(8, 32, dtype=torch.bfloat16), counts_dev=torch.tensor([2] * 4),
                weight=torch.zeros(4, 16, 32, dtype=torch.bfloat16),
                params=[torch.zeros(16, 32)] * 4)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        block_expert_linear(**args)


@pytest.mark.parametrize("fp32_quantizer", [None, "fp8_quant_fwd_inp", "fp8_quant_fwd_weight",
                                            "fp8_quant_bwd_grad"])
def test_blockwise_takes_the_grouped_path_only_while_every_scale_is_a_power_of_two(
        monkeypatch, fp32_quantizer):
    """TE's recipe in force read per call: fp32 scales on the inputs, the weights or (in
    training) the gradients make a dequantized operand inexact, so the call keeps TE's
    path (`block_scales_exact`)."""
    from types import SimpleNamespace

    import mcore_shims

    mcore_shims.install()
    from megatron_overlap.mcore import te_fp8

    recipe = SimpleNamespace(**{name: SimpleNamespace(power_2_scale=name != fp32_quantizer)
                                for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight",
                                             "fp8_quant_bwd_grad")})
    state = SimpleNamespace(get_fp8_recipe=lambda: recipe)
    monkeypatch.setattr(te_fp8, "gemm_module",
                        lambda fc2: SimpleNamespace(FP8GlobalStateManager=state))
    experts = SimpleNamespace(linear_fc2=None)
    assert te_fp8.block_scales_exact(experts) is (fp32_quantizer is None)
