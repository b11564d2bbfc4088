"""The planner's fast paths decide exactly as the straightforward planner does
(`tests/planner_reference.py`: T(C) at every legal C, Algorithm 1's ties, L ranked from
fresh plans): the same C*, T(C*) (bit for bit), L and curve, over random workloads,
kernels, devices and calibrations, the shipped presets, the cache's reuse of what does
not read the routing, and the op's own planner (`ops.plans.Planner.plan`)."""

import dataclasses
import itertools
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megatron_overlap.ops import planning
from megatron_overlap.ops.plans import Planner
from megatron_overlap.planner import roofline
from megatron_overlap.ops.config import GPU_TILES, PARTITION_TILES, OverlapConfig
from megatron_overlap.planner import (Calibration, DeviceSpec, KernelSpec, PlanCache, Workload,
                                      get_preset, plan, ranking_calibration, solve)
from planner_reference import (reference_curve, reference_memory_t, reference_plan,
                               reference_solve)

workloads = st.builds(
    Workload,
    tokens=st.integers(1, 1 << 17),
    hidden=st.sampled_from([64, 1000, 1024, 2048, 4096, 7168]),
    ffn=st.integers(1, 4096),
    world=st.integers(1, 8),
    splits=st.sampled_from([1, 2, 3, 4, 5, 8, 16, 64]),
    expert_counts=st.lists(st.one_of(st.just(0), st.integers(0, 20000)), min_size=1,
                           max_size=64).map(tuple),
    groups=st.integers(1, 2),
    topk=st.one_of(st.none(), st.integers(1, 8)),
    local_topk=st.one_of(st.none(), st.sampled_from([0.25, 2.0, 6.0])),
).filter(lambda w: w.splits <= w.hidden)
kernels = st.builds(KernelSpec, st.sampled_from([16, 64, 128]), st.sampled_from([16, 128, 256]),
                    st.sampled_from([1, 8, 64, 128]), st.sampled_from([16, 512, 1024]),
                    st.integers(1, 3), st.integers(1, 4), st.booleans(), st.booleans())
calibrations = st.builds(
    Calibration,
    rho_ref=st.one_of(st.sampled_from([0.5, 1.59, 10.05, 1e-300, 1e290, 1e300]),
                      st.floats(0.01, 60)),
    k_ref=st.sampled_from([352, 704]), tm_ref=st.just(128), tn_ref=st.just(128),
    d_ref=st.integers(1, 4), c_max=st.integers(1, 200),
    tmc_ref=st.one_of(st.none(), st.just(64)), tnc_ref=st.one_of(st.none(), st.just(1024)),
    c_sat=st.one_of(st.none(), st.floats(0.5, 80)),
    k_epi=st.one_of(st.none(), st.just(971.4)),
    topk_ref=st.one_of(st.none(), st.just(4)),
    overlap_factor=st.one_of(st.none(), st.sampled_from([1.0, 1.7]), st.floats(0.3, 3)))


def same(a, b) -> bool:
    """a == b, where NaN equals NaN: a disabled planner reports T(C) as computed, and a
    calibration whose rho overflows makes the same NaN on both sides (0 x inf)."""
    if hasattr(a, "_asdict") and hasattr(b, "_asdict"):  # (a Plan: its curve read out)
        return type(a) is type(b) and same(a._asdict(), b._asdict())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def test_same_is_equality_with_nan_equal_to_nan():
    nan = float("nan")
    assert same(((1, nan), (2, 3.0)), ((1, float("nan")), (2, 3.0)))
    assert not same(((1, nan),), ((1, 0.0),)) and not same((1, 2.0), (1, 2.5))
    assert not same((1,), (1, 2)) and same({"a": [nan]}, {"a": [nan]})


def same_or_both_raise(fast, slow):
    """fast() == slow(), or both raise ValueError (no legal C, T(C) not finite)."""
    try:
        want = slow()
    except ValueError:
        with pytest.raises(ValueError):
            fast()
        return None
    got = fast()
    assert same(got, want), (got, want)
    return want


def decision(d) -> tuple:
    return d.comm_ctas, d.predicted, d.w_comp, d.w_comm, d.rho


@settings(max_examples=1500, deadline=None)
@given(workloads, kernels, st.integers(2, 200), st.integers(0, 8), calibrations)
@example(  # q(1) overflows to inf at L = 1: T(1) was 0 * inf = NaN, no minimum
    Workload(tokens=7937, hidden=1000, ffn=1, world=4, splits=1, expert_counts=(0,)),
    KernelSpec(16, 16, 64, 16, 1, 1, False, True), 2, 0,
    Calibration(rho_ref=1e300, k_ref=352, tm_ref=128, tn_ref=128, d_ref=1, c_max=1))
def test_plan_decides_as_the_whole_curve(w, kernel, sms, margin, calib):
    """C*, T(C*) (bit for bit), the tile counts and rho, and every T(C) of the curve."""
    device = DeviceSpec("d", sms, min(margin, sms - 1))
    d = same_or_both_raise(lambda: decision(plan(w, kernel, device, calib)),
                           lambda: reference_plan(w, kernel, device, calib))
    if d is not None:
        got = plan(w, kernel, device, calib)
        cs, ts, _ = reference_curve(d[2], d[3], d[4], w.splits, kernel, device, calib)
        assert same(got.curve, tuple(zip(cs, ts)))
        assert (got.reservation, got.compute_slots) == (
            (0, kernel.o_comp * device.available_sms) if kernel.shared_sms else
            (-(-got.comm_ctas // kernel.o_comm),
             kernel.o_comp * (device.available_sms - -(-got.comm_ctas // kernel.o_comm))))


@settings(max_examples=600, deadline=None)
@given(workloads, st.sampled_from(["a100-paper", "h200", "h100"]), st.booleans(),
       st.booleans(), st.integers(0, 40))
def test_shipped_presets_decide_as_the_whole_curve(w, name, helpers, shared, margin):
    """The paper's preset and the shipped calibrations, in both placements, with and
    without tail helpers, at the op's ranking calibration too."""
    preset = get_preset(name).with_sm_margin(margin)
    kernel = dataclasses.replace(preset.kernel, tail_helpers=helpers, shared_sms=shared)
    for calib in (preset.calibration, ranking_calibration(preset.calibration)):
        same_or_both_raise(lambda: decision(plan(w, kernel, preset.device, calib)),
                           lambda: reference_plan(w, kernel, preset.device, calib))


@settings(max_examples=300, deadline=None)
@given(workloads, kernels, st.integers(2, 200), calibrations,
       st.lists(st.tuples(st.sampled_from([0, 0, 1, 333, 1 << 15]), st.integers(0, 5000)),
                min_size=1, max_size=6))
def test_the_caches_reuse_of_sizes_decides_as_a_fresh_plan(w, kernel, sms, calib, launches):
    """decide_tiles at sizes seen before (W_comm, rho and the checks reused) and the
    ranking's predictor, T(C*) as a function of (M, row_tiles), one built for every M
    (q kept from one call to the next at the same M), give a fresh plan's numbers, at M
    repeated, changed and back."""
    device = DeviceSpec("d", sms)
    cache = PlanCache(kernel, device, calib)
    sizes = (w.hidden, w.ffn, w.world, w.splits)
    extra = dict(groups=w.groups, topk=w.topk, local_topk=w.local_topk)
    predictor = cache.predictor(*sizes, 3, **extra)
    for more_tokens, row_tiles in launches:
        tokens = w.tokens + more_tokens
        one = dataclasses.replace(w, tokens=tokens, expert_counts=(row_tiles * kernel.tile_m,))
        want = same_or_both_raise(
            lambda: decision(cache.decide_tiles(row_tiles, tokens, *sizes, 3, **extra)),
            lambda: reference_plan(one, kernel, device, calib))
        same_or_both_raise(lambda: predictor(tokens, row_tiles),
                           lambda: reference_plan(one, kernel, device, calib)[1])
        assert want is None or same(predictor(tokens, row_tiles), want[1])


@settings(max_examples=300, deadline=None)
@given(workloads, kernels, st.integers(2, 200), calibrations,
       st.sampled_from([None, None, 1, 7, 300]), st.booleans(),
       st.lists(st.tuples(st.sampled_from([0, 0, 1, 333, 1 << 15]), st.integers(0, 5000)),
                min_size=1, max_size=4))
@example(  # a disabled planner, rho_ref 1e300, no rows: T(1) is NaN on both sides
    Workload(16, 7168, 1, 3, 1, (0,)), KernelSpec(16, 16, 1, 16, 1, 1, False, True), 3,
    Calibration(rho_ref=1e300, k_ref=352, tm_ref=128, tn_ref=128, d_ref=1, c_max=1),
    None, False, [(0, 0)])
def test_the_caches_planner_plans_as_decide_tiles_at_every_m(w, kernel, sms, calib, comm_ctas,
                                                             enabled, launches):
    """PlanCache.planner (the op's plan at its L: one built for every M, no memo) gives
    decide_tiles' Plan, curve included, at the model's C, an explicit C and disabled, and
    the predictor there the Plan's T."""
    device = DeviceSpec("d", sms)
    cache = PlanCache(kernel, device, calib)
    sizes = (w.hidden, w.ffn, w.world, w.splits)
    extra = dict(groups=w.groups, comm_ctas=comm_ctas, enabled=enabled, topk=w.topk,
                 local_topk=w.local_topk)
    planned, predictor = cache.planner(*sizes, 3, **extra), cache.predictor(*sizes, 3, **extra)
    for more_tokens, row_tiles in launches:
        tokens = w.tokens + more_tokens
        want = same_or_both_raise(lambda: planned(tokens, row_tiles), lambda: PlanCache(
            kernel, device, calib).decide_tiles(row_tiles, tokens, *sizes, 3, **extra))
        assert want is None or same(predictor(tokens, row_tiles), want.predicted)


def test_the_predictor_checks_m_as_a_workload_does():
    """M is no part of what a predictor is built at: every call checks it (an int >= 1),
    an M equal to the one it holds q for too."""
    h200 = get_preset("h200")
    for shared in (True, False):
        kernel = dataclasses.replace(h200.kernel, shared_sms=shared)
        cache = PlanCache(kernel, h200.device, h200.calibration)
        predictor = cache.predictor(2048, 704, 2, 2, 16)
        want = cache.decide_tiles(100, 16384, 2048, 704, 2, 2, 16).predicted
        assert predictor(16384, 100) == want
        for bad in (16384.0, 0, -1, True, None):
            with pytest.raises(ValueError):
                predictor(bad, 100)
        assert predictor(16384, 100) == want


def roofline_t(r, splits, cache):
    """T_mem(L) at the request's sizes, GEMM2 on all o_comp G slots, the bytes computed
    whole at its M (`reference_memory_t`; Phi from `planner.roofline`)."""
    kernel, calib = cache.kernel, cache.calib
    slots = kernel.o_comp * cache.device.available_sms
    per_row = math.ceil(math.ceil(r.hidden / splits) / kernel.tile_n)
    phi, phi_w = (roofline.wave_bytes(slots, kernel.tile_m, kernel.tile_n, r.ffn,
                                      calib.hbm_k_epi, balance)
                  for balance in (calib.hbm_balance, calib.hbm_stream_balance or
                                  calib.hbm_balance))
    return reference_memory_t(r.num_tokens, r.hidden, r.ffn, splits, r.experts, kernel.tile_m,
                              r.row_tiles, per_row * r.row_tiles, slots, phi, phi_w=phi_w)


def fresh_plan(request, cache, splits):
    """A fresh plan of the request at L = `splits` with the kernels, device and calibration
    of one of the op's caches."""
    r = request
    w = Workload(r.num_tokens, r.hidden, r.ffn, r.world, splits,
                 (r.row_tiles * cache.kernel.tile_m,), topk=r.topk, local_topk=r.local_topk)
    return reference_plan(w, cache.kernel, cache.device, cache.calib)


#: one planner for the module's requests, as a session keeps one for its calls
PLANNER = Planner()


def reference_ranked(request) -> dict[int, float]:
    """The T the op ranks each L of split_candidates by, the straightforward way: a fresh
    plan's T(C*) under the ranking model, and its max with the splits' roofline where the
    calibration has one."""
    r = request
    ranking = PLANNER.caches_at(r, 1)[1]
    tile_n = ranking.kernel.tile_n if ranking.calib.hbm_balance is not None else None
    ranked = {}
    for cand in planning.split_candidates(r.hidden, tile_n):
        cache = PLANNER.caches_at(r, cand)[1]
        t = fresh_plan(r, cache, cand)[1]
        if tile_n:  # the splits' roofline, from its own module (tests/test_roofline.py)
            t = max(t, roofline_t(r, cand, cache))
        ranked[cand] = t
    return ranked


def reference_launch(request):
    """The op's decision the straightforward way: each L of split_candidates ranked by
    `reference_ranked` (ties: fewer splits), then a fresh plan at that L under the full
    model, with the kernels, device and calibration the op's caches hold."""
    splits, best = request.splits, None
    for cand, t in (() if splits else reference_ranked(request).items()):
        if best is None or t < best * (1 - 1e-9):
            splits, best = cand, t
    c, t, *_ = fresh_plan(request, PLANNER.caches_at(request, splits)[2], splits)
    return splits, c, t


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([None, "h200", "h100", "a100-paper"]),
       st.sampled_from([GPU_TILES, PARTITION_TILES]), st.booleans(),
       st.sampled_from([1024, 2048, 4096, 7168]), st.sampled_from([128, 704, 1408]),
       st.sampled_from([1, 2, 4, 8]), st.sampled_from([2, 4, 6, 8]),
       st.lists(st.integers(0, 4000), min_size=1, max_size=4), st.integers(1, 8))
def test_the_ops_planner_ranks_and_plans_as_fresh_plans(preset, tiles, helpers, hidden, ffn,
                                                    world, topk, routings, batches):
    """The op's planner (L ranked by the cached predictors, C by the cache at that L)
    against fresh plans, for routings new to it at sizes seen before or not: the
    predictors are kept per launch shape less M, so a new M at a known shape, several
    routings at one M, and an M again after another all go through them."""
    config = OverlapConfig(backend="interpret", preset=preset, tail_helpers=helpers)
    tokens = 1024 * batches
    launches = itertools.chain(itertools.product((tokens, tokens + world), routings),
                               ((tokens, row_tiles + 1) for row_tiles in routings))
    for m, row_tiles in launches:
        request = planning.PlanRequest(config, tiles, torch.device("cpu"), "interpret",
                                       row_tiles, 16, m, hidden, ffn, world, topk,
                                       float(topk), None, None)
        got = PLANNER.plan(request)
        assert (got.splits, got.plan.comm_ctas, got.plan.predicted) == reference_launch(request)
        ranked = reference_ranked(request)  # (the T of every L, not only the least)
        assert PLANNER.split_predictions(request, tuple(ranked)) == ranked


def test_reference_and_fast_ties_on_hand_cases():
    """Shared placement: C* = G. Partition: ties to the least (-W_comp) mod P, then the
    smaller C; a flat curve (W_comp = W_comm = 0: T = 0 at every C) to C = 1."""
    h200 = get_preset("h200")
    shared = dataclasses.replace(h200.kernel, shared_sms=True)
    assert reference_solve(1000, 64, 1.0, 2, shared, h200.device, h200.calibration)[0] == 132
    kernel, device = KernelSpec(128, 128, 64, 1024, 1, 1), DeviceSpec("d", 10)
    flat = Calibration(1.0, 704, 128, 128, 2, 8)
    assert reference_solve(0, 0, 1.0, 1, kernel, device, flat) == (1, 0.0)
    assert solve(0, 0, 1.0, 1, kernel, device, flat.c_max)[0] == 1
    # W_comp = 600 over P(C) = 9 - C: T = ceil(600 / P) + ceil(4 / C) at L = 1; the least
    # T ties at C = 4, 5 (124 + 1, 120 + 1 ... ) where the reference's order decides
    for splits in (1, 2, 3, 7):
        want = reference_solve(600, 4, 1.0, splits, kernel, device, flat)
        assert (solve(600, 4, 1.0, splits, kernel, device, flat.c_max)[0], ) == want[:1]


def test_an_overflowing_service_time_is_an_infinite_t_at_one_split_not_nan():
    """q = inf at L = 1 has no (L - 1) q term: T is inf (a C that loses), never NaN (which
    compares with nothing and made the whole-curve minimum undefined)."""
    from megatron_overlap.planner.curve import t_at

    inf = float("inf")
    assert t_at(0, 1, 2, inf, inf) == inf
    assert t_at(10, 1, 2, 3.0, 4.0) == 5 + 4.0  # A_0 = A_{L-1} = 5, plus q_tail
    assert t_at(10, 2, 2, 3.0, 4.0) == max(10, 5 + 3.0) + 4.0


def test_the_offline_planner_plans_for_the_gpu_it_is_given_and_refuses_anything_else():
    """`ops.Planner(for_device=...)`: a tool replays an H200's plans on this host; a value
    that is not a planner DeviceSpec is a TypeError naming for_device."""
    from megatron_overlap.ops import Planner
    from megatron_overlap.planner import get_preset

    h200 = get_preset("h200").device
    assert Planner(for_device=h200).for_device == h200
    with pytest.raises(TypeError, match="for_device"):
        Planner(for_device="h200")
