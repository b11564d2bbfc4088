"""Delayed-scaling FP8 TEGroupedMLP on the grouped FP8 path (mcore/te_delayed.py), on CPU.

TE's FP8 GroupedLinear is the double of tests/te_fp8_double.py, which keeps TE's delayed
scaling state: per-GEMM scale and amax slots in `fp8_meta`, the amaxes recorded at each
cast, the forward's scales updated at the autocast's exit and the backward's by the
step's first FP8 module. Checked: over several training steps (weights changing between
them) a layer under `--fp8-recipe delayed` runs no GEMM of TE's GroupedLinear, its output
and gradients stay within FP8's own error of stock's, and TE's scaling state (every
scale and amax of FC1 and FC2, forward and backward) advances as stock's does, and a run
switched to stock after some steps goes on as stock's; the backward's update runs once a
step;
inference records the forward's amaxes and claims no first module. The grouped cast
with given scales equals TE's Float8Quantizer emulated, bit for bit.
"""

import pytest
import torch

from dist_harness import run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backends")

STEPS = 3


def _meta_of(layer) -> dict:
    """Copies of FC1's and FC2's scales and amax histories, forward and backward."""
    return {f"{fc}.{key}.{name}": getattr(getattr(layer.experts, fc).fp8_meta[key], name).clone()
            for fc in ("linear_fc1", "linear_fc2") for key in ("scaling_fwd", "scaling_bwd")
            for name in ("scale", "amax_history")}


def _train(layer, x, grad, steps: int, stock_from: int | None = None) -> tuple[list, dict]:
    """`steps` training steps inside the double's autocast, the weights changed after
    each (an optimizer's step; the next step's first microbatch quantizes them again);
    the (output, input grad, grads) of each and TE's state. `stock_from`: the overlap
    turned off from that step on (a run resumed with `--moe-overlap` off)."""
    import te_fp8_double
    from test_mcore_layer import _run

    state = te_fp8_double.FP8GlobalStateManager
    state.registered.clear()
    results = []
    for step in range(steps):
        if step == stock_from:
            layer.overlap_enabled = False
        for fc in (layer.experts.linear_fc1, layer.experts.linear_fc2):
            fc.is_first_microbatch = True  # (Megatron's set_is_first_microbatch: a new step)

        def forward():
            return _run(layer, x, grad)
        state.step(forward, lambda out: results.append(out))
        with torch.no_grad():
            for p in layer.experts.parameters():
                p.mul_(1.25)
    return results, _meta_of(layer)


def _training_scenarios(rank, world):
    import mcore_shims
    import te_fp8_double

    mcore_shims.install()
    te_fp8_double.install()
    from megatron.core import parallel_state as ps
    from test_mcore_fp8_training import _errors
    from test_mcore_te_fp8 import _fp8_config, _fp8_spec, _opt_in

    from megatron_overlap.mcore.spec import with_overlap_moe
    from megatron_overlap.ops import OverlapConfig

    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    g = torch.Generator().manual_seed(41 + rank)
    x = (torch.randn(12, 2, 32, generator=g) * 2).bfloat16()
    grad = torch.randn(12, 2, 32, generator=g).bfloat16()
    spec, found, state = _fp8_spec(), {}, te_fp8_double.FP8GlobalStateManager
    for fmt in ("e4m3", "hybrid"):
        config = _fp8_config(world, "delayed", fp8=fmt)
        torch.manual_seed(1234)
        stock = spec(config=config)
        initial = {k: v.clone() for k, v in stock.state_dict().items()}
        updates = dict(state.updates)
        want, want_meta = _train(stock, x, grad, STEPS)
        stock_updates = {k: state.updates[k] - updates[k] for k in updates}
        layer = with_overlap_moe(spec, OverlapConfig(backend="interpret"), _opt_in())(
            config=config)
        layer.load_state_dict(initial)
        te_fp8_double.CALLS["gemm"], updates = 0, dict(state.updates)
        got, got_meta = _train(layer, x, grad, STEPS)
        found[fmt] = dict(
            errors=[_errors(o, s) for o, s in zip(got, want)],
            meta={k: float((got_meta[k] - v).abs().max() / v.abs().max().clamp_min(1e-30))
                  for k, v in want_meta.items()},
            fc1_input_amax=torch.equal(got_meta["linear_fc1.scaling_fwd.amax_history"][:, 0::3],
                                       want_meta["linear_fc1.scaling_fwd.amax_history"][:, 0::3]),
            scales_moved=bool((want_meta["linear_fc2.scaling_bwd.scale"] != 1).any()),
            updates=({k: state.updates[k] - updates[k] for k in updates}, stock_updates),
            gemms=te_fp8_double.CALLS["gemm"], grouped=layer.last_path.grouped_fp8,
            fused=layer.last_path.fused, refusal=layer.grouped_fp8_training_refusal,
            brackets=[getattr(layer.experts, fc).brackets for fc in ("linear_fc1", "linear_fc2")])
        found[fmt + "_switched"] = _switched(spec, config, initial, x, grad, want[-1],
                                             want_meta)
    found["inference"] = _inference(spec, world, x)
    ps.destroy_model_parallel()
    return found


def _switched(spec, config, initial, x, grad, want_last, want_meta):
    """The steps with --moe-overlap, the last with it off: that step against stock's."""
    from test_mcore_fp8_training import _errors
    from test_mcore_te_fp8 import _opt_in

    from megatron_overlap.mcore.spec import with_overlap_moe
    from megatron_overlap.ops import OverlapConfig

    layer = with_overlap_moe(spec, OverlapConfig(backend="reference"), _opt_in())(
        config=config)
    layer.load_state_dict(initial)
    after, meta = _train(layer, x, grad, STEPS, stock_from=STEPS - 1)
    return dict(errors=_errors(after[-1], want_last), fused=layer.last_path.fused,
                meta=max(float((meta[k] - v).abs().max() / v.abs().max().clamp_min(1e-30))
                         for k, v in want_meta.items()))


def _inference(spec, world, x):
    """An eval call without gradients: the grouped path, the forward's amaxes recorded,
    the backward's untouched, the first-module claim left for a module that trains."""
    import te_fp8_double
    from test_mcore_te_fp8 import _fp8_config, _opt_in

    from megatron_overlap.mcore.spec import with_overlap_moe
    from megatron_overlap.ops import OverlapConfig

    state = te_fp8_double.FP8GlobalStateManager
    layer = with_overlap_moe(spec, OverlapConfig(backend="reference"), _opt_in())(
        config=_fp8_config(world, "delayed")).eval()
    state.IS_FIRST_FP8_MODULE = True
    with torch.no_grad():
        layer(x)
    meta = _meta_of(layer)
    return dict(grouped=layer.last_path.grouped_fp8, first_left=state.IS_FIRST_FP8_MODULE,
                fwd_amax=bool((meta["linear_fc2.scaling_fwd.amax_history"][0, 0::3] > 0).all()),
                bwd_amax=bool((meta["linear_fc1.scaling_bwd.amax_history"] == 0).all()))


@pytest.fixture(scope="module", params=[1, 2], ids=["TP1EP1", "TP1EP2"])
def runs(request):
    return run_ranks(request.param, _training_scenarios)


def test_delayed_training_runs_no_te_gemm_and_stays_within_fp8_error_of_stock(runs):
    """e4m3 and hybrid over several steps: the grouped path every step, TE's GEMM never;
    output and every gradient within FP8's error of stock's at each step (the stale
    scales of delayed scaling included: steps after the first quantize with the scales
    the previous step's amaxes made)."""
    for r in runs:
        for fmt in ("e4m3", "hybrid"):
            res = r[fmt]
            assert res["fused"] and res["grouped"] and res["gemms"] == 0, (fmt, res)
            assert res["refusal"] is None and res["brackets"] == [0, 0], (fmt, res)
            # (one FP8 step each way, e5m2's for hybrid's gradients; stock's double runs
            # its dgrad / wgrad in float64, ours on FP8 kernels)
            bound = 3 * 2 ** -3 if fmt == "hybrid" else 2 ** -2
            for step, errors in enumerate(res["errors"]):
                worst = max(errors.items(), key=lambda kv: kv[1])
                assert worst[1] <= bound, (fmt, step, worst)


def test_delayed_training_advances_tes_scaling_state_as_stock_does(runs):
    """Every scale and amax slot of FC1 and FC2, forward and backward, after the steps:
    FC1's input amaxes equal stock's bit for bit (the same rows); the rest within the
    FP8 error of the tensors they were taken from (h and dL/dy come out of other GEMMs).
    The backward's scales moved off their initial 1, and the backward's update ran once
    a step in both arms."""
    for r in runs:
        for fmt in ("e4m3", "hybrid"):
            res = r[fmt]
            assert res["fc1_input_amax"] and res["scales_moved"], (fmt, res)
            worst = max(res["meta"].items(), key=lambda kv: kv[1])
            assert worst[1] <= 0.1, (fmt, worst)
            ours, stock = res["updates"]
            assert ours == stock == {True: STEPS, False: STEPS}, res["updates"]


def test_delayed_run_switched_to_stock_continues_tes_scaling_state(runs):
    """Two steps with --moe-overlap, the third with it off (stock's TE GroupedLinear on the
    state the grouped path left): the third step's output and gradients and TE's state
    after it within FP8's error of three stock steps."""
    for r in runs:
        for fmt in ("e4m3", "hybrid"):
            res = r[fmt + "_switched"]
            assert not res["fused"], res
            bound = 3 * 2 ** -3 if fmt == "hybrid" else 2 ** -2
            assert max(res["errors"].values()) <= bound and res["meta"] <= 0.1, (fmt, res)


def test_delayed_inference_records_the_forwards_amaxes_only(runs):
    for r in runs:
        res = r["inference"]
        assert res["grouped"] and res["fwd_amax"] and res["bwd_amax"], res
        assert res["first_left"], res


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gathered"])
def test_delayed_group_cast_is_tes_float8_quantizer(dtype, gather, monkeypatch):
    """Each group cast with its given scale from strided views of TE's scale and amax
    history (a stale scale saturating too), its amax folded in by max (a larger amax
    already recorded is kept), under the Triton interpreter against the per-group
    emulation of TE's Float8Quantizer; the rows gathered while casting too."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from megatron_overlap.kernels.fp8_rows import quantize_groups, quantize_groups_reference

    g = torch.Generator().manual_seed(12)
    x = (torch.randn(70, 48, generator=g) * torch.logspace(-3, 3, 70)[:, None]).bfloat16()
    src = torch.randperm(70, generator=g)[:66] if gather else None
    counts = [20, 0, 33, 10]  # (3 padding rows)
    ends = torch.tensor(counts).cumsum(0)
    scale = torch.rand(12, generator=g) * 8
    history = torch.rand(2, 12, generator=g) * 50
    history[0, 10] = 1e6  # (group 3's slot: larger than any amax here, kept)
    scale[10] = 1e4  # (group 3's scale, stale: its largest rows saturate)
    want_history = history.clone()
    got = quantize_groups(x, ends, src, dtype, scale[1::3], history[0][1::3])
    want = quantize_groups_reference(x, counts, src, dtype, scale[1::3], want_history[0][1::3])
    assert torch.equal(got[0].float(), want[0].float())
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert torch.equal(history, want_history) and history[0, 10] == 1e6
    assert (got[0].float().abs() == torch.finfo(dtype).max).any()  # (saturated somewhere)


@pytest.mark.parametrize("bad, match", [
    (dict(scale=torch.ones(4)), "scale and amax_into go together"),
    (dict(scale=torch.ones(3), amax_into=torch.zeros(3)), r"scale must be fp32 \[4\]"),
    (dict(scale=torch.ones(4), amax_into=torch.zeros(4, dtype=torch.float64)),
     r"amax_into must be fp32 \[4\]"),
])
def test_delayed_group_cast_refuses_bad_scales_by_name(bad, match):
    from megatron_overlap.kernels.fp8_rows import quantize_groups

    with pytest.raises(ValueError, match=match):
        quantize_groups(torch.ones(8, 16), torch.tensor([2, 4, 6, 8]), **bad)


def test_delayed_refusal_names_a_grouped_linear_without_tes_slots():
    from megatron_overlap.mcore.te_delayed import delayed_refusal

    class Linear:
        num_gemms = 2

    assert "_offsets" in delayed_refusal(Linear()) and "prepare_forward" in delayed_refusal(Linear())


def test_quantize_fp8_groups_refuses_delayed_scales_of_another_type_by_name():
    from megatron_overlap.ops import quantize_fp8_groups

    with pytest.raises(TypeError, match="delayed must be a DelayedScales"):
        quantize_fp8_groups(torch.ones(8, 16), torch.tensor([4, 8]),
                            delayed=(torch.ones(2), torch.zeros(2)))
