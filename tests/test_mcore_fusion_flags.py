"""OverlapMoELayer under Megatron's own MoE fusions (`moe_permute_fusion`, `moe_router_fusion`)
on CPU ranks (gloo).

TE's fused permute / unpermute and fused top-k need CUDA, so on CPU they are replaced by
counting doubles that run Megatron's unfused code (same bits, `te_moe_doubles`): the
stock arm under the flags then is Megatron's path through TE's entry points, and the
claims are that the fused path under the flags gives the same result as without them,
never enters TE's permute or unpermute, while Megatron's router still runs its fused
top-k; and that the layer prices the stock path under the flag with TE's unpermute
(`stock_permute_fused`).
"""

import pytest
import torch

from dist_harness import run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backends")

LAYOUTS = {"TP1EP1": (1, 1), "TP1EP2": (1, 2)}  # deferred postprocess; single sync (EP)


def _flags(config, on: bool):
    """`config` with both fusions set (after TransformerConfig's TE check, which the
    doubles would not pass); the dispatcher and router read them at each call."""
    import dataclasses

    config = dataclasses.replace(config)
    config.moe_permute_fusion = config.moe_router_fusion = on
    return config


def _layout(tp, ep, rank, calls):
    import warnings

    from test_mcore_layer import _config, _moe_spec, _rel_diff, _run

    from megatron_overlap.mcore.policy import LayerPolicy
    from megatron_overlap.mcore.spec import with_overlap_moe
    from megatron_overlap.mcore.support import capture_refusal
    from megatron_overlap.ops import OverlapConfig

    g = torch.Generator().manual_seed(100 + rank)
    x, grad = torch.randn(12, 2, 32, generator=g), torch.randn(12, 2, 32, generator=g)
    spec, plain = _moe_spec("grouped"), _config(tp, ep)
    overlap, always = OverlapConfig(backend="interpret"), LayerPolicy(fuse="always")
    torch.manual_seed(1234)
    ref = _run(spec(config=plain), x, grad)  # stock, no fusions
    torch.manual_seed(1234)
    layer = with_overlap_moe(spec, overlap, always)(config=_flags(plain, True))
    seen = dict(calls)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="megatron-overlap")  # nothing refused
        flagged = _run(layer, x, grad)
    fused_calls = {k: calls[k] - seen[k] for k in calls}
    fused_plan = layer.last_plan is not None
    layer.config.moe_permute_fusion = layer.config.moe_router_fusion = False
    unflagged = _run(layer, x, grad)
    layer.config.moe_permute_fusion = layer.config.moe_router_fusion = True
    layer.overlap_enabled, seen = False, dict(calls)
    stock = _run(layer, x, grad)  # the stock arm under the flags: TE's entry points
    stock_calls = {k: calls[k] - seen[k] for k in calls}
    layer.overlap_enabled = True
    layer.eval()
    with torch.no_grad():
        inference = _rel_diff(layer(x)[0], stock_eval(spec, plain, x))
        rows = x.view(-1, 32)
        refusal = capture_refusal(layer, rows, layer._path(rows, None).host_counts)
    return dict(
        calls=fused_calls, stock_calls=stock_calls, fused=fused_plan, refusal=refusal,
        bits=all(torch.equal(a, b) for a, b in zip(flagged[:2], unflagged[:2]))
        and all(torch.equal(flagged[2][k], unflagged[2][k]) for k in flagged[2]),
        stock_bits=all(torch.equal(a, b) for a, b in zip(stock[:2], ref[:2])),
        out=_rel_diff(flagged[0], ref[0]), dx=_rel_diff(flagged[1], ref[1]),
        dw=max(_rel_diff(flagged[2][k], ref[2][k]) for k in ref[2]), inference=inference,
        pricing=_pricing(layer, tp, ep))


def stock_eval(spec, config, x):
    torch.manual_seed(1234)
    return spec(config=config).eval()(x)[0]


def _pricing(layer, tp, ep):
    """(the layer's fuse-or-not answer, `fusion_decision`'s with `stock_permute_fused`
    True, and with it False) under H200's step costs plus a BW_te 3x BW_comb (a preset
    file written for the test), for the gathered tokens of a call."""
    import dataclasses
    import json
    import os
    import tempfile

    from megatron_overlap.ops import fusion_decision
    from megatron_overlap.planner import get_preset

    data = get_preset("h200").to_json()
    data["step_costs"]["fused_combine_bytes_per_us"] = 3 * data["step_costs"][
        "combine_bytes_per_us"]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(data, f)
    saved, layer._fusion = layer.overlap_config, {}
    layer.overlap_config = dataclasses.replace(saved, preset=f.name)
    tokens = 12 * 2 * tp * ep
    try:
        got = layer._fusion_for(torch.empty(tokens, 32), False)  # (a training call)
        want = {flag: fusion_decision(
            num_tokens=tokens, hidden=32, ffn=16 // tp, topk=2, local_experts=4 // ep,
            experts=4, dtype=torch.float32, device=torch.device("cpu"),
            group=layer.token_dispatcher.tp_ep_group, config=layer.overlap_config,
            stock_permute_fused=flag) for flag in (True, False)}
    finally:
        layer.overlap_config, layer._fusion = saved, {}
        os.unlink(f.name)
    return got, want[True], want[False]


def _scenarios(rank, world):
    import te_moe_doubles

    te_moe_doubles.install()
    from megatron.core import parallel_state as ps

    calls = te_moe_doubles.CALLS
    results = {}
    for name, (tp, ep) in LAYOUTS.items():
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
        results[name] = _layout(tp, ep, rank, calls)
    ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def flag_runs():
    return run_ranks(2, _scenarios)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_path_under_moe_fusions_matches_stock_and_never_takes_tes_permute(flag_runs,
                                                                              layout):
    """Both flags on: our fused path gives the bits it gives without them (forward, input
    and weight gradients), the stock layer's values to fp32 rounding, calls neither TE
    permute nor unpermute, and Megatron's router still takes its fused top-k."""
    for rank, res in enumerate(flag_runs):
        r = res[layout]
        assert r["fused"] and r["bits"], (rank, r)
        assert r["out"] < 1e-5 and r["dx"] < 1e-5 and r["dw"] < 1e-5, (rank, r)
        assert r["calls"]["permute"] == r["calls"]["unpermute"] == 0, (rank, r)
        assert r["calls"]["topk"] > 0, (rank, r)
        assert r["inference"] < 1e-5, (rank, r)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stock_arm_under_moe_permute_fusion_stays_megatrons_through_tes_permute(flag_runs,
                                                                              layout):
    """Overlap off with the flags on: Megatron's own path, through TE's permute and
    unpermute entry points (the doubles: the unfused bits), never ours."""
    for rank, res in enumerate(flag_runs):
        r = res[layout]
        assert r["stock_bits"], (rank, r)
        assert r["stock_calls"]["permute"] > 0 and r["stock_calls"]["unpermute"] > 0, (rank, r)


def test_moe_permute_fusion_no_longer_refuses_a_captured_inference_forward(flag_runs):
    for rank, res in enumerate(flag_runs):
        assert res["TP1EP1"]["refusal"] is None, (rank, res["TP1EP1"]["refusal"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layer_prices_the_stock_path_with_tes_unpermute_under_moe_permute_fusion(flag_runs,
                                                                               layout):
    for res in flag_runs:
        got, te, megatron = res[layout]["pricing"]
        assert got == te and te.unfused_us < megatron.unfused_us, (got, te, megatron)
        assert te.fused_us == megatron.fused_us
