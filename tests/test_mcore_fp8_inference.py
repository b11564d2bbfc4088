"""FP8 TEGroupedMLP in inference on the grouped FP8 path (mcore/fp8_experts.py), on CPU.

TE's FP8 GroupedLinear is the double of tests/te_fp8_double.py (TE's quantizers
emulated). Checked: under tensorwise in eval mode without gradients the layer runs FC1
and FC2 without TE's GroupedLinear GEMMs, its quantization is TE's bit for bit, its
output matches the stock FP8 layer's within FP8's own error, the permuted rows are
gathered while quantized (never written in bf16), the weights are quantized once per
change; delayed scaling the same with TE's scaling state (training:
test_fp8_delayed.py); blockwise runs its exactly dequantized operands on the bf16
grouped kernels.
"""

import contextlib

import pytest
import torch

from dist_harness import run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backends")


def _eval_no_grad(layer, x):
    layer.eval()
    with torch.no_grad():
        return layer(x)[0]


def _scenarios(rank, world):
    import mcore_shims
    import te_fp8_double

    mcore_shims.install()
    te_fp8_double.install()
    from megatron.core import parallel_state as ps
    from test_mcore_layer import _rel_diff
    from test_mcore_te_fp8 import _fp8_config, _fp8_spec, _opt_in

    from megatron_overlap.mcore.spec import with_overlap_moe
    from megatron_overlap.ops import OverlapConfig

    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    g = torch.Generator().manual_seed(11 + rank)
    x = (torch.randn(12, 2, 32, generator=g) * 3).bfloat16()
    spec, found = _fp8_spec(), {}
    torch.manual_seed(1234)  # (the same weights: bf16 stock, FP8's own error beside)
    bf16_stock = spec(config=_fp8_config(world, "tensorwise"))
    te_fp8_double.FP8GlobalStateManager.enabled = False  # (TE outside its autocast: bf16)
    try:
        bf16 = _eval_no_grad(bf16_stock, x)
    finally:
        te_fp8_double.FP8GlobalStateManager.enabled = True
    for recipe in ("tensorwise", "delayed", "blockwise"):
        config = _fp8_config(world, recipe)
        torch.manual_seed(1234)
        stock = spec(config=config)
        ref = _eval_no_grad(stock, x)
        layer = with_overlap_moe(spec, OverlapConfig(backend="interpret"), _opt_in())(
            config=config)
        layer.load_state_dict(stock.state_dict())
        te_fp8_double.CALLS["gemm"] = 0
        with _gathers_recorded() as gathers, _fc1_inputs_recorded() as fc1_inputs:
            out = _eval_no_grad(layer, x)
        found[recipe] = dict(gathers=gathers, refusal=layer.grouped_fp8_refusal, out=_rel_diff(out, ref), fp8_error=_rel_diff(ref, bf16),
                             fused=layer.last_path.fused,
                             gemms=te_fp8_double.CALLS["gemm"],
                             own=layer._stacks.fc1_own_fp8._value is not None,
                             own_block=layer._stacks.fc1_own_block._value is not None,
                             fc1_on_block_grid=[_on_block_grid(t) for t in fc1_inputs])
        if recipe == "tensorwise":
            found["cache"] = _cache(layer, x)
        if recipe == "blockwise":
            found["fp32_scales"] = _with_fp32_block_scales(layer, x, ref)
    ps.destroy_model_parallel()
    return found


def _with_fp32_block_scales(layer, x, ref):
    """A call under a blockwise recipe whose scales are not powers of two (TE's
    NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1): its dequantized operands would not be exact,
    so the call keeps TE's path."""
    from types import SimpleNamespace

    import te_fp8_double
    from test_mcore_layer import _rel_diff

    fp32 = SimpleNamespace(power_2_scale=False)
    recipe = SimpleNamespace(fp8_quant_fwd_inp=fp32, fp8_quant_fwd_weight=fp32)
    te_fp8_double.FP8GlobalStateManager.get_fp8_recipe = classmethod(lambda cls: recipe)
    te_fp8_double.CALLS["gemm"] = 0
    try:
        out = _eval_no_grad(layer, x)
    finally:
        del te_fp8_double.FP8GlobalStateManager.get_fp8_recipe
    return dict(grouped=layer.last_path.grouped_fp8, fused=layer.last_path.fused,
                gemms=te_fp8_double.CALLS["gemm"], out=_rel_diff(out, ref))


@contextlib.contextmanager
def _fc1_inputs_recorded():
    """The rows the blockwise path's FC1 reads, recorded (the routed ones)."""
    from megatron_overlap.mcore import fp8_experts

    real, seen = fp8_experts.grouped_fc1_activation, []

    def recorded(mlp, weight, bias, x, tokens_per_expert, probs, activation=None,
                 device_counts=None, valid_rows=None):
        counts = device_counts if tokens_per_expert is None else tokens_per_expert
        seen.append(x.detach()[:int(sum(counts))].clone())  # (past them: padding)
        return real(mlp, weight, bias, x, tokens_per_expert, probs, activation,
                    device_counts, valid_rows)
    fp8_experts.grouped_fc1_activation = recorded
    try:
        yield seen
    finally:
        fp8_experts.grouped_fc1_activation = real


def _on_block_grid(rows) -> bool:
    """Are the rows values of TE's 1x128 e4m3 blocks (unchanged by another pass through
    them, as only such values are) and not all zero?"""
    from megatron_overlap.ops import block_dequantized

    return bool(rows.abs().max() > 0) and torch.equal(block_dequantized(rows), rows)


@contextlib.contextmanager
def _gathers_recorded():
    """The dispatcher's permutations in the block: did each gather its rows (bf16)?"""
    from megatron_overlap.mcore.dispatch import OverlapAllGatherDispatcher

    real, gathers = OverlapAllGatherDispatcher._select, []

    def recorded(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        gathers.append(out is not None)
        return out
    OverlapAllGatherDispatcher._select = recorded
    try:
        yield gathers
    finally:
        OverlapAllGatherDispatcher._select = real


def _cache(layer, x):
    """The e4m3 weights across eval calls: kept, then built again after a weight changed."""
    stack = layer._stacks.fc2_own_fp8
    built = stack._value
    again = _eval_no_grad(layer, x)
    kept = stack._value is built
    with torch.no_grad():
        layer.experts.linear_fc2.weight0.mul_(2.0)  # an optimizer step, in place
    changed = _eval_no_grad(layer, x)
    return dict(kept=kept, rebuilt=stack._value is not built,
                changed=not torch.equal(changed, again))


@pytest.fixture(scope="module", params=[1, 2], ids=["TP1EP1", "TP1EP2"])
def runs(request):
    return run_ranks(request.param, _scenarios)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_per_tensor_inference_runs_no_te_gemm_and_matches_stock_fp8(runs, recipe):
    """TE's quantization bit for bit (current scaling's, or delayed scaling's with the
    scales of TE's state), other GEMMs of the same product (their bf16 FC1 output may
    round an element of h to the neighbouring e4m3 value): no further from stock FP8's
    output than stock FP8's is from stock bf16's (the issue's bound)."""
    for r in runs:
        res = r[recipe]
        assert res["fused"] and res["own"] and res["gemms"] == 0, res
        assert res["gathers"] == [False], res  # (gathered while quantized, never in bf16)
        assert res["refusal"] is None, res
        assert 0 < res["fp8_error"] and res["out"] <= res["fp8_error"], res


def test_blockwise_inference_runs_no_te_gemm_on_exactly_dequantized_operands(runs):
    """Blockwise through its power-of-two blocks and back onto the bf16 grouped kernels:
    TE's e4m3 operands' exact values, fp32 sums; no further from stock FP8's output than
    stock FP8's is from stock bf16's (an element of h may round to the neighbouring e4m3
    value after FC1's bf16 output, as under tensorwise)."""
    for r in runs:
        res = r["blockwise"]
        assert res["fused"] and res["own_block"] and res["gemms"] == 0, res
        assert not res["own"] and res["refusal"] is None, res
        assert res["gathers"] == [True], res  # (the tokens blocked, then gathered)
        assert res["fc1_on_block_grid"] == [True], res  # FC1 reads the blocked rows
        assert 0 < res["fp8_error"] and res["out"] <= res["fp8_error"], res


def test_blockwise_with_fp32_scales_keeps_tes_path_where_dequantizing_is_not_exact(runs):
    for r in runs:
        res = r["fp32_scales"]
        assert res["fused"] and not res["grouped"] and res["gemms"] == 1, res
        assert res["out"] < 2e-2, res  # (TE's quantization, the op's block GEMM2)


def test_inference_fp8_weights_quantize_once_per_change(runs):
    for r in runs:
        assert r["cache"] == dict(kept=True, rebuilt=True, changed=True), r["cache"]


def test_grouped_quantization_is_tes_per_expert_current_scaling_bit_for_bit():
    """The kernel's e4m3 values, group and row scale_inv equal TE's quantizer emulated per
    expert (kernels/fp8_quant.py), with empty groups, padding rows, values at rounding
    ties and past 448, a tiny amax and a zero one."""
    from megatron_overlap.kernels.fp8_rows import quantize_groups, quantize_groups_reference

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(90, 160, generator=g) * 4).bfloat16()
    x[0:4] = 0.0  # the first group: amax 0 -> scale 1
    x[9, :8] = torch.tensor([127.97, -127.97, 232.0, 240.0, 1e-3, -1e-3, 2**-10, 448.5])
    x[20:24] *= 1e-30  # a group of tiny values: an infinite scale -> FLT_MAX
    counts = [4, 0, 16, 4, 56]  # 80 rows; 10 padding rows
    ends = torch.tensor(counts).cumsum(0)
    data, group_scale_inv, row_scale_inv = quantize_groups(x, ends)
    ref = quantize_groups_reference(x, counts)
    assert torch.equal(data.float(), ref[0].float())  # (-0 and +0 aside: the interpreter's)
    assert torch.equal(group_scale_inv, ref[1]) and torch.equal(row_scale_inv, ref[2])
    assert group_scale_inv[0] == 1.0 and group_scale_inv[1] == 1.0
    assert (data[80:].float() == 0).all() and (row_scale_inv[80:] == 0).all()


def test_grouped_quantization_gathering_by_token_equals_quantizing_the_permuted_rows():
    from megatron_overlap.kernels.fp8_rows import quantize_groups

    g = torch.Generator().manual_seed(4)
    tokens = (torch.randn(24, 96, generator=g) * 2).bfloat16()
    src = torch.randint(0, 24, (50,), generator=g)
    src[44:] = 10 ** 9  # padding rows' tokens: never read
    ends = torch.tensor([7, 30, 30, 44])
    gathered = quantize_groups(tokens, ends, src)
    permuted = quantize_groups(tokens[src[:44]], ends)
    assert torch.equal(gathered[0][:44].float(), permuted[0].float())
    assert torch.equal(gathered[1], permuted[1]) and torch.equal(gathered[2][:44], permuted[2])
    assert (gathered[0][44:].float() == 0).all()


def test_grouped_fp8_linear_is_the_dequantized_product():
    from megatron_overlap.ops import fp8_grouped_linear, quantize_fp8_groups, quantize_fp8_stack

    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 32, generator=g).bfloat16()
    w = (torch.randn(3, 16, 32, generator=g) * 0.1).bfloat16()
    ends = torch.tensor([10, 10, 40])
    xq, _, rows = quantize_fp8_groups(x, ends)
    wq, ws = quantize_fp8_stack(w)
    y = fp8_grouped_linear(xq, rows, wq, ws, ends)
    expert = torch.tensor([0] * 10 + [2] * 30)
    want = torch.einsum("rk,rnk->rn", xq.double() * rows.double()[:, None],
                        wq.double()[expert] * ws.double()[expert][:, None, None])
    assert y.dtype == torch.bfloat16
    assert (y.double() - want).abs().max() <= 2 ** -7 * want.abs().max()
    bf16 = torch.einsum("rk,rnk->rn", x.double(), w.double()[expert])
    assert (y.double() - bf16).abs().max() < 0.1 * bf16.abs().max()  # (FP8's own error)


@pytest.mark.parametrize("bad, match", [
    (dict(ends=torch.tensor([1.0, 2.0])), "ends must be a 1-D integer"),
    (dict(x=torch.zeros(4, 8, dtype=torch.int32)), "bf16 / fp16 / fp32"),
])
def test_grouped_quantization_refuses_bad_arguments_by_name(bad, match):
    from megatron_overlap.ops import quantize_fp8_groups

    args = dict(x=torch.zeros(4, 8), ends=torch.tensor([2, 4]))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        quantize_fp8_groups(**args)


@pytest.mark.parametrize("bad, match", [
    (dict(xq=torch.zeros(4, 32)), "must be e4m3"),
    (dict(wq=torch.zeros(2, 8, 16, dtype=torch.float8_e4m3fn)), "do not match"),
    (dict(ends=torch.tensor([4])), "do not match"),
    (dict(row_scale_inv=torch.ones(3)), "row_scale_inv must be \\[4\\]"),
])
def test_grouped_fp8_linear_refuses_bad_arguments_by_name(bad, match):
    from megatron_overlap.ops import fp8_grouped_linear

    args = dict(xq=torch.zeros(4, 32, dtype=torch.float8_e4m3fn), row_scale_inv=torch.ones(4),
                wq=torch.zeros(2, 8, 32, dtype=torch.float8_e4m3fn), w_scale_inv=torch.ones(2),
                ends=torch.tensor([1, 4]))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        fp8_grouped_linear(**args)


def test_quantizing_a_weight_stack_needs_three_dimensions():
    from megatron_overlap.ops import quantize_fp8_stack

    with pytest.raises(ValueError, match="stack \\[E, N, K\\]"):
        quantize_fp8_stack(torch.zeros(8, 16))


def test_block_dequantization_is_tes_blockwise_quantizer_exactly_in_bf16():
    """The kernel's rows equal TE's 1x128 quantizer emulated then dequantized in float64
    (power-of-two scales: the bf16 values are the e4m3 operand's exactly), with a zero
    block, a tiny one, values past 448 x scale, and a last block narrower than 128."""
    from megatron_overlap.kernels.fp8_blocks import fake_quantize_rows
    from megatron_overlap.kernels.fp8_quant import dequantize_blockwise, quantize_blockwise
    from megatron_overlap.ops import block_dequantized

    g = torch.Generator().manual_seed(12)
    x = (torch.randn(40, 300, generator=g) * 5).bfloat16()
    x[3, :128] = 0.0
    x[4, 128:256] *= 1e-30
    x[5, 7] = 3e4
    out = fake_quantize_rows(x)
    want = dequantize_blockwise(*quantize_blockwise(x, 1), 1)
    assert out.dtype == torch.bfloat16 and torch.equal(out.double(), want)
    assert (out[3, :128] == 0).all() and torch.equal(block_dequantized(x), out)
    assert 0 < (out.float() - x.float()).abs().max() <= 0.07 * x.float().abs().max()


def test_block_dequantized_weights_are_each_experts_128_blocks_exactly():
    from megatron_overlap.kernels.fp8_quant import dequantize_blockwise, quantize_blockwise
    from megatron_overlap.ops import block_dequantized_weights

    g = torch.Generator().manual_seed(13)
    w = torch.randn(3, 200, 160, generator=g).bfloat16()  # (blocks straddle no expert)
    out = block_dequantized_weights(w)
    for e in range(3):
        want = dequantize_blockwise(*quantize_blockwise(w[e], 128), 128)
        assert torch.equal(out[e].double(), want)
    with pytest.raises(ValueError, match="stack \\[E, N, K\\]"):
        block_dequantized_weights(w[0])
