"""The analytical model of docs/DESIGN.md / paper section III: hand cases and properties."""

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_overlap.planner import (
    A100_PAPER,
    Calibration,
    DeviceSpec,
    KernelSpec,
    PlanCache,
    Workload,
    compute_slots,
    expert_row_tiles,
    makespan,
    service_time,
    plan,
    reservation,
    resident_ctas,
)

K, DEV, CAL = A100_PAPER.kernel, A100_PAPER.device, A100_PAPER.calibration


def paper_plan(counts, tokens=4096, hidden=2048, ffn=352, world=4, splits=2, **kw):
    return plan(Workload(tokens, hidden, ffn, world, splits, tuple(counts)), K, DEV, CAL, **kw)


def test_hand_computed_case_matches_every_term():
    # 8 experts x 512 rows -> 32 row tiles; ceil(1024/128) = 8 column tiles per split.
    d = paper_plan([512] * 8)
    assert d.w_comp == 32 * 8
    assert d.w_comm == math.ceil(1024 / 128) * 1
    assert d.rho == pytest.approx(10.05)
    t = dict(d.curve)
    # C=1: P=214, A_0=ceil(256/214)=2, A_1=ceil(512/214)=3, q=10.05*8=80.4
    assert t[1] == pytest.approx(max(3, 2 + 80.4) + 80.4)
    # C=8..16: V_comm=1, q=10.05; A_0=2, A_1=3 -> T = max(3, 12.05) + 10.05 = 22.1
    for c in range(8, 17):
        assert t[c] == pytest.approx(22.1)


def test_ties_go_to_smaller_empty_slots_then_smaller_c():
    # The C = 8..16 plateau above ties; Delta_comp = 2 P(C) - 256 is least at C = 16.
    d = paper_plan([512] * 8)
    assert (d.comm_ctas, d.reservation, d.compute_slots) == (16, 16, 184)
    # With no compute work Delta_comp is 0 everywhere: the plateau C >= 8 goes to C = 8.
    assert paper_plan([0] * 8).comm_ctas == 8


def test_explicit_choice_has_priority_and_disabled_returns_fixed_default():
    d = paper_plan([512] * 8, comm_ctas=5)
    assert (d.comm_ctas, d.source, d.compute_slots) == (5, "user", 2 * (108 - 5))
    d = paper_plan([512] * 8, enabled=False)
    assert (d.comm_ctas, d.source) == (3, "disabled")
    assert d.predicted == dict(d.curve)[3]


def test_rho_ref_from_the_papers_two_measurements():
    rho = Calibration.rho_from_measurement(400.19, 2, 497.36, 25)
    assert rho == pytest.approx(10.06, abs=0.01)


def test_rho_scales_with_k_tile_and_world_as_eq15():
    d = plan(Workload(4096, 2048, 704, 2, 2, (512,)), K, DEV, CAL)
    assert d.rho == pytest.approx(10.05 * (352 / 704) * (2 / 4))


def test_zero_counts_one_hot_expert_single_split_and_narrow_hidden():
    assert paper_plan([0] * 60).w_comp == 0
    hot = paper_plan([16384] + [0] * 59)
    assert hot.w_comp == 128 * 8
    one = paper_plan([300] * 4, splits=1)
    assert one.splits == 1 and one.w_comp == 3 * 4 * 16
    narrow = plan(Workload(100, 64, 32, 2, 1, (7, 0, 3)), K, DEV, CAL)
    assert narrow.w_comp == 2 and narrow.w_comm == 1


def test_normalized_load_estimate_spreads_assignments_evenly():
    w = Workload.from_total(tokens=4096, hidden=2048, ffn=704, world=2, splits=2,
                            total_assignments=4096 * 4 // 2, local_experts=30)
    assert sum(w.expert_counts) == 8192 and max(w.expert_counts) - min(w.expert_counts) <= 1


@pytest.mark.parametrize("field,kwargs", [
    ("ffn", dict(ffn=0)),
    ("world", dict(world=0)),
    ("splits", dict(splits=0)),
    ("tokens", dict(tokens=-1)),
    ("expert_counts[1]", dict(expert_counts=(3, -1))),
    ("expert_counts[0]", dict(expert_counts=(2.5,))),
    ("expert_counts", dict(expert_counts=())),
    ("splits", dict(splits=4096)),
])
def test_bad_workload_raises_value_error_naming_the_field(field, kwargs):
    base = dict(tokens=64, hidden=128, ffn=32, world=2, splits=2, expert_counts=(3, 4))
    base.update(kwargs)
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        Workload(**base)


def test_bad_calibration_kernel_and_device_raise_naming_the_field():
    with pytest.raises(ValueError, match="c_max"):
        Calibration(10.0, 352, 128, 128, 4, 0)
    with pytest.raises(ValueError, match="rho_ref"):
        Calibration(0.0, 352, 128, 128, 4, 16)
    with pytest.raises(ValueError, match="o_comm"):
        KernelSpec(128, 128, 128, 1024, 2, 0)
    with pytest.raises(ValueError, match="tail_helpers"):
        KernelSpec(128, 128, 128, 1024, 2, 1, tail_helpers=1)
    with pytest.raises(ValueError, match="sm_margin"):
        DeviceSpec("x", 8, 8)


def test_preset_without_any_compute_slot_raises():
    w = Workload(64, 128, 32, 2, 1, (3,))
    with pytest.raises(ValueError, match="sms"):
        plan(w, K, DeviceSpec("tiny", 1), CAL)


def test_cache_returns_the_uncached_answer_and_keys_on_tile_counts():
    cache = PlanCache(K, DEV, CAL)
    a = cache.decide(4096, 2048, 704, 2, 2, [130, 1, 256])
    # Different counts, same sum_e ceil(M_e/128) = 2 + 1 + 2: a hit with the same plan.
    b = cache.decide(4096, 2048, 704, 2, 2, [129, 128, 200])
    assert a is b and (cache.hits, cache.misses) == (1, 1)
    assert a == plan(Workload(4096, 2048, 704, 2, 2, (130, 1, 256)), K, DEV, CAL)
    c = cache.decide_tiles(expert_row_tiles([130, 1, 256], 128), 4096, 2048, 704, 2, 2, 3)
    assert c is a
    # a miss from row tiles plans as the counts would, whatever the local expert count
    for experts in (1, 3, 64):
        assert PlanCache(K, DEV, CAL).decide_tiles(5, 4096, 2048, 704, 2, 2, experts) == a
    with pytest.raises(ValueError, match="expert_counts"):
        cache.decide(4096, 2048, 704, 2, 2, [-200, 1])


def test_sm_margin_reduces_compute_slots():
    d = plan(Workload(4096, 2048, 704, 2, 2, (512,) * 8), K, DeviceSpec("A100", 108, 8), CAL)
    assert d.compute_slots == 2 * (100 - d.reservation)


def test_occupancy_of_a_triton_128x128x64_tile_is_two_ctas():
    occ = resident_ctas(240, 128, 96 * 1024)
    assert occ.ctas_per_sm == 2


@pytest.mark.parametrize("regs,threads,smem,expect,by", [
    (16, 1024, 0, 2, "threads"),
    (64, 1024, 0, 1, "registers"),
    (128, 128, 200 * 1024, 1, "shared memory"),
    (16, 32, 0, 32, "ctas"),
    (168, 256, 0, 1, "registers"),
])
def test_occupancy_limits(regs, threads, smem, expect, by):
    occ = resident_ctas(regs, threads, smem)
    assert (occ.ctas_per_sm, occ.limited_by) == (expect, by)


def test_occupancy_rejects_a_cta_that_cannot_fit():
    with pytest.raises(ValueError, match="does not fit"):
        resident_ctas(128, 128, 240 * 1024)
    with pytest.raises(ValueError, match="registers_per_thread"):
        resident_ctas(300, 128, 0)


workloads = st.builds(
    Workload,
    tokens=st.integers(1, 1 << 17),
    hidden=st.sampled_from([64, 1000, 1024, 2048, 4096]),
    ffn=st.integers(1, 4096),
    world=st.integers(1, 8),
    splits=st.integers(1, 8),
    expert_counts=st.lists(st.integers(0, 20000), min_size=1, max_size=64).map(tuple),
)
kernels = st.builds(KernelSpec, st.sampled_from([64, 128]), st.sampled_from([128, 256]),
                    st.sampled_from([8, 64, 128]), st.sampled_from([512, 1024, 2048]),
                    st.integers(1, 3), st.integers(1, 2))


@settings(max_examples=300, deadline=None)
@given(workloads, kernels, st.integers(4, 140), st.integers(1, 40),
       st.one_of(st.none(), st.floats(0.5, 80)))
def test_curve_properties(w, kernel, sms, c_max, c_sat):
    device = DeviceSpec("d", sms)
    calib = Calibration(10.05, 352, 128, 128, 4, c_max, c_sat=c_sat)
    d = plan(w, kernel, device, calib)
    slots = [compute_slots(c, kernel, device) for c, _ in d.curve]
    assert all(p > 0 for p in slots)
    assert all(a >= b for a, b in zip(slots, slots[1:]))  # P decreasing in C
    for (c, t), p in zip(d.curve, slots):
        q = d.rho * (math.ceil(d.w_comm / c) + d.w_comm / (c_sat or math.inf))
        a_last = math.ceil(w.splits * d.w_comp / p)
        assert t >= w.splits * q - 1e-9 * t  # T(C) >= L q(C)
        assert t >= a_last  # T(C) >= A_{L-1}(C)
        # the closed form used on the hot path equals the literal recurrence of eq. 12
        assert t == pytest.approx(makespan(d.w_comp, d.w_comm, p, c, w.splits, d.rho, c_sat),
                                  rel=1e-12)
    t_min = min(t for _, t in d.curve)
    assert dict(d.curve)[d.comm_ctas] <= t_min * (1 + 1e-9)
    # with tail helpers the last split is served by C + G - R(C) CTAs, counted up to
    # C_max (saturation): never slower
    helped = plan(w, dataclasses.replace(kernel, tail_helpers=True), device, calib)
    for (c, t), (c2, t2), p in zip(d.curve, helped.curve, slots):
        tail = min(c + device.available_sms - reservation(c, kernel), max(c, c_max))
        assert c2 == c and t2 <= t * (1 + 1e-12)
        assert t2 == pytest.approx(makespan(d.w_comp, d.w_comm, p, c, w.splits, d.rho, c_sat,
                                            tail_ctas=tail), rel=1e-12)
    tied = [c for c, t in d.curve if t - t_min <= 1e-9 * t_min]
    delta = {c: math.ceil(d.w_comp / p) * p - d.w_comp for (c, _), p in zip(d.curve, slots)}
    assert d.comm_ctas == min(tied, key=lambda c: (delta[c], c))


def reference_decision(w, kernel, device, calib):
    """Algorithm 1 by the literal recurrence: `makespan` at every legal C, ties as the
    model's doc says (shared: the larger C; partition: the least Delta_comp, then C)."""
    from megatron_overlap.planner import comm_tiles, compute_tiles, service_ratio, tail_ctas

    g = device.available_sms
    shared = kernel.shared_sms
    cs = range(1, g + 1) if shared else [
        c for c in range(1, calib.c_max + 1) if compute_slots(c, kernel, device) > 0]
    top = max(calib.c_max, g) if shared else calib.c_max
    w_comp, w_comm = compute_tiles(w, kernel), comm_tiles(w, kernel)
    rho = service_ratio(w, kernel, calib)
    ts = {c: makespan(w_comp, w_comm, compute_slots(c, kernel, device), c, w.splits, rho,
                      calib.c_sat, tail_ctas(c, kernel, device, top), calib.overlap_factor)
          for c in cs}
    t_min = min(ts.values())
    tied = [c for c, t in ts.items() if t - t_min <= 1e-9 * t_min]
    if shared:
        return max(tied), ts

    def delta_comp(c):
        p = compute_slots(c, kernel, device)
        return math.ceil(w_comp / p) * p - w_comp

    return min(tied, key=lambda c: (delta_comp(c), c)), ts


any_kernels = st.builds(KernelSpec, st.sampled_from([16, 64, 128]), st.sampled_from([16, 128, 256]),
                        st.sampled_from([1, 8, 64, 128]), st.sampled_from([16, 512, 1024]),
                        st.integers(1, 3), st.integers(1, 4), st.booleans(), st.booleans())
calibrations = st.builds(
    Calibration, rho_ref=st.one_of(st.sampled_from([0.5, 1.0, 1.59, 10.05]), st.floats(0.01, 60)),
    k_ref=st.sampled_from([352, 704]), tm_ref=st.just(128), tn_ref=st.just(128),
    d_ref=st.integers(1, 4), c_max=st.integers(1, 200),
    c_sat=st.one_of(st.none(), st.floats(0.5, 80)),
    overlap_factor=st.one_of(st.none(), st.sampled_from([1.0, 1.7]), st.floats(0.3, 3)),
    k_epi=st.one_of(st.none(), st.just(971.4)))


@settings(max_examples=600, deadline=None)
@given(workloads, any_kernels, st.integers(2, 200), calibrations)
def test_closed_forms_decide_exactly_as_the_recurrence_in_both_placements(w, kernel, sms,
                                                                          calib):
    """The fast paths (closed-form T(C); C* = G without the curve in the shared placement)
    against `makespan` at every C: the same C*, every T(C) within 1e-12 relative, and
    T(C*) the curve's own value."""
    device = DeviceSpec("d", sms)
    try:
        best, ts = reference_decision(w, kernel, device, calib)
    except ValueError:  # (no legal C: the planner raises too)
        with pytest.raises(ValueError):
            plan(w, kernel, device, calib)
        return
    d = plan(w, kernel, device, calib)
    assert d.comm_ctas == best
    assert [c for c, _ in d.curve] == list(ts)
    for c, t in d.curve:
        assert t == pytest.approx(ts[c], rel=1e-12, abs=0)
    assert d.predicted == dict(d.curve)[best]
    if w.splits <= 2 and (kernel.shared_sms or kernel.tail_helpers):
        assert all(t == ts[c] for c, t in d.curve)  # one or two splits: the recurrence's sums


def test_saturation_term_adds_a_c_independent_service_floor():
    """The bandwidth term lifts every q(C) by rho * W_comm / C_sat: T(C) >= L times it."""
    kernel = KernelSpec(128, 128, 16, 1024, 2, 1)
    device = DeviceSpec("h", 132)
    w = Workload(16384, 2048, 704, 2, 2, (1092,) * 60)
    free = plan(w, kernel, device, Calibration(3.0, 704, 128, 128, 2, 64))
    capped = plan(w, kernel, device, Calibration(3.0, 704, 128, 128, 2, 64, c_sat=20))
    assert free.comm_ctas == 57
    for c, t in capped.curve:
        assert t >= 2 * 3.0 * 512 / 20 * (1 - 1e-12)
        assert t >= dict(free.curve)[c]
    assert service_time(512, 64, 1.0, 20) == pytest.approx(8 + 512 / 20)
    assert service_time(512, 16, 1.0, None) == 32  # the paper's waves


def test_calibration_rejects_non_positive_c_sat():
    with pytest.raises(ValueError, match="c_sat"):
        Calibration(1.0, 1, 1, 1, 1, 1, c_sat=0)


def test_step_costs_round_trip_through_the_preset_and_reject_bad_values():
    import json

    from megatron_overlap.planner import StepCosts, get_preset
    from megatron_overlap.planner.presets import Preset

    h200 = get_preset("h200")
    assert isinstance(h200.step_costs, StepCosts) and get_preset("a100-paper").step_costs is None
    data = h200.to_json()
    assert Preset.from_json(json.loads(json.dumps(data))) == h200
    del data["step_costs"]  # a file without them: the layer fuses at every size
    assert Preset.from_json(data).step_costs is None
    costs = dict(get_preset("h200").to_json()["step_costs"])
    for name, bad in (("wave_us", 0), ("combine_bytes_per_us", -1.0), ("op_host_us", -1),
                      ("launch_us", float("nan")), ("rs_latency_us", True)):
        with pytest.raises(ValueError, match=f"StepCosts.{name}"):
            StepCosts(**dict(costs, **{name: bad}))


def _h200_decision(tokens: int, hidden: int, ffn: int, topk: int, experts: int,
                   world: int = 1, stock_launches: int = 0, local: int | None = None,
                   stock_permute_fused: bool = False, fused_combine: float | None = None):
    """The fuse-or-not decision the op would make on an H200 (shared placement, tail
    helpers, L = the default), uniform routing; `fused_combine`: BW_te in place of the
    shipped one."""
    from megatron_overlap.planner import (DeviceSpec, KernelSpec, Workload, decide_fusion,
                                          get_preset, plan)

    preset = get_preset("h200")
    local = local or experts
    rows = tokens * topk * local // experts
    splits = max(1, hidden // 1024)
    w = Workload.from_total(tokens=tokens, hidden=hidden, ffn=ffn, world=world, splits=splits,
                            total_assignments=rows, local_experts=local)
    w = dataclasses.replace(w, topk=topk, local_topk=rows / tokens)
    kernel = KernelSpec(128, 128, 32, 512, 2, 1, True, True)
    device = DeviceSpec("NVIDIA H200", 132)
    costs = preset.step_costs
    if fused_combine is not None:
        costs = dataclasses.replace(costs, fused_combine_bytes_per_us=fused_combine)
    return decide_fusion(w, plan(w, kernel, device, preset.calibration), kernel, device,
                         preset.calibration, costs, element_bytes=2,
                         stock_launches=stock_launches, stock_permute_fused=stock_permute_fused)


@pytest.mark.parametrize("tokens, want", [(256, False), (1024, False), (4 * 4096, True),
                                          (4 * 16384, True)])
def test_the_fused_path_is_taken_only_where_the_model_prices_it_faster(tokens, want):
    """Granite's layer on one H200 (hidden 1024, FFN 512, 32 experts, top-8): at B x S =
    1 x 256 and 1 x 1024 the op's host cost outweighs what overlapping saves, at 4 x 4096
    and up the saving wins; the decision is the sign of the two predicted times."""
    d = _h200_decision(tokens, 1024, 512, 8, 32)
    assert d.fuse is want and (d.unfused_us > d.fused_us) is want, d
    assert (d.predicted_gain > 1) is want


def test_the_stock_paths_extra_launches_and_the_groups_host_work_move_the_decision():
    """Per-expert GEMM launches (TE's GroupedLinear) make the stock path dearer; a group
    of more ranks adds H_group to the fused call: each shifts the same size's answer."""
    base = _h200_decision(2048, 1024, 512, 8, 32)
    te = _h200_decision(2048, 1024, 512, 8, 32, stock_launches=64)
    assert te.unfused_us == pytest.approx(base.unfused_us + 64 * 4.0)
    assert not base.fuse and te.fuse
    one, two = _h200_decision(8192, 2048, 1408, 4, 60), _h200_decision(8192, 2048, 1408, 4, 60,
                                                                       world=2)
    assert two.fused_us - one.fused_us > 200  # H_group (and the group's own plan)


def test_stock_path_under_moe_permute_fusion_is_priced_with_tes_one_pass_unpermute():
    """`stock_permute_fused`: the unfused side's unpermute moves its (T + M) N b bytes at
    BW_te instead of BW_comb, nothing else changes (the fused side least of all). Granite
    at B x S = 4 x 4096 (16384 tokens x top-8 rows, hidden 1024, bf16) fuses against
    Megatron's unpermute; against a TE unpermute 3x as fast the stock path is priced
    faster there and the layer keeps it. Uncalibrated (BW_te None): Megatron's rate."""
    bw_comb = 1_000_000.0  # the shipped H200 BW_comb, bytes per us
    bytes_moved = (16384 * 8 + 16384) * 1024 * 2
    megatron = _h200_decision(16384, 1024, 512, 8, 32)
    te = _h200_decision(16384, 1024, 512, 8, 32, stock_permute_fused=True,
                        fused_combine=3 * bw_comb)
    assert megatron.fuse and not te.fuse, (megatron, te)
    assert te.fused_us == megatron.fused_us
    assert megatron.unfused_us - te.unfused_us == pytest.approx(
        bytes_moved / bw_comb - bytes_moved / (3 * bw_comb))
    # the flag alone moves nothing where BW_te is not calibrated; BW_te alone neither
    assert _h200_decision(16384, 1024, 512, 8, 32, stock_permute_fused=True) == megatron
    assert _h200_decision(16384, 1024, 512, 8, 32, fused_combine=3 * bw_comb) == megatron


def test_fused_combine_rate_is_optional_but_positive_where_given():
    from megatron_overlap.planner import StepCosts, get_preset

    costs = dict(get_preset("h200").to_json()["step_costs"])
    assert StepCosts(**dict(costs, fused_combine_bytes_per_us=None)).fused_combine_bytes_per_us \
        is None
    for bad in (0.0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="StepCosts.fused_combine_bytes_per_us"):
            StepCosts(**dict(costs, fused_combine_bytes_per_us=bad))
    from megatron_overlap.planner import decide_fusion
    with pytest.raises(ValueError, match="stock_permute_fused"):
        decide_fusion(None, None, None, None, None, get_preset("h200").step_costs,
                      element_bytes=2, stock_permute_fused=1)


def test_k_epi_and_topk_scale_rho_only_where_calibrated():
    import dataclasses

    from megatron_overlap.planner import Calibration, service_ratio

    w4 = Workload(4096, 2048, 704, 2, 2, (512,) * 4, topk=4)
    base = Calibration(rho_ref=1.6, k_ref=704, tm_ref=128, tn_ref=128, d_ref=2, c_max=56)
    # uncalibrated (the paper's form): a workload's top-k changes nothing
    assert service_ratio(w4, K, base) == service_ratio(dataclasses.replace(w4, topk=8), K, base)
    cal = dataclasses.replace(base, k_epi=600, topk_ref=4)
    assert service_ratio(w4, K, cal) == pytest.approx(service_ratio(w4, K, base))
    small = dataclasses.replace(w4, ffn=256, topk=6)
    # a K = 256 wave costs (256 + 600)/(704 + 600) of the reference one, not 256/704;
    # a top-6 tile moves 7/5 of a top-4 tile's rows
    assert service_ratio(small, K, cal) / service_ratio(w4, K, cal) == pytest.approx(
        (1304 / 856) * 7 / 5)
    big = Workload(16384, 2048, 704, 2, 2, (4096,) * 16)
    strong = dataclasses.replace(cal, rho_ref=4.0)
    cs = [plan(dataclasses.replace(big, topk=k), K, DEV, strong).comm_ctas for k in (2, 4, 8)]
    assert cs[0] < cs[1] < cs[2]  # more rows per token: more communication CTAs
    with pytest.raises(ValueError, match="k_epi"):
        dataclasses.replace(base, k_epi=-1.0)
    with pytest.raises(ValueError, match="topk"):
        dataclasses.replace(w4, topk=0)


def test_overlap_factor_and_local_topk_are_neutral_when_unset_and_act_when_set():
    from megatron_overlap.planner import service_ratio

    kernel = KernelSpec(128, 128, 64, 1024, 2, 1)
    helped = dataclasses.replace(kernel, tail_helpers=True)
    device = DeviceSpec("h", 132)
    w = Workload(16384, 2048, 704, 2, 4, (1092,) * 60, topk=4)
    cal = Calibration(1.59, 704, 128, 128, 2, 56, 64, 1024, k_epi=600, topk_ref=4)
    # f = 1 and local_topk = k are the old model exactly, with and without tail helpers
    for k in (kernel, helped):
        old = plan(w, k, device, cal)
        assert plan(w, k, device, dataclasses.replace(cal, overlap_factor=1.0)) == old
        assert plan(dataclasses.replace(w, local_topk=4), k, device, cal) == old
    # f scales every split without helpers: the same curve as rho * f
    f2 = plan(w, kernel, device, dataclasses.replace(cal, overlap_factor=2.0))
    scaled = plan(w, kernel, device, dataclasses.replace(cal, rho_ref=2 * 1.59))
    assert [t for _, t in f2.curve] == pytest.approx([t for _, t in scaled.curve])
    assert f2.comm_ctas == scaled.comm_ctas
    # with helpers the last split runs at rho after GEMM2, served by C + G - R(C) = 132
    # CTAs counted up to C_max = 56 (hand case, C = 16: P = 232)
    h = plan(w, helped, device, dataclasses.replace(cal, overlap_factor=1.5))
    rho, a = h.rho, [math.ceil((s + 1) * h.w_comp / 232) for s in range(4)]
    f_s = 0.0
    for s in range(3):
        f_s = max(a[s], f_s) + 1.5 * rho * math.ceil(h.w_comm / 16)
    assert dict(h.curve)[16] == pytest.approx(max(a[3], f_s) + rho * math.ceil(h.w_comm / 56))
    # T(C) never falls as f grows, and C* never falls either (more costly communication)
    prev, prev_c = None, 0
    for f in (0.8, 1.0, 1.4, 1.7, 2.5):
        d = plan(w, helped, device, dataclasses.replace(cal, overlap_factor=f))
        if prev is not None:
            assert all(t >= p * (1 - 1e-12) for (_, t), (_, p) in zip(d.curve, prev))
        assert d.comm_ctas >= prev_c
        prev, prev_c = d.curve, d.comm_ctas
    # fewer local rows per token (EP): a cheaper comm tile, (k_loc + 1) / (k + 1)
    ep = dataclasses.replace(w, local_topk=2.0)
    assert service_ratio(ep, kernel, cal) / service_ratio(w, kernel, cal) == pytest.approx(3 / 5)
    # the paper's preset carries neither term
    assert CAL.overlap_factor is None
    with pytest.raises(ValueError, match="overlap_factor"):
        dataclasses.replace(cal, overlap_factor=0)
    with pytest.raises(ValueError, match="local_topk"):
        dataclasses.replace(w, local_topk=-1)


# ------------------------------------------------------------ the shared placement
SHARED = KernelSpec(128, 128, 8, 512, 2, 5, tail_helpers=True, shared_sms=True)
H200 = DeviceSpec("NVIDIA H200", 132)


def test_shared_placement_reserves_no_sm_and_puts_a_comm_cta_on_every_sm():
    w = Workload(65536, 2048, 704, 2, 4, (4369,) * 60, topk=4)
    d = plan(w, SHARED, H200, CAL)
    assert reservation(40, SHARED) == 0 and compute_slots(40, SHARED, H200) == 2 * 132
    assert d.comm_ctas == 132 and d.reservation == 0 and d.compute_slots == 264
    curve = [t for _, t in d.curve]
    assert len(curve) == 132  # C = 1..G: one beside GEMM2 on each SM at most
    assert all(b <= a * (1 + 1e-9) for a, b in zip(curve, curve[1:]))  # never rises with C
    # an explicit C: accepted up to G, refused above (no second CTA fits beside GEMM2)
    assert plan(w, SHARED, H200, CAL, comm_ctas=66).comm_ctas == 66
    with pytest.raises(ValueError, match="one communication CTA beside GEMM2's per SM"):
        plan(w, SHARED, H200, CAL, comm_ctas=133)
    # the partition placement of the same tiles reserves SMs: fewer compute slots
    part = plan(w, dataclasses.replace(SHARED, shared_sms=False), H200, CAL)
    assert part.reservation >= 1 and part.compute_slots < 264


def test_shared_placement_flag_must_be_a_bool():
    with pytest.raises(ValueError, match="shared_sms must be a bool"):
        KernelSpec(128, 128, 8, 512, 2, 5, shared_sms=1)


def test_plan_curve_reads_as_a_tuple_and_plans_compare_pickle_and_replace_as_before():
    import pickle

    w = Workload(65536, 2048, 704, 2, 4, (4369,) * 60, topk=4)
    d = plan(w, SHARED, H200, CAL)
    assert type(d.curve) is tuple and len(d.curve) == 132 and d.curve[0][0] == 1
    assert d == plan(w, SHARED, H200, CAL) and hash(d) == hash(plan(w, SHARED, H200, CAL))
    assert pickle.loads(pickle.dumps(d)) == d and pickle.loads(pickle.dumps(d)).curve == d.curve
    assert d._asdict()["curve"] == d.curve and d._replace(source="user").curve == d.curve
    assert repr(d.curve) in repr(d)


def test_two_gemm2_ctas_and_one_small_gather_cta_share_an_sm_exactly():
    from megatron_overlap.planner import co_resident

    # the Gluon GEMM2 (8 warps, 104 registers, 106620 B) twice + GatherRS (4 warps, 96)
    gluon, comm = (104, 256, 106620, 2), (96, 128, 4096, 1)
    assert co_resident([gluon, comm]) is None  # 2 x 2 x 3328 + 3072 = 16384 per partition
    assert co_resident([(112, 256, 106620, 2), comm]) == "registers"
    assert co_resident([gluon, (96, 128, 20 * 1024, 1)]) == "shared memory"
    # the partition's 32-warp GatherRS CTA takes a whole SM
    assert co_resident([gluon, (62, 1024, 32768, 1)]) == "registers"
    for bad in ((0, 128, 0, 1), (96, 2048, 0, 1), (96, 128, -1, 1), (96, 128, 0, -1)):
        with pytest.raises(ValueError, match="co_resident: each part"):
            co_resident([gluon, bad])


def test_each_shipped_calibration_is_found_by_its_own_device_name():
    from megatron_overlap.planner import get_preset, preset_for_device, preset_names

    shipped = [get_preset(n) for n in preset_names() if n != "a100-paper"]
    assert {p.name for p in shipped} >= {"h100", "h200"}
    names = [p.device.name for p in shipped]
    assert len(set(names)) == len(names)  # a device name picks one file, not the first
    for preset in shipped:
        assert preset_for_device(preset.device.name) == preset
        assert preset.calibration.rho_ref > 0 and preset.device.sms == 132
    assert preset_for_device("NVIDIA H100 80GB HBM3").name == "h100"
    # H100's was made on one GPU (two were not lent): its D_ref is 1, H200's 2, and rho
    # scales with D / D_ref, so the two agree on what one rank's waves cost
    assert get_preset("h100").calibration.d_ref == 1
    assert get_preset("h200").calibration.d_ref == 2
    assert preset_for_device("NVIDIA A10") is None
