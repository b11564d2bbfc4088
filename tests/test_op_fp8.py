"""gemm2_gather_rs on FP8 operands (TE's per-tensor and blockwise scales) on CPU: the
interpret and reference backends against the float64 product of the dequantized
operands combined by token, on one rank and on two (gloo)."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from dist_harness import run_ranks
from megatron_overlap.kernels.gemm2_fp8 import check_operands
from megatron_overlap.ops import Fp8Scales, OverlapConfig, OverlapSession, gemm2_gather_rs
from megatron_overlap.ops import residency
from megatron_overlap.ops.config import GPU_TILES, INTERPRET_TILES
from megatron_overlap.ops.fp8 import fp8_tiles
from routing_cases import fp8_reference, fp8_routed_problem

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backends")

INTERP = OverlapConfig(backend="interpret")
ROW_ORDER = OverlapConfig(backend="interpret",
                          tiles=dataclasses.replace(INTERPRET_TILES, token_major=False))
REF = OverlapConfig(backend="reference")
# K = 272: three 128-wide K steps, the last partial; expert 1 gets no rows
TOKENS, TOPK, EXPERTS, FFN, HIDDEN = 24, 2, 4, 272, 48
CASES = [("tensor", False), ("tensor", True), ("block", False)]
CASE_IDS = ["tensor", "tensor_per_expert_x", "block"]


def problem(kind, per_expert_x=False, **kw):
    case = dict(tokens=TOKENS, experts=EXPERTS, topk=TOPK, ffn=FFN, hidden=HIDDEN,
                empty=(1,), seed=3)
    return fp8_routed_problem(kind, per_expert_x, **{**case, **kw})


def call(p, config, probs=True, tokens=TOKENS, group=None, **kw):
    return gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"], tokens, TOPK,
                           p["probs"] if probs else None, group, config=config,
                           scales=p["scales"], **kw)


def combined_fp64(p, tokens, probs=True):
    """([M, N] float64 sums over each token's rows of the dequantized product (times
    probs), the same sums of absolute values): the op's value and its error's scale."""
    y, mag = fp8_reference(p)
    w = p["probs"].double()[:, None] if probs else 1.0
    sums = [torch.zeros(tokens, HIDDEN, dtype=torch.float64).index_add_(0, p["token_index"], t)
            for t in (y * w, y.abs() * w + mag * 2.0 ** -16)]
    return sums[0], sums[1]


def assert_near(out, ref, scale):
    """Every element within a few bf16 roundings (y, the probs' product, the output) of
    the float64 value, measured on its own terms' magnitude: a scale read from another
    block (powers of two apart, `block_graded`) is far outside."""
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    err = (out.double() - ref).abs()
    assert (err <= 2.0 ** -5 * scale).all(), float((err / scale.clamp_min(1e-30)).max())


@pytest.mark.parametrize("kind, per_expert_x", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("config", [INTERP, ROW_ORDER, REF], ids=["token_major", "row_order",
                                                                   "reference"])
def test_fp8_op_matches_the_fp64_product_of_the_dequantized_operands(kind, per_expert_x,
                                                                    config):
    p = problem(kind, per_expert_x)
    assert p["counts"][1] == 0 and len(set(p["counts"].tolist())) > 2  # uneven, one empty
    ref, scale = combined_fp64(p, TOKENS)
    out = call(p, config)
    assert out.shape == (TOKENS, HIDDEN)
    assert_near(out, ref, scale)
    if config is not REF:  # the same bits for every C and L
        assert torch.equal(call(p, config, comm_ctas=3, splits=3), out)


@pytest.mark.parametrize("kind", ["tensor", "block"])
@pytest.mark.parametrize("token_major", [True, False])
def test_fp8_launch_writes_every_output_element_and_y_is_the_fp64_product(kind, token_major):
    """A prepared FP8 call on NaN-poisoned outputs: every element written, the op's bits;
    y (token-major or in GEMM2's row order) near the float64 product row by row; the
    session's reference on the handle's routing near both; FP8 runs BLOCK_K = 128."""
    config = INTERP if token_major else ROW_ORDER
    p = problem(kind)
    session = OverlapSession(None, "cpu", config)
    handle = session.prepare(p["x"], p["weight"], p["counts"], p["token_index"], TOKENS,
                             TOPK, scales=p["scales"])
    tiles = handle.launch_plan.tiles
    assert tiles.token_major == token_major
    assert tiles.block_k == 128  # (FP8: `fp8_tiles`)
    out = torch.full((TOKENS, HIDDEN), float("nan"), dtype=torch.bfloat16)
    y = session.launch_kernels(handle, p["x"], p["weight"], out)
    handle.buffer.check()
    assert torch.equal(out, session(p["x"], p["weight"], p["counts"], p["token_index"],
                                    TOKENS, TOPK, scales=p["scales"]))
    ref, scale = combined_fp64(p, TOKENS, probs=False)
    assert_near(out, ref, scale)
    rows = y[handle.routing.dest.long()] if token_major else y
    y_ref, mag = fp8_reference(p)
    assert_near(rows, y_ref, y_ref.abs() + mag * 2.0 ** -11)
    assert_near(session.reference(handle, p["x"], p["weight"]), ref, scale)


def _with(p, **changes):
    return {**p, **changes}


def _bad_calls():
    """(name, p -> the call's arguments changed, error, message) of calls the op refuses
    before anything runs."""
    def scales(p, **kw):
        s = p["scales"]
        return Fp8Scales(**{**dict(kind=s.kind, x_scale_inv=s.x_scale_inv,
                                   w_scale_inv=s.w_scale_inv), **kw})

    return [
        ("uint8 x", lambda p: _with(p, x=p["x"].view(torch.uint8)), ValueError,
         "view TE's raw FP8 data"),
        ("e5m2 weight", lambda p: _with(p, weight=p["weight"].float().to(torch.float8_e5m2)),
         ValueError, "e5m2 is TE's gradient format"),
        ("no scales", lambda p: _with(p, scales=None), ValueError, "FP8 operands need scales"),
        ("bf16 with scales", lambda p: _with(p, x=p["x"].bfloat16(),
                                             weight=p["weight"].bfloat16()),
         ValueError, "x must be float8_e4m3fn"),
        ("a tuple of scales", lambda p: _with(p, scales=tuple(vars(p["scales"]).values())),
         TypeError, "scales must be an Fp8Scales"),
        ("tensor scales per expert", lambda p: _with(p, scales=scales(
            p, w_scale_inv=p["scales"].w_scale_inv[:2])), ValueError, "must hold E = 4"),
        ("block x scales", lambda p: _with(p, scales=scales(
            p, kind="block", x_scale_inv=torch.ones(1, 48), w_scale_inv=torch.ones(4, 1, 3))),
         ValueError, "x_scale_inv must be .ceil.K/128. = 3"),
        ("scales off x's device", lambda p: _with(p, scales=scales(
            p, w_scale_inv=p["scales"].w_scale_inv.to("meta"))), ValueError,
         "must be on x's device"),
        ("weight needs grads", lambda p: _with(p, weight=p["weight"].clone().requires_grad_()),
         ValueError, "must not require grad"),
        ("a Gluon GEMM2", lambda p: _with(p, config=OverlapConfig(
            backend="interpret", tiles=dataclasses.replace(GPU_TILES, gemm_impl="gluon"))),
         ValueError, "Gluon kernel"),
    ]


@pytest.mark.parametrize("name, change, error, message", _bad_calls(),
                         ids=[c[0] for c in _bad_calls()])
def test_fp8_calls_the_op_cannot_run_raise_a_named_error(name, change, error, message):
    p = change(problem("tensor"))
    with pytest.raises(error, match=message):
        call(p, p.get("config", INTERP))


@pytest.mark.parametrize("config", [INTERP, REF], ids=["interpret", "reference"])
def test_fp8_backward_hands_the_rows_gradient_to_grad_sink_and_probs_get_theirs_from_y(
        config):
    """Training on FP8 operands: the output is the no-gradient call's, bit for bit; the
    sink receives each row's token gradient times its probability, and probs the dot
    of that gradient with y (the fp64 product rounded to bf16 as the kernel's y)."""
    p = problem("block")
    with torch.no_grad():
        plain = call(p, config)
    sink = torch.randn(p["x"].shape[0], HIDDEN, requires_grad=True)
    probs = p["probs"].clone().requires_grad_()
    out = gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"], TOKENS, TOPK,
                          probs, config=config, scales=p["scales"], grad_sink=sink)
    assert torch.equal(out, plain)
    g = torch.randn(TOKENS, HIDDEN).bfloat16()
    out.backward(g)
    rows = g[p["token_index"]].float()
    torch.testing.assert_close(sink.grad, rows * p["probs"][:, None], rtol=2 ** -7, atol=0)
    y = fp8_reference(p)[0].to(torch.bfloat16).double()
    want = (rows.double() * y).sum(1)
    torch.testing.assert_close(probs.grad.double(), want, rtol=1e-2, atol=1e-2 * float(
        (rows.double().abs() * y.abs()).sum(1).max()))


@pytest.mark.parametrize("config", [INTERP, REF], ids=["interpret", "reference"])
def test_bf16_operands_with_a_grad_sink_hand_it_the_rows_gradient_and_keep_their_output(
        config):
    """Blockwise training's GEMM2 (bf16 operands, the recipe's dgrad and wgrad in the
    caller's node): the output is the no-gradient call's, bit for bit, and the sink gets
    each row's token gradient times its probability, as under FP8 operands."""
    p = problem("tensor")
    x, weight = p["x_hp"].bfloat16(), p["weight"].float().bfloat16()
    args = (x, weight, p["counts"], p["token_index"], TOKENS, TOPK, p["probs"])
    with torch.no_grad():
        plain = gemm2_gather_rs(*args, config=config)
    sink = torch.zeros(x.shape[0], HIDDEN, requires_grad=True)
    out = gemm2_gather_rs(*args, config=config, grad_sink=sink)
    assert torch.equal(out, plain)
    g = torch.randn(TOKENS, HIDDEN).bfloat16()
    out.backward(g)
    torch.testing.assert_close(sink.grad, g[p["token_index"]].float() * p["probs"][:, None],
                               rtol=2 ** -7, atol=0)


def test_a_prepared_fp8_launch_takes_grad_sink_and_refuses_one_of_other_rows():
    p = problem("block")
    session = OverlapSession(None, "cpu", INTERP)
    handle = session.prepare(p["x"], p["weight"], p["counts"], p["token_index"], TOKENS,
                             TOPK, scales=p["scales"])
    sink = torch.zeros(p["x"].shape[0], HIDDEN, requires_grad=True)
    session.launch(handle, p["x"], p["weight"], grad_sink=sink).float().sum().backward()
    rows_with_probs = sink.grad.abs().sum(1) > 0  # (every row's token gradient is 1)
    assert rows_with_probs.all()
    with pytest.raises(ValueError, match=r"grad_sink must be \[T, N\]"):
        session.launch(handle, p["x"], p["weight"],
                       grad_sink=torch.zeros(3, HIDDEN, requires_grad=True))
    with pytest.raises(ValueError, match="fp8 must be None or one of"):
        session.warm_up(HIDDEN, TOPK, fp8="rowwise")


def _sink_misuse():
    rows = TOKENS * TOPK
    return [
        ("bf16_operands_needing_grads", dict(scales=None),
         torch.zeros(rows, HIDDEN, requires_grad=True), ValueError,
         "goes either to grad_sink's node or to x and weight"),
        ("sink_without_grad", {}, torch.zeros(rows, HIDDEN), ValueError,
         "does not require grad"),
        ("integer_sink", {}, torch.zeros(rows, HIDDEN, dtype=torch.int32), TypeError,
         "floating-point"),
    ]


@pytest.mark.parametrize("name, change, sink, error, message", _sink_misuse(),
                         ids=[c[0] for c in _sink_misuse()])
def test_grad_sink_misuse_is_a_named_error(name, change, sink, error, message):
    p = problem("tensor")
    if "scales" in change:
        p = dict(p, x=p["x_hp"].bfloat16().requires_grad_(),
                 weight=p["weight"].float().bfloat16())
    with pytest.raises(error, match=message):
        gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"], TOKENS, TOPK,
                        config=INTERP, scales=change.get("scales", p["scales"]),
                        grad_sink=sink)


def test_warm_up_compiles_the_fp8_families_apart_and_the_call_compiles_nothing():
    session = OverlapSession(None, "cpu", INTERP)
    session.warm_up(HIDDEN, TOPK)
    bf16 = set(session.families)
    session.warm_up(HIDDEN, TOPK, fp8="tensor")
    tensor = set(session.families) - bf16
    families = session.warm_up(HIDDEN, TOPK, fp8="block")
    block = set(session.families) - bf16 - tensor
    assert {k.fp8 for k in bf16} == {None} and {k.fp8 for k in tensor} == {"tensor"}
    assert {k.fp8 for k in block} == {"block"} and len(tensor) == len(bf16) == len(block)
    # FP8 on bf16's tiles but BLOCK_K = 128
    assert {dataclasses.replace(k.tiles, block_k=128) for k in bf16} == {
        k.tiles for k in tensor} == {k.tiles for k in block}
    assert {f.tiles.block_k for f in families} == {128} and "FP8 block" in str(min(
        block, key=str))
    for kind in ("tensor", "block"):
        p = problem(kind)
        session(p["x"], p["weight"], p["counts"], p["token_index"], TOKENS, TOPK,
                scales=p["scales"])
    assert session.families.at_call == []


@pytest.mark.parametrize("fp8", [None, "tensor", "block"])
def test_residency_compiles_the_fp8_kernel_with_scales_in_tes_layouts(monkeypatch, fp8):
    """o_comp of an FP8 family is read from a compile of the FP8 kernel (the compiles
    stubbed here: no CUDA), whose operands pass the kernel's own checks."""
    seen = {}
    binary = SimpleNamespace(n_regs=168, n_spills=0, _init_handles=lambda: None,
                             metadata=SimpleNamespace(num_warps=4, shared=65536))

    def gemm2(x, w, y, *args, scales=None, block_k, impl, warmup, **kw):
        check_operands(x, w, y, scales, block_k, impl)
        seen.update(dtype=x.dtype, kind=scales and scales.kind, warmup=warmup)
        return binary

    monkeypatch.setattr(residency.gemm2, "launch_grouped_gemm2", gemm2)
    monkeypatch.setattr(residency.grs, "launch_gather_rs", lambda *a, **kw: binary)
    flags = tuple(torch.zeros(8, dtype=torch.int32) for _ in range(3))
    o_comp, *_ = residency.compiled_occupancies(torch.device("cpu"), flags,
                                                fp8_tiles(GPU_TILES, fp8), 32, 512, 2, fp8)
    assert o_comp >= 1 and seen["warmup"] and seen["kind"] == fp8
    assert seen["dtype"] == (torch.bfloat16 if fp8 is None else torch.float8_e4m3fn)


# ----------------------------------------------------------------- two ranks (gloo)
def _two_rank_fp8(rank, world):
    import torch.distributed as dist

    group, results = dist.group.WORLD, {}
    for name, kind, ep in (("tp2_block", "block", 1), ("ep2_tensor", "tensor", 2)):
        p = problem(kind, True, rank=rank, world=world, ep=ep, seed=5)
        ref, scale = combined_fp64(p, TOKENS)
        for t in (ref, scale):
            dist.all_reduce(t)
        share = slice(rank * TOKENS // world, (rank + 1) * TOKENS // world)
        outs = [call(p, cfg, group=group, **kw) for cfg, kw in (
            (INTERP, {}), (INTERP, dict(comm_ctas=3, splits=3)), (REF, {}))]
        err = max(float(((o.double() - ref[share]).abs() / scale[share]).max()) for o in outs)
        results[name] = dict(err=err, bitwise=torch.equal(outs[0], outs[1]),
                             finite=all(not o.isnan().any() for o in outs))
    return results


def test_two_ranks_fp8_match_the_fp64_sum_over_ranks_with_the_same_bits_for_c_and_l():
    for rank, res in enumerate(run_ranks(2, _two_rank_fp8)):
        for name, r in res.items():
            assert r["finite"] and r["bitwise"] and r["err"] <= 2.0 ** -5, (rank, name, r)
            assert not math.isnan(r["err"])
