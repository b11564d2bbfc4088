"""OverlapMoELayer over Megatron's TEGroupedMLP under the FP8 recipes, on CPU.

TE needs CUDA, so its FP8 GroupedLinear is a double (tests/te_fp8_double.py: TE's
quantizers emulated, TE's attribute names, the GEMM called through the module's
`general_grouped_gemm`); Megatron's TEGroupedMLP around it is the real one, with its
padding to 16 rows per expert. Checked: the layer fuses, TE's FC2 GEMM is skipped and
the op computes it from the quantized operands (padding dropped), the output and every
gradient (FC2's from TE's node through `grad_sink`) match the stock FP8 layer's; what
cannot fuse is said at build. The GPU test with real TE: tests/test_mcore_te_fp8_gpu.py.
"""

import pytest
import torch

from dist_harness import run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backends")

RECIPES = ("tensorwise", "delayed", "blockwise")


def on_tes_path(layer):
    """`layer` with the grouped FP8 experts taking none of its calls (`GroupedFp8()`), as
    where they refuse them (delayed scaling, `delay_wgrad_compute`, blockwise's fp32
    scales): TE's GroupedLinear quantizes and its FC2 node runs dgrad and wgrad, the path
    these tests check (the grouped one: test_mcore_fp8_training.py,
    test_fp8_block_training.py)."""
    from megatron_overlap.mcore.fp8_experts import GroupedFp8

    layer._grouped = GroupedFp8()
    return layer


def _opt_in(blockwise: bool = True):
    """FP8 layers fused, blockwise too (the path these tests check, off by default)."""
    from megatron_overlap.mcore.policy import LayerPolicy

    return LayerPolicy(fp8=True, fp8_blockwise=blockwise)


def _fp8_spec():
    from te_fp8_double import GroupedLinearFp8Double
    from test_mcore_te_experts import _te_moe_spec

    return _te_moe_spec(GroupedLinearFp8Double)


def _fp8_config(world, recipe, **overrides):
    from test_mcore_layer import _config

    return _config(1, world, **{**dict(
        fp8="e4m3", fp8_recipe=recipe, bf16=True, params_dtype=torch.bfloat16,
        moe_shared_expert_intermediate_size=None), **overrides})


def _fp8_scenarios(rank, world):
    import warnings

    import mcore_shims
    import te_fp8_double

    mcore_shims.install()
    te_fp8_double.install()
    from megatron.core import parallel_state as ps
    from test_mcore_layer import _rel_diff, _run

    from megatron_overlap.mcore.spec import with_overlap_moe
    from megatron_overlap.ops import OverlapConfig

    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(12, 2, 32, generator=g).bfloat16()
    grad = torch.randn(12, 2, 32, generator=g).bfloat16()
    spec, found = _fp8_spec(), {}
    for recipe in RECIPES:
        config = _fp8_config(world, recipe)
        torch.manual_seed(1234)
        stock = spec(config=config)
        te_fp8_double.CALLS["gemm"] = 0
        ref = _run(stock, x, grad)
        stock_gemms = te_fp8_double.CALLS["gemm"]
        for backend in ("reference", "interpret"):
            layer = on_tes_path(with_overlap_moe(spec, OverlapConfig(backend=backend),
                                                 _opt_in())(config=config))
            layer.load_state_dict(stock.state_dict())
            te_fp8_double.CALLS["gemm"] = 0
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message="megatron-overlap")
                out, dx, grads = _run(layer, x, grad)
            found[(recipe, backend)] = dict(
                out=_rel_diff(out, ref[0]), dx=_rel_diff(dx, ref[1]),
                dw={k: _rel_diff(grads[k], ref[2][k]) for k in ref[2]},
                grad_names=sorted(grads) == sorted(ref[2]), dtype=out.dtype,
                reason=layer.unsupported_reason, fused=layer.last_path.fused,
                gemms=(te_fp8_double.CALLS["gemm"], stock_gemms))
    found["cache"] = _weight_cache(spec, world, x)
    found["outside_autocast"] = _outside_autocast(spec, world, x, grad)
    refusals = {}
    for name, overrides, policy in (
            ("mxfp8", dict(fp8_recipe="mxfp8"), _opt_in()),
            ("fc2_bias", dict(add_bias_linear=True, bias_dropout_fusion=False), _opt_in()),
            ("not_opted_in", {}, None),
            ("blockwise_not_opted_in", dict(fp8_recipe="blockwise"), _opt_in(False)),
            ("fp32_activations", dict(bf16=False, params_dtype=torch.float32), _opt_in())):
        config = _fp8_config(world, overrides.pop("fp8_recipe", "tensorwise"), **overrides)
        layer = with_overlap_moe(spec, OverlapConfig(backend="reference"), policy)(
            config=config)
        refusals[name] = layer.unsupported_reason
    found["refusals"] = refusals
    found["pricing"] = _fp8_pricing(spec, world)
    ps.destroy_model_parallel()
    return found


def _fp8_pricing(spec, world):
    """(the blockwise layer's fuse-or-not predictions, `fusion_decision`'s with fp8 =
    "block", and with bf16 operands) under H200's preset with a "block" family whose
    GEMM2 wave is half bf16's (a preset file written for the test)."""
    import dataclasses
    import json
    import os
    import tempfile

    from megatron_overlap.mcore.spec import with_overlap_moe
    from megatron_overlap.mcore.support import stock_launches
    from megatron_overlap.ops import OverlapConfig, fusion_decision
    from megatron_overlap.planner import get_preset
    from megatron_overlap.planner import Fp8Family

    h200 = get_preset("h200")
    family = Fp8Family(h200.calibration, h200.step_costs.wave_us / 2)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(dataclasses.replace(h200, fp8={"block": family}).to_json(), f)
    try:
        config = OverlapConfig(backend="interpret", preset=f.name)
        layer = with_overlap_moe(spec, config, _opt_in())(
            config=_fp8_config(world, "blockwise"))
        tokens = 12 * 2 * world
        got = layer._fusion_for(torch.empty(tokens, 32, dtype=torch.bfloat16), False)
        want = {kind: fusion_decision(
            num_tokens=tokens, hidden=32, ffn=16, topk=2, local_experts=4 // world,
            experts=4, dtype=torch.bfloat16, device=torch.device("cpu"),
            group=layer.token_dispatcher.tp_ep_group, config=config,
            stock_launches=stock_launches(layer), fp8=kind) for kind in ("block", None)}
    finally:
        os.unlink(f.name)
    return [(d.fused_us, d.unfused_us) for d in (got, want["block"], want[None])]


def _weight_cache(spec, world, x):
    """The stacked e4m3 FC2 weights across calls: kept while TE reads its cached FP8
    weights, built again when TE quantizes them again (a step's first microbatch)."""
    from megatron_overlap.mcore.spec import with_overlap_moe
    from megatron_overlap.ops import OverlapConfig

    layer = on_tes_path(with_overlap_moe(spec, OverlapConfig(backend="reference"), _opt_in())(
        config=_fp8_config(world, "tensorwise")))
    stack, fc2 = layer._stacks.fc2_fp8, layer.experts.linear_fc2
    with torch.no_grad():
        first = layer(x)[0]
        built = stack._value
        again = layer(x)[0]
        kept = stack._value is built
        fc2.weight0.mul_(2.0)  # an optimizer step; the next step's first microbatch:
        fc2.is_first_microbatch = True
        stepped = layer(x)[0]
    return dict(kept=kept and torch.equal(first, again), rebuilt=stack._value is not built,
                changed=not torch.equal(stepped, first))


def _outside_autocast(spec, world, x, grad):
    """An FP8 layer called outside TE's FP8 autocast (TE computes FC2 in bf16): the call
    runs stock, after one warning, with stock's output."""
    import warnings

    import te_fp8_double
    from test_mcore_layer import _run

    from megatron_overlap.mcore.spec import with_overlap_moe
    from megatron_overlap.ops import OverlapConfig

    config = _fp8_config(world, "tensorwise")
    torch.manual_seed(1234)
    stock = spec(config=config)
    layer = with_overlap_moe(spec, OverlapConfig(backend="reference"), _opt_in())(
        config=config)
    layer.load_state_dict(stock.state_dict())
    te_fp8_double.FP8GlobalStateManager.enabled = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out, ref = _run(layer, x, grad)[0], _run(stock, x, grad)[0]
        direct = _direct_call_error(layer, x)
    finally:
        te_fp8_double.FP8GlobalStateManager.enabled = True
    return dict(fused=layer.last_path.fused, same=torch.equal(out, ref), direct=direct,
                warned=[str(w.message) for w in caught if "megatron-overlap" in str(w.message)])


def _direct_call_error(layer, x):
    """The FC2 operands asked for where TE computed FC2 in bf16: a named error."""
    from megatron_overlap.mcore.te_fp8 import te_fp8_fc2

    rows = x.reshape(-1, x.shape[-1])
    counts = [rows.shape[0]] + [0] * (layer.num_local_experts - 1)
    try:
        te_fp8_fc2(layer.experts, layer._stacks.fc2_fp8, rows, counts,
                   torch.ones(rows.shape[0], dtype=rows.dtype))
    except RuntimeError as err:
        return str(err)
    return None


@pytest.fixture(scope="module", params=[1, 2], ids=["TP1EP1", "TP1EP2"])
def fp8_runs(request):
    return run_ranks(request.param, _fp8_scenarios)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_fp8_te_experts_fuse_skip_tes_fc2_gemm_and_match_stock_fp8(fp8_runs, recipe,
                                                                    backend):
    """The op's GEMM2 on TE's quantized operands equals TE's GEMM on them (fp32 sums,
    bf16 y), the padding rows dropped; TE's FC2 node, fed dL/dy by the op, gives FC2's
    and, through FC1, every other parameter's gradient as stock does, bit for bit."""
    for r in fp8_runs:
        res = r[(recipe, backend)]
        assert res["reason"] is None and res["fused"], res
        assert res["gemms"] == (1, 2), res  # FC1's GEMM ran, FC2's was the op's
        assert res["dtype"] == torch.bfloat16 and res["grad_names"], res
        assert res["out"] < 2e-2 and res["dx"] < 2e-2, res
        # TE's node gets stock's dL/dy: every parameter's gradient is stock's, bit for bit
        # (x's differs by the permutation backward's rounding: fp32 sums rounded once)
        assert all(d == 0.0 for d in res["dw"].values()), res["dw"]


def test_fp8_layers_that_cannot_fuse_say_why_at_build(fp8_runs):
    for r in fp8_runs:
        assert "--fp8-recipe mxfp8" in r["refusals"]["mxfp8"], r["refusals"]
        assert "FC2 bias under FP8" in r["refusals"]["fc2_bias"], r["refusals"]
        assert "without --moe-overlap-fp8" in r["refusals"]["not_opted_in"], r["refusals"]
        assert "without --moe-overlap-fp8-blockwise" in r["refusals"][
            "blockwise_not_opted_in"], r["refusals"]
        assert "writes bf16" in r["refusals"]["fp32_activations"], r["refusals"]


def test_fp8_weights_stack_once_while_te_reads_its_cached_fp8_weights(fp8_runs):
    for r in fp8_runs:
        assert r["cache"] == dict(kept=True, rebuilt=True, changed=True), r["cache"]


def test_an_fp8_layers_fuse_or_not_prices_its_recipes_kernel_family(fp8_runs):
    """A blockwise layer asks fuse-or-not for its "block" family (a GEMM2 wave half
    bf16's here): the predictions `fusion_decision(fp8="block")` makes, below bf16's."""
    for r in fp8_runs:
        layer, block, bf16 = r["pricing"]
        assert layer == pytest.approx(block), r["pricing"]
        assert block[0] < bf16[0] and block[1] < bf16[1], r["pricing"]


def test_an_fp8_layer_outside_tes_fp8_autocast_runs_stock_after_one_warning(fp8_runs):
    for r in fp8_runs:
        res = r["outside_autocast"]
        assert not res["fused"] and res["same"], res
        assert "computed no FP8 GEMM" in (res["direct"] or ""), res
        assert len(res["warned"]) <= 1 and all("outside TE's FP8 autocast" in w
                                               for w in res["warned"]), res


@pytest.mark.parametrize("back_to_back", [True, False])
def test_tes_per_expert_fp8_rows_join_without_their_padding(back_to_back):
    """x from TE's per-expert tensors: a view of one bulk allocation, one row gather where
    padding sits between the experts' rows, or one copy of separate tensors."""
    from megatron_overlap.mcore.te_fp8 import _joined, padded_places

    counts, padded = [5, 0, 16, 3], [16, 0, 16, 16]
    bulk = torch.arange(sum(padded) * 4, dtype=torch.uint8).reshape(-1, 4)
    parts = list(bulk.split(padded)) if back_to_back else [
        t.clone() for t in bulk.split(padded)]
    want = torch.cat([t[:c] for t, c in zip(bulk.split(padded), counts)])
    got = _joined(parts, counts, padded_places(counts, padded, "cpu"))
    assert torch.equal(got, want)
    whole = _joined(parts, padded, padded_places(padded, padded, "cpu"))
    assert torch.equal(whole, bulk)
    if back_to_back:  # (nothing padded: the bulk allocation itself, no copy)
        assert whole.data_ptr() == bulk.data_ptr()


GEMMS_RUN = []


def general_grouped_gemm(weights, inputs, out, *args, **kwargs):
    """(TE's name, looked up by `te_fp8.gemm_module` in the module of _BF16GroupedLinear)"""
    GEMMS_RUN.append(len(weights))
    out[0].copy_(torch.cat([b @ a.t() for a, b in zip(weights, inputs)]))
    return out, None, None


class _BF16GroupedLinear(torch.nn.Module):
    """TE's GroupedLinear outside its FP8 autocast: the same GEMM call on bf16 tensors."""

    def forward(self, x, m_splits):
        out = x.new_empty(x.shape[0], 3)
        weights = [torch.ones(3, x.shape[1]) for _ in m_splits]
        general_grouped_gemm(weights, list(torch.split(x, m_splits)), [out])
        return out


def test_a_bf16_grouped_gemm_runs_as_tes_and_captures_nothing():
    """TE calls the same `general_grouped_gemm` in bf16: the skip records FP8 operands
    only, so a bf16 call computes its GEMM and leaves nothing for the op (which then
    raises its named error, `te_fp8_fc2`) instead of failing on a bf16 tensor."""
    from megatron_overlap.mcore.te_fp8 import _gemm_skipped

    captured, x = {}, torch.randn(5, 4)
    with _gemm_skipped(_BF16GroupedLinear(), captured):
        out = _BF16GroupedLinear()(x, [2, 3])
    assert captured == {} and GEMMS_RUN == [2]
    torch.testing.assert_close(out, x.sum(1, keepdim=True).expand(5, 3))
