"""FP8 TEGroupedMLP trained on the grouped FP8 path (ops/fp8_train.py), on CPU.

TE's FP8 GroupedLinear is the double of tests/te_fp8_double.py (TE's quantizers emulated,
its backward in float64 from the forward's FP8 operands). Checked: under `--fp8-format
e4m3 --fp8-recipe tensorwise` a training call runs no GEMM of TE's GroupedLinear; its
output, input and every parameter gradient are no further from stock FP8's than stock
FP8's are from stock bf16's, under `hybrid` (e5m2 gradients) too; Megatron's fused gradient accumulation gets the weight gradients
in main_grad. The operator's dgrad and wgrad are the float64 products of their
quantized operands, and the wgrad's column layout keeps every group's start aligned.
"""

import pytest
import torch

from dist_harness import run_ranks

from megatron_overlap.ops import GradFp8

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backends")


def _arms(spec, config, x, grad, backend):
    """(stock FP8, ours) forward + backward on the same weights, and TE's GEMM count."""
    import te_fp8_double
    from test_mcore_layer import _run
    from test_mcore_te_fp8 import _opt_in

    from megatron_overlap.mcore.spec import with_overlap_moe
    from megatron_overlap.ops import OverlapConfig

    torch.manual_seed(1234)
    stock = spec(config=config)
    ref = _run(stock, x, grad)
    layer = with_overlap_moe(spec, OverlapConfig(backend=backend), _opt_in())(config=config)
    layer.load_state_dict(stock.state_dict())
    te_fp8_double.CALLS["gemm"] = 0
    ours = _run(layer, x, grad)
    return ref, ours, layer, te_fp8_double.CALLS["gemm"]


def _errors(a, b) -> dict:
    from test_mcore_layer import _rel_diff

    return dict(out=_rel_diff(a[0], b[0]), dx=_rel_diff(a[1], b[1]),
                **{k: _rel_diff(a[2][k], b[2][k]) for k in b[2]})


def _scenarios(rank, world):
    import mcore_shims
    import te_fp8_double

    mcore_shims.install()
    te_fp8_double.install()
    from megatron.core import parallel_state as ps
    from test_mcore_te_fp8 import _fp8_config, _fp8_spec

    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    g = torch.Generator().manual_seed(21 + rank)
    x = (torch.randn(12, 2, 32, generator=g) * 2).bfloat16()
    grad = torch.randn(12, 2, 32, generator=g).bfloat16()
    spec, found = _fp8_spec(), {}
    config = _fp8_config(world, "tensorwise")
    te_fp8_double.FP8GlobalStateManager.enabled = False  # (TE outside its autocast: bf16)
    try:
        bf16, _, _, _ = _arms(spec, config, x, grad, "reference")
    finally:
        te_fp8_double.FP8GlobalStateManager.enabled = True
    for backend in ("reference", "interpret"):
        stock, ours, layer, gemms = _arms(spec, config, x, grad, backend)
        found[backend] = dict(
            ours=_errors(ours, stock), fp8=_errors(stock, bf16), gemms=gemms,
            fused=layer.last_path.fused, grouped=layer.last_path.grouped_fp8,
            names=sorted(ours[2]) == sorted(stock[2]),
            refusal=layer.grouped_fp8_training_refusal)
    found["pricing"] = _pricing(spec, config, world)
    hybrid = _fp8_config(world, "tensorwise", fp8="hybrid")
    stock, ours, layer, gemms = _arms(spec, hybrid, x, grad, "interpret")
    found["hybrid"] = dict(ours=_errors(ours, stock), fp8=found["reference"]["fp8"],
                           gemms=gemms, grouped=layer.last_path.grouped_fp8,
                           refusal=layer.grouped_fp8_training_refusal)
    found["main_grad"] = _main_grad(spec, world, x, grad)
    ps.destroy_model_parallel()
    return found


def _pricing(spec, config, world):
    """The fuse-or-not's stock launches and T_unfused on the grouped FP8 path and off it
    (H200's shipped calibration: the CPU has none)."""
    from test_mcore_te_fp8 import _opt_in

    from megatron_overlap.mcore.spec import with_overlap_moe
    from megatron_overlap.mcore.support import stock_launches
    from megatron_overlap.ops import OverlapConfig

    layer = with_overlap_moe(spec, OverlapConfig(backend="interpret", preset="h200"),
                             _opt_in())(config=config)
    rows = torch.empty(24 * world, 32, dtype=torch.bfloat16)
    grouped, te = (layer._fusion_for(rows, False, flag) for flag in (True, False))
    return dict(experts=layer.num_local_experts, grouped=stock_launches(layer, True),
                te=stock_launches(layer), unfused=(grouped.unfused_us, te.unfused_us))


def _main_grad(spec, world, x, grad):
    """Under gradient_accumulation_fusion with DDP's main_grad: the weight gradients added
    there (twice over two backwards), grad_added_to_main_grad set, placeholders in .grad."""
    from test_mcore_layer import _run
    from test_mcore_te_fp8 import _fp8_config, _opt_in

    from megatron_overlap.mcore.spec import with_overlap_moe
    from megatron_overlap.ops import OverlapConfig

    config = _fp8_config(world, "tensorwise")
    torch.manual_seed(1234)
    layer = with_overlap_moe(spec, OverlapConfig(backend="reference"), _opt_in())(
        config=config)
    plain = _run(layer, x, grad)[2]
    config.gradient_accumulation_fusion = True
    fc2 = layer.experts.linear_fc2
    weights = [getattr(fc2, f"weight{i}") for i in range(fc2.num_gemms)]
    for w in weights:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
        w.grad_added_to_main_grad = False
    _run(layer, x, grad)
    _run(layer, x, grad)
    want = torch.stack([plain[f"experts.linear_fc2.weight{i}"].float() * 2
                        for i in range(len(weights))])
    got = torch.stack([w.main_grad for w in weights])
    return dict(added=all(w.grad_added_to_main_grad for w in weights),
                err=float((got - want).abs().max() / want.abs().max()),
                placeholder=all(w.grad is not None and w.grad.shape == w.shape
                                for w in weights))


@pytest.fixture(scope="module", params=[1, 2], ids=["TP1EP1", "TP1EP2"])
def runs(request):
    return run_ranks(request.param, _scenarios)


def test_tensorwise_e4m3_training_runs_no_te_gemm_and_matches_stock_fp8(runs):
    """FP8 dgrad and wgrad of the grouped path (its gradients quantized as TE's are; the
    double's backward is not): output and every gradient no further from stock FP8's
    than stock FP8's are from stock bf16's."""
    for r in runs:
        for backend in ("reference", "interpret"):
            res = r[backend]
            assert res["fused"] and res["grouped"] and res["gemms"] == 0, res
            assert res["refusal"] is None and res["names"], res
            for key, err in res["ours"].items():
                bound = max(res["fp8"][key], 2 ** -4)  # (FP8's own error, or e4m3's step)
                assert err <= bound, (backend, key, err, res["fp8"][key])
            assert res["fp8"]["out"] > 0 and res["fp8"]["dx"] > 0, res


def test_hybrid_fp8_training_runs_e5m2_gradients_on_the_grouped_path(runs):
    """`--fp8-format hybrid`: dL/dy in e5m2 (TE's), carried in e4m3 to the FP8 dgrad and
    wgrad; output and gradients no further from stock FP8's than
    stock FP8's from bf16's, or than a step of each requantized operand (the double's
    backward multiplies the forward's operands and an unquantized dL/dy: e5m2's 2^-3
    and e4m3's 2^-4)."""
    for r in runs:
        res = r["hybrid"]
        assert res["grouped"] and res["gemms"] == 0 and res["refusal"] is None, res
        for key, err in res["ours"].items():
            floor = 2 ** -4 if key == "out" else 3 * 2 ** -4
            assert err <= max(res["fp8"][key], floor), (key, err, res["fp8"][key])


def test_the_fuse_or_not_prices_stocks_per_expert_fc1_and_quantization_on_the_grouped_path(runs):
    """On the grouped FP8 path stock's TE makes per expert two GEMMs and an amax and a
    cast for each of FC1's and FC2's inputs, where ours makes a few launches for all."""
    for r in runs:
        res = r["pricing"]
        assert res["grouped"] == 6 * res["experts"] and res["te"] == res["experts"], res
        assert res["unfused"][0] > res["unfused"][1], res


def test_fused_gradient_accumulation_adds_weight_gradients_into_main_grad(runs):
    for r in runs:
        res = r["main_grad"]
        assert res["added"] and res["placeholder"], res
        assert res["err"] < 1e-2, res


def _dequantized(rows):
    return rows.data.double() * rows.row_scale_inv.double()[:, None]


@pytest.mark.parametrize("grad_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
def test_fp8_expert_linear_gradients_are_the_float64_products_of_their_fp8_operands(
        grad_dtype):
    """dgrad dx[g] = dy[g] W_g and wgrad dW_g = dy[g]^T x[g] from dy quantized per group
    (TE's current scaling: e4m3, or hybrid's e5m2 at 57344 / amax, carried in e4m3)
    and the forward's e4m3 x and W; padding
    rows get zero, an empty group's weight gradient is zero."""
    from megatron_overlap.ops import (Fp8Rows, Fp8Stack, GradFp8, fp8_expert_linear,
                                      quantize_fp8_groups, quantize_fp8_stack)

    g = torch.Generator().manual_seed(8)
    x = (torch.randn(45, 32, generator=g) * 3).bfloat16().requires_grad_(True)
    params = [(torch.randn(16, 32, generator=g) * 0.2).bfloat16().requires_grad_(True)
              for _ in range(4)]
    ends = torch.tensor([9, 9, 30, 40])  # an empty group, 5 padding rows
    weight = Fp8Stack(*quantize_fp8_stack(torch.stack([p.detach() for p in params])))
    y = fp8_expert_linear(x, ends, weight, params, grad=GradFp8(grad_dtype))
    dy = (torch.randn(45, 16, generator=g) * 1e4).bfloat16()  # (past e4m3's range)
    y.backward(dy)
    dq = Fp8Rows(*quantize_fp8_groups(dy, ends, dtype=grad_dtype))
    assert dq.data.dtype == grad_dtype
    xq = Fp8Rows(*quantize_fp8_groups(x.detach(), ends))
    expert = torch.repeat_interleave(torch.arange(4), torch.diff(ends, prepend=torch.zeros(1, dtype=torch.long)))
    w = weight.data.double() * weight.scale_inv.double()[:, None, None]
    want_dx = torch.einsum("rn,rnk->rk", _dequantized(dq)[:40], w[expert])
    assert (x.grad[:40].double() - want_dx).abs().max() <= 2 ** -7 * want_dx.abs().max()
    assert (x.grad[40:] == 0).all()
    for e, p in enumerate(params):
        rows = expert == e
        want = _dequantized(dq)[:40][rows].t() @ _dequantized(xq)[:40][rows]
        assert (p.grad.double() - want).abs().max() <= 2 ** -7 * want.abs().max().clamp_min(1e-30)
    assert (params[1].grad == 0).all()  # (the empty group)


def test_e5m2_row_quantization_is_tes_current_scaling_bit_for_bit():
    """The kernel (interpreted) against TE's quantizer emulated: e5m2 subnormals, an empty
    group, padding rows."""
    from megatron_overlap.kernels.fp8_rows import quantize_groups, quantize_groups_reference

    g = torch.Generator().manual_seed(19)
    x = (torch.randn(50, 48, generator=g) * torch.logspace(-8, 4, 50)[:, None]).bfloat16()
    ends = torch.tensor([10, 10, 30, 44])
    got = quantize_groups(x, ends, dtype=torch.float8_e5m2)
    want = quantize_groups_reference(x, [10, 0, 20, 14], dtype=torch.float8_e5m2)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


def test_e5m2_values_carried_in_e4m3_are_e5m2s_products_above_2_to_the_minus_14():
    """Hybrid's gradients stored in e4m3 for e4m3-only GEMMs: the kernel (interpreted)
    equals its reference (values: the sign of a zero may differ); each dequantized value
    equals the e5m2 one wherever that is above 2^-13 of its group's largest, and is within
    2^-16 of it elsewhere; under current scaling and under delayed scales that saturate or
    leave e5m2's top unused (the first step's scale 1), amaxes as without the carrier."""
    from megatron_overlap.kernels.fp8_rows import quantize_groups, quantize_groups_reference

    g = torch.Generator().manual_seed(23)
    x = (torch.randn(50, 48, generator=g) * torch.logspace(-9, 3, 50)[:, None]).bfloat16()
    ends, counts = torch.tensor([10, 10, 30, 44]), [10, 0, 20, 14]
    e5m2, e4m3 = torch.float8_e5m2, torch.float8_e4m3fn
    expert = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    for scale in (None, torch.tensor([1.0, 1.0, 3e3, 2e-2])):
        def delayed():
            return {} if scale is None else dict(scale=scale.clone(), amax_into=torch.zeros(4))
        got_amax, plain_amax = delayed(), delayed()
        got = quantize_groups(x, ends, dtype=e5m2, carrier=e4m3, **got_amax)
        want = quantize_groups_reference(x, counts, dtype=e5m2, carrier=e4m3, **delayed())
        plain = quantize_groups_reference(x, counts, dtype=e5m2, **plain_amax)
        assert got[0].dtype == e4m3 and torch.equal(got[0].float(), want[0].float())
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
        carried = (got[0].double() * got[2].double()[:, None])[:44]
        values = (plain[0].double() * plain[2].double()[:, None])[:44]
        row_max = values.abs().amax(1)
        largest = torch.stack([row_max[expert == e].max() for e in expert.tolist()])[:, None]
        big = values.abs() > largest * 2 ** -13
        assert big.any() and (~big & (values != 0)).any()  # (both kinds of value seen)
        assert torch.equal(carried[big], values[big])
        assert ((carried - values).abs() <= largest * 2 ** -16).all()
        assert (got[0][44:].float() == 0).all() and (got[2][44:] == 0).all()
        if scale is not None:
            assert torch.equal(got_amax["amax_into"], plain_amax["amax_into"])
    with pytest.raises(ValueError, match="carrier"):
        quantize_groups(x, ends, dtype=e4m3, carrier=e5m2)


def test_wgrad_columns_start_every_group_at_a_multiple_of_16():
    """The rows of each group as columns from a multiple of 16, the rest zero, padding
    rows nowhere: the kernel (interpreted) and its pure-torch reference alike."""
    from megatron_overlap.kernels.fp8_columns import ALIGN, group_columns, group_columns_reference

    g = torch.Generator().manual_seed(9)
    q = (torch.randn(50, 24, generator=g) * 10).to(torch.float8_e4m3fn)
    ends = torch.tensor([3, 3, 20, 44])  # an empty group, 6 padding rows
    for layout in (group_columns, group_columns_reference):
        qt, column_ends = layout(q, ends)
        assert qt.dtype == torch.float8_e4m3fn and qt.shape[0] == 24
        assert qt.shape[1] % ALIGN == 0 and column_ends.dtype == torch.int32
        assert column_ends.tolist() == [16, 16, 48, 80]
        prev = 0
        for start, end, stop in zip([0, 16, 16, 48], ends.tolist(), column_ends.tolist()):
            width = end - prev
            assert torch.equal(qt[:, start:start + width].float(), q[prev:end].t().float())
            assert (qt[:, start + width:stop].float() == 0).all()
            prev = end
        assert (qt[:, 80:].float() == 0).all()  # (the padding rows: not copied)


def test_a_weight_stacks_transpose_is_each_experts_matrix_transposed():
    """The dgrad's weight operand: the kernel (interpreted) against torch's transpose, at
    sizes off its 64 x 64 tile."""
    from megatron_overlap.kernels.fp8_columns import transpose_stack
    from megatron_overlap.ops import Fp8Stack, quantize_fp8_stack, with_transposed

    g = torch.Generator().manual_seed(10)
    q = (torch.randn(3, 80, 48, generator=g) * 30).to(torch.float8_e4m3fn)
    out = transpose_stack(q)
    assert out.shape == (3, 48, 80) and out.dtype == torch.float8_e4m3fn
    assert torch.equal(out.view(torch.uint8), q.transpose(1, 2).contiguous().view(torch.uint8))
    stack = with_transposed(Fp8Stack(*quantize_fp8_stack(torch.randn(2, 32, 16))))
    assert torch.equal(stack.transposed.float(), stack.data.transpose(1, 2).float())
    assert with_transposed(stack) is stack  # (made once)


@pytest.mark.parametrize("bad, match", [
    (dict(params=[torch.zeros(16, 32)] * 3), "params must be the stack's 4 weights"),
    (dict(ends=torch.tensor([4, 8])), "do not match the stack"),
    (dict(weight=(None, None)), "weight must be an Fp8Stack"),
    (dict(grad="e4m3"), "grad must be a GradFp8"),
    (dict(grad=GradFp8(torch.bfloat16)), "grad.dtype must be torch.float8_e4m3fn or"),
])
def test_fp8_expert_linear_refuses_bad_arguments_by_name(bad, match):
    from megatron_overlap.ops import Fp8Stack, fp8_expert_linear, quantize_fp8_stack

    weight = Fp8Stack(*quantize_fp8_stack(torch.ones(4, 16, 32)))
    args = dict(x=torch.ones(8, 32), ends=torch.tensor([2, 4, 6, 8]), weight=weight,
                params=[torch.zeros(16, 32)] * 4)
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        fp8_expert_linear(**args)


def test_tensorwise_grouped_gemms_are_refused_off_sm90_by_name(monkeypatch):
    from megatron_overlap.ops import scaled_grouped_mm_refusal as scaled_grouped_gemm_refusal

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    assert "sm100 GPU" in scaled_grouped_gemm_refusal()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert scaled_grouped_gemm_refusal() is None


@pytest.mark.parametrize("call, match", [
    (lambda ops: ops.with_transposed((None, None)), "weight must be an Fp8Stack"),
    (lambda ops: ops.stacked([]), "one or more tensors of one shape"),
    (lambda ops: ops.stacked([torch.zeros(4, 8), torch.zeros(4, 16)]), "one shape"),
    (lambda ops: ops.block_dequantized(torch.zeros(4, 8)), "must be \\[R, K\\] bf16"),
    (lambda ops: ops.block_dequantized(torch.zeros(8, dtype=torch.bfloat16)), "\\[R, K\\]"),
    (lambda ops: ops.block_dequantized(torch.zeros(4, 8, dtype=torch.bfloat16), "e4m4"),
     "fmt must be one of"),
    (lambda ops: ops.block_dequantized_columns(torch.zeros(4, 8, dtype=torch.bfloat16),
                                               torch.tensor([2.0, 4.0])), "ends must be a 1-D integer"),
    (lambda ops: ops.block_dequantized_columns(torch.zeros(4, 8), torch.tensor([2, 4])),
     "must be \\[R, K\\] bf16"),
])
def test_the_grouped_fp8_helpers_refuse_bad_arguments_by_name(call, match):
    from megatron_overlap import ops

    with pytest.raises((ValueError, TypeError), match=match):
        call(ops)
