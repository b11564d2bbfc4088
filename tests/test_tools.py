"""The pieces of the evaluation tools that decide what is reported: fits, sweeps, tables."""

import argparse
import dataclasses
import math
import os
import statistics
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))

import calibrate  # noqa: E402
import report  # noqa: E402
import report_model  # noqa: E402
from megatron_overlap.mcore import prefill  # noqa: E402

#: recorded prefill runs, trimmed to what tools/fit_fusion.py reads (tests/data/README.md)
GOLDEN = os.path.join(os.path.dirname(__file__), "data")


def test_calibration_fit_recovers_wave_time_intercept_and_saturation():
    w, splits, t0, wave = 128, 2, 0.3, 0.02
    times = {c: t0 + wave * splits * math.ceil(w / c) for c in range(1, 65)}
    fit_t0, fit_wave, c_sat = calibrate.fit_saturation(times, w, splits)
    assert fit_t0 == pytest.approx(t0, rel=1e-6) and fit_wave == pytest.approx(wave, rel=1e-6)
    # the planner's form: t(C) = t_wave * L * (ceil(W/C) + W/C_sat)
    assert c_sat == pytest.approx(wave * splits * w / t0)
    no_floor = {c: wave * splits * math.ceil(w / c) for c in range(1, 65)}
    assert calibrate.fit_saturation(no_floor, w, splits)[2] is None


def test_report_prefill_section_adds_the_captured_forward_where_a_run_timed_it(tmp_path):
    rows = [_result("qwen", 1024, 0.95), _result("qwen", 4096, 1.1),
            _result("qwen", 8192, 0, oom=True)]
    for r, graph_speedup in zip(rows[:2], (2.5, 1.1)):
        r.update(cuda_graph=True, speedup_graph=graph_speedup,
                 graph=dict(captured=True, equal=True, max_rel_diff=0.0))
        r["policies"]["graph"] = dict(median_ms=4.0, ci95_ms=[3.9, 4.1])
    rows[1]["graph"] = dict(captured=False, error="RuntimeError: capture failed")
    del rows[1]["policies"]["graph"], rows[1]["speedup_graph"]
    text = report_model.prefill_section("t", rows, str(tmp_path))
    assert "--cuda-graph" in text and "| stock / graph | replay = eager |" in text
    assert "| 4.00 [3.90, 4.10] | 2.500x | yes |" in text
    assert "| RuntimeError: capture failed | - | - |" in text
    assert "| OOM | OOM | - | - | - | OOM | - | - |" in text
    assert "| 2.500x | 2.500x |" in text  # the graph's geomean and min over captured S
    plain = report_model.prefill_section("t", [_result("qwen", 1024, 0.95)], str(tmp_path))
    assert "graph" not in plain


def _stat(ms):
    return dict(median=ms, ci_low=0.9 * ms, ci_high=1.1 * ms)


def test_report_layer_section_adds_the_captured_layer_where_a_run_timed_it():
    env = dict(gpu="H200", torch="2.11", triton="3.6")
    rows = [dict(model="qwen", tp=1, ep=1, seq=s, decision=None, rel_err=1e-3, _env=env,
                 stats=dict(stock=_stat(4.0), overlap=_stat(2.0)), speedup=2.0)
            for s in (1024, 4096)]
    rows[0]["stats"]["graph"] = _stat(1.0)
    rows[0].update(speedup_graph=4.0, graph=dict(captured=True, equal=True, max_rel_diff=0.0))
    rows[1]["graph"] = dict(captured=False, error="RuntimeError: x")
    text = report_model.layer_section("t", rows)
    assert "| stock / graph | replay = eager |" in text
    assert "| 1.000 [0.900, 1.100] | 4.00x | yes |" in text
    assert "| not captured | - | - |" in text
    assert "stock / graph 4.00x (min 4.00x, max 4.00x)" in text
    del rows[0]["graph"], rows[1]["graph"], rows[0]["speedup_graph"], rows[0]["stats"]["graph"]
    assert "graph" not in report_model.layer_section("t", rows)


def test_report_graph_table_gives_the_ops_gpu_ratio_to_gemm2_alone():
    row = dict(case="qwen TP2EP1 S=4096 uniform", seq=4096, ours_graph=1.1, gemm_graph=1.0,
               ref_graph=2.2, graphs_equal=True)
    text = report.graph_table([row, dict(row, seq=1024, ours_graph=1.5, ref_graph=None,
                                         graphs_equal=False)])
    assert "| qwen TP2EP1 S=4096 uniform | 1.100 | 1.000 | 2.200 | 1.10x | 2.00x | yes |" in text
    assert "| 1.500 | 1.000 | - | 1.50x | - | no |" in text
    assert "S >= 4096: ours / GEMM2 alone geomean 1.100x (max 1.100x) over 1 workloads" in text
    assert report.graph_table([dict(row, ours_graph=None)]) == ""


def test_report_graph_regret_is_the_planners_replay_against_the_fastest_other_c_or_l():
    """Regret counts only configurations other than the planner's: its own C* or L*
    captured again by the sweep is the same work in another graph (noise, shown apart)."""
    row = dict(case="qwen S=4096", seq=4096, c_star=132, L=4, ours_graph=1.1, gemm_graph=1.0,
               ref_graph=2.2, graphs_equal=True,
               graph_sweep={"C=16": 1.2, "L=2": 1.0, "L=8": 1.3, "L=4": 1.12, "C=132": 1.078})
    assert report.graph_regret(row) == pytest.approx(0.10)
    assert report.graph_retime_spread(row) == pytest.approx(0.02)
    assert report.graph_regret(dict(row, ours_graph=0.9)) == 0.0  # the planner is fastest
    own_only = dict(row, graph_sweep={"L=4": 1.0, "C=132": 1.2})  # no other configuration
    assert report.graph_regret(own_only) is None
    assert report.graph_regret(dict(row, graph_sweep={})) is None
    text = report.graph_table([row, dict(row, case="unswept", graph_sweep={})])
    assert "| fastest other C or L | graph regret | own choice captured twice |" in text
    assert "| yes | L=2 1.000 | 10.0% | 2.0% |" in text and "| yes | - | - | - |" in text
    assert ("graph regret over 1 workloads: mean 10.0%, max 10.0%; the planner's own choice "
            "captured twice differs by up to 2.0%") in text
    assert "graph regret" not in report.graph_table([dict(row, graph_sweep={})])


def test_prefill_report_of_an_s_that_ran_out_of_memory():
    text = prefill.report(dict(model="qwen", tp=1, ep=1, world=1, device="cuda:0", batch=4,
                               seq=16384, tokens=65536, experts="grouped", oom=True,
                               policies={}))
    assert text.endswith(": OOM")


def test_calibration_fit_refuses_times_that_do_not_fall_with_c():
    with pytest.raises(RuntimeError, match="do not fall"):
        calibrate.fit_saturation({1: 1.0, 2: 1.1, 4: 1.2}, 64, 1)


def _result(model, seq, speedup, oom=False):
    base = dict(model=model, tp=2, ep=1, batch=4, seq=seq)
    if oom:
        return dict(base, oom=True, policies={})
    pol = dict(median_ms=10.0, ci95_ms=[9.0, 11.0])
    return dict(base, speedup=speedup, policies=dict(stock=pol, overlap=pol))


def test_report_prefill_section_keeps_oom_rows_and_geomeans_over_the_rest(tmp_path):
    rows = [_result("qwen", 1024, 0.9), _result("qwen", 4096, 1.1),
            _result("qwen", 16384, 1.21), _result("qwen", 8192, 0, oom=True)]
    rows[1]["decisions_rank0"] = [dict(layer=i, C=8, max_over_mean=v) for i, v in
                                  enumerate((1.3, 5.2, 2.0), 1)] + [dict(layer=4)]
    rows[0]["decisions_rank0"] = [dict(layer=1, backend="auto")]  # below the thresholds
    text = report_model.prefill_section("t", rows, str(tmp_path))
    assert "| qwen | TP2EP1 | 4x8192 | OOM | OOM | - | - | - |" in text
    assert "| 1.100x | 3 / 4 | 1.30 / 2.00 / 5.20 |" in text
    assert "| 0.900x | 0 / 1 | - |" in text and "| 1.210x | - | - |" in text
    big = math.sqrt(1.1 * 1.21)
    assert f"| qwen | TP2EP1 | {(0.9 * 1.1 * 1.21) ** (1 / 3):.3f}x | {big:.3f}x | 0.900x |" in text


def test_prefill_sweep_records_an_out_of_memory_length_and_goes_on(monkeypatch):
    class Model(torch.nn.Module):
        vocab_size = 8

    monkeypatch.setattr(prefill, "init_parallel", lambda *a, **k: torch.device("cpu"))
    monkeypatch.setattr(prefill, "build_model", lambda *a, **k: Model())
    monkeypatch.setattr(prefill.dist, "get_world_size", lambda: 1)

    def run_seq(args, model, seq, overlap, device):
        if seq == 64:
            raise torch.OutOfMemoryError("too long")
        return dict(seq=seq, policies={"stock": {}})

    monkeypatch.setattr(prefill, "_run_seq", run_seq)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    args = prefill.parse_args(["--model", "qwen", "--seqs", "16,64,32"])
    results = prefill.run_all(args)
    assert [r["seq"] for r in results] == [16, 64, 32]
    assert results[1]["oom"] and not results[2].get("oom")


def test_prefill_schedule_runs_every_policy_as_often_first_as_last():
    assert prefill._schedule(["a", "b"], 3) == list("abbaab")
    order = prefill._schedule(["a", "b", "c"], 4)
    assert order == list("abccbaabccba")
    assert prefill._schedule(["a"], 2) == ["a", "a"]


def test_prefill_cuda_graph_turns_the_overlap_on_and_needs_cuda(monkeypatch):
    args = prefill.parse_args(["--cuda-graph"])
    assert args.moe_overlap and args.cuda_graph
    assert prefill.parse_args(["--cuda-graph", "--tp", "2", "--ep", "2"]).ep == 2

    class Model(torch.nn.Module):
        vocab_size = 8

    monkeypatch.setattr(prefill, "init_parallel", lambda *a, **k: torch.device("cpu"))
    monkeypatch.setattr(prefill, "build_model", lambda *a, **k: Model())
    with pytest.raises(ValueError, match="needs CUDA"):
        prefill.run_all(args)


def test_prefill_cuda_graph_installs_the_inference_rng_tracker_before_the_model_is_built(
        monkeypatch):
    """TE's attention keeps the tracker object it finds at construction: a training
    tracker there reseeds the generator inside the capture, which torch refuses."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.initialize_rng_tracker(force_reset=True)  # a training tracker, as after init_parallel
    seen = []

    class Built(Exception):
        pass

    def build_model(*args, **kwargs):
        seen.append(mrandom.get_cuda_rng_tracker().fork() is not None
                    and type(mrandom.get_cuda_rng_tracker()).__name__)
        raise Built

    monkeypatch.setattr(prefill, "init_parallel", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(prefill, "build_model", build_model)
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: None)
    try:
        with pytest.raises(Built):
            prefill.run_all(prefill.parse_args(["--cuda-graph"]))
    finally:
        mrandom.initialize_rng_tracker(force_reset=True)
    assert seen == ["InferenceCudaRNGStatesTracker"]


@pytest.mark.parametrize("bad", ["16,x", "0,16"])
def test_prefill_rejects_bad_sequence_lists(bad):
    with pytest.raises((ValueError, argparse.ArgumentError)):
        prefill.parse_args(["--seqs", bad])


def test_abba_rounds_pair_a_seeded_random_order_with_its_reverse():
    from benchlib import abba

    calls = []
    policies = {n: (lambda n=n: calls.append(n)) for n in "abcdef"}
    per = abba(policies, samples=8, warmup=0)
    assert all(len(v) == 8 for v in per.values())
    rounds = [calls[i:i + 6] for i in range(0, len(calls), 6)]
    assert all(rounds[i + 1] == rounds[i][::-1] for i in range(0, 8, 2))
    assert len({tuple(r) for r in rounds[::2]}) > 1  # the neighbours change between pairs
    again = []
    abba({n: (lambda n=n: again.append(n)) for n in "abcdef"}, samples=8, warmup=0)
    assert again == calls  # the same order on every rank and every run


def test_bootstrap_interval_of_the_median_brackets_it_and_narrows_with_more_samples():
    from megatron_overlap.stats import bootstrap_ci

    gen = torch.Generator().manual_seed(0)
    few = (torch.randn(12, generator=gen) + 5).tolist()
    many = (torch.randn(400, generator=gen) + 5).tolist()
    lo, hi = bootstrap_ci(few)
    assert min(few) <= lo <= statistics.median(few) <= hi <= max(few) and lo < hi
    lo2, hi2 = bootstrap_ci(many)
    assert lo2 < 5 < hi2 and hi2 - lo2 < (hi - lo) / 2
    assert bootstrap_ci([3.0, 1.0]) == (1.0, 3.0)  # too few samples: their range
    with pytest.raises(ValueError, match="at least one"):
        bootstrap_ci([])


def test_k_epi_fit_recovers_the_per_wave_part_that_does_not_scale_with_k():
    b, k_epi = 0.02, 600.0
    t = lambda k: b * (k + k_epi)  # noqa: E731
    assert calibrate.fit_k_epi(704, t(704), 352, t(352)) == pytest.approx(k_epi)
    assert calibrate.fit_k_epi(704, b * 704, 352, b * 352) == pytest.approx(0.0)  # the paper
    assert calibrate.fit_k_epi(704, 1.0, 352, 1.2) is None  # slower at half K: no fit


def _fit_fusion(monkeypatch, capsys, *argv) -> str:
    import fit_fusion

    monkeypatch.setattr(sys, "argv", ["fit_fusion.py", *argv, "--data", GOLDEN])
    assert fit_fusion.main() == 0
    return capsys.readouterr().out


ONE_GPU_FINAL = "h200-1gpu-overlap"  # every one-GPU H200 prefill run with the overlap on


@pytest.mark.parametrize("runs, preset, want", [
    (ONE_GPU_FINAL, "h200", "15 of 15"), ("h200x2-nothreshold", "h200", "28 of 30"),
    ("h100-1gpu-nothreshold", "h100", "9 of 9")])
def test_the_shipped_step_costs_decide_the_recorded_prefills_as_measured(
        monkeypatch, capsys, runs, preset, want):
    """The fuse-or-not model replayed on every recorded complete-model prefill (local
    experts): each workload's decision agrees with its median measured speedup (within
    3% of 1.0 either agrees); on two H200s two workloads contradict any one host term."""
    out = _fit_fusion(monkeypatch, capsys, "check", "--prefill", runs, "--preset", preset)
    assert f"{want} workloads decided as measured" in out


def test_the_fused_path_is_refused_where_the_model_prices_it_slower_and_taken_where_faster(
        monkeypatch, capsys):
    """Both directions at sizes of the recorded two-H200 sweep: Granite TP2EP1 lost
    overlapped at S <= 2048 (0.90x, 0.92x measured) and gained at S >= 8192 (1.15x,
    1.17x). (S = 4096, 0.915x, is one of the two workloads no host term decides right.)"""
    out = _fit_fusion(monkeypatch, capsys, "check", "--prefill", "h200x2-nothreshold")
    lines = {int(line.split(":")[0].split("=")[-1]): line for line in out.splitlines()
             if line.strip().startswith("granite   TP2EP1")}
    assert all("stock" in lines[s] for s in (1024, 2048)), lines
    assert all("fuse " in lines[s] for s in (8192, 16384)), lines
    assert [s for s, line in lines.items() if "against" in line] == [4096], lines


@pytest.mark.parametrize("runs, preset, field", [
    (f"{ONE_GPU_FINAL},h200x2-nothreshold", "h200", "op_host_us"),
    (f"{ONE_GPU_FINAL},h200x2-nothreshold", "h200", "group_host_us"),
    ("h100-1gpu-nothreshold", "h100", "op_host_us")])
def test_the_shipped_host_terms_are_the_fit_of_the_recorded_prefills(monkeypatch, capsys,
                                                                     runs, preset, field):
    """H_op (one rank) and H_group (more) as shipped are the midpoints `fit_fusion.py fit`
    reports: every one-rank workload decided as measured; on two H200s none decides all
    30, and the midpoint of the two bounds that conflict is shipped."""
    from megatron_overlap.planner import get_preset

    out = _fit_fusion(monkeypatch, capsys, "fit", "--prefill", runs, "--preset", preset)
    line = next(line for line in out.splitlines() if line.startswith(field))
    shipped = getattr(get_preset(preset).step_costs, field)
    if "midpoint" in line:
        assert float(line.split("midpoint")[1]) == pytest.approx(shipped, abs=0.05), line
    else:  # (conflicting bounds: the shipped value lies between them)
        lo, hi = (float(x) for x in line.split("> ")[1].split(")")[0].split(" and < "))
        assert hi < shipped < lo, line


def test_overlap_factor_fit_recovers_the_f_and_constant_of_a_model_curve():
    from megatron_overlap.planner import Calibration, DeviceSpec, KernelSpec, Workload, plan

    kernel = KernelSpec(128, 128, 64, 1024, 2, 1, tail_helpers=True)
    w = Workload(16384, 2048, 704, 2, 4, (1092,) * 60, topk=4)
    base = Calibration(1.59, 704, 128, 128, 2, 56, 64, 1024, k_epi=971.4, topk_ref=4)

    def curve_for(f):
        return dict(plan(w, kernel, DeviceSpec("h", 132), dataclasses.replace(
            base, overlap_factor=f)).curve)

    truth = curve_for(1.7)
    t_comp = 0.0146  # ms per compute wave
    cs = (4, 6, 8, 12, 16, 20, 24, 28, 32, 40, 48)
    times = {c: 0.3 + t_comp * truth[c] for c in cs}
    grid = tuple(1 + i / 10 for i in range(21))
    f, t0, rms = calibrate.fit_overlap_factor(times, t_comp, curve_for, grid)
    assert f == pytest.approx(1.7) and t0 == pytest.approx(0.3) and rms < 1e-9
    # C past the model's C_max is left out rather than failing
    f2, _, _ = calibrate.fit_overlap_factor({**times, 60: 1.0}, t_comp, curve_for, grid)
    assert f2 == pytest.approx(1.7)


def test_bench_op_confirmation_times_the_planner_against_the_fastest_swept_c(monkeypatch):
    import bench_op

    seen = {}

    def fake_abba(pair, samples, warmup, group, progress=""):
        seen.update(names=sorted(pair), samples=samples)
        return {"planner": [1.10] * samples, "C=12": [1.00] * samples}

    monkeypatch.setattr(bench_op, "abba", fake_abba)
    pol = {"planner": "p", "sweep C=12": "s12", "sweep C=16": "s16"}
    got = bench_op.confirm(pol, 12, 16, 6, 1, None, "case")
    assert seen == dict(names=["C=12", "planner"], samples=6)
    assert got["oracle_c"] == 12 and got["regret"] == pytest.approx(0.10)
    assert not got["same_config"] and got["spread"] == pytest.approx(0.10)
    assert (got["planner_ms"], got["oracle_ms"]) == (pytest.approx(1.10), pytest.approx(1.00))
    # the sweep's fastest C is the planner's: one configuration timed twice, regret 0
    same = bench_op.confirm(pol, 12, 12, 6, 1, None, "case")
    assert same["same_config"] and same["regret"] == 0.0
    assert same["spread"] == pytest.approx(0.10)


def test_report_counts_no_regret_where_the_planner_chose_the_oracle_c():
    """Older runs stored the re-timing of the planner's own C as regret: the
    report reads it as timing noise (the spread column) and the regret as 0."""
    def row(c_star, oracle_c, regret, **extra):
        return dict(comm_ctas=c_star, confirm=dict(oracle_c=oracle_c, regret=regret, **extra))

    old_same, old_other = row(132, 132, 0.09), row(132, 66, 0.03)
    new_same = row(132, 132, 0.0, same_config=True, spread=-0.05)
    assert report.confirmed_regret(old_same) == 0.0
    assert report.confirmed_regret(old_other) == pytest.approx(0.03)
    assert report.confirmed_regret(new_same) == 0.0
    assert report.retiming_spread(old_same) == pytest.approx(0.09)
    assert report.retiming_spread(new_same) == pytest.approx(0.05)
    assert report.retiming_spread(old_other) is None
    assert report.confirmed_regret(dict(comm_ctas=4)) is None


def _layer_input_case(rank, world):
    import mcore_shims

    mcore_shims.install()
    import bench_layer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_overlap.mcore import (OverlapMoELayer, build_model, init_parallel,
                                        set_overlap_enabled, token_inputs)
    from megatron_overlap.ops import OverlapConfig

    device = init_parallel(1, 1, seed=0, preload="mcore_shims")
    args = argparse.Namespace(input_layer=2, backend="interpret", fuse="always",
                              tiny=True,
                              no_bias_swiglu_fusion=False)
    layer, hidden = bench_layer.build_case("qwen", 1, 1, 16, 2, args, device)
    skew = bench_layer.routing_skew(layer, hidden)
    # the same model, run to the end: what its second MoE layer got
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model = build_model("qwen", 1, 1, 2, overlap=OverlapConfig(backend="interpret"),
                        tiny=True).eval()
    set_overlap_enabled(model, False)  # the capture runs the layers before it stock
    seen = []
    target = [m for m in model.modules() if isinstance(m, OverlapMoELayer)][-1]
    target.register_forward_pre_hook(lambda mod, inputs: seen.append(inputs[0].clone()))
    tokens, positions = token_inputs(2, 16, model.vocab_size, device)
    with torch.no_grad():
        model(tokens, positions, None)
    def refusal(name, input_layer):
        try:
            bench_layer.build_case(name, 1, 1, 16, 2, argparse.Namespace(
                **{**vars(args), "input_layer": input_layer}), device)
        except ValueError as e:
            return str(e)
        return None

    dense, too_deep = refusal("deepseek", 1), refusal("qwen", 99)
    return dict(layer_number=layer.layer_number, shape=tuple(hidden.shape), too_deep=too_deep,
                same=torch.equal(hidden, seen[0]), overlap_enabled=layer.overlap_enabled,
                topk=layer.config.moe_router_topk, experts=layer.config.num_moe_experts,
                skew=skew, dense=dense)


def test_layer_benchmark_input_layer_is_what_that_layer_gets_in_a_prefill():
    from dist_harness import run_ranks

    (r,) = run_ranks(1, _layer_input_case)
    assert r["layer_number"] == 2 and r["shape"] == (16, 2, 64) and r["same"]
    assert r["overlap_enabled"]  # the capture ran the stock path, the timed layer is ours
    assert r["skew"]["mean"] == 16 * 2 * r["topk"] / r["experts"]
    assert r["skew"]["max_over_mean"] == r["skew"]["max_e"] / r["skew"]["mean"] >= 1
    assert "layer 1 of deepseek is dense" in r["dense"]
    assert "qwen has 2 layers" in r["too_deep"]  # (tiny models have two)


def test_grid_report_reads_both_halves_of_the_recorded_fuse_or_not_grid(tmp_path):
    # the recorded H200 grid (docs/data): 24 prefill and 24 training points, every one
    # fused by the planner and measured no slower, the stock arm syncing twice per call
    import report_grid

    data = os.path.join(os.path.dirname(__file__), "..", "docs", "data")
    points = report_grid.load_points(data, "h200")
    by_mode = {m: [p for p in points if p["mode"] == m] for m in ("prefill", "train")}
    assert {m: len(v) for m, v in by_mode.items()} == {"prefill": 24, "train": 24}
    assert all(p["ratio"] >= 0.99 and p["predicted_saved_ms"] > 0 for p in points)
    assert all(p["syncs"] == {"stock": 2.0, "overlap": 0.0} for p in by_mode["train"])
    text = report_grid.table(points) + report_grid.summary(points)
    assert "train: min on/off 1.006x over 24 points" in text
    report_grid.figure(points, str(tmp_path / "grid.png"))
    assert (tmp_path / "grid.png").stat().st_size > 10_000
    # the H100's prefill grid (B = 4) is its own population, never mixed into the H200's
    h100 = report_grid.load_points(data, "h100")
    assert len(h100) == 9 and {p["mode"] for p in h100} == {"prefill"}
    assert min(p["ratio"] for p in h100) >= 0.99


def _fake_prefill(monkeypatch, argv, ms):
    """prefill.run_all on a stand-in model whose call records (overlap on, both MoE
    fusion flags) and takes `ms[(overlap, fused)]`: (results, the calls' states)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_overlap.mcore import baselines

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    state, calls = {"overlap": False}, []

    class Model(torch.nn.Module):
        vocab_size = 8

        def __init__(self):
            super().__init__()
            self.config = config

        def forward(self, *args, **kwargs):
            flags = (config.moe_permute_fusion, config.moe_router_fusion)
            calls.append((state["overlap"], *flags))
            return (state["overlap"], flags[0])

    def time_once(forward, device, grad=False):
        return ms[forward()] / 1e3

    monkeypatch.setattr(prefill, "init_parallel", lambda *a, **k: torch.device("cpu"))
    monkeypatch.setattr(prefill, "build_model", lambda *a, **k: Model())
    monkeypatch.setattr(prefill, "token_inputs", lambda *a: (None, None))
    monkeypatch.setattr(prefill, "_time_once", time_once)
    monkeypatch.setattr(prefill.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(prefill, "check_moe_fusions_available", lambda: None)
    monkeypatch.setattr(baselines, "set_overlap_enabled",
                        lambda model, on: state.update(overlap=on))
    return prefill.run_all(prefill.parse_args(argv)), calls


def test_prefill_times_both_moe_flag_baselines_in_one_schedule_and_records_them(monkeypatch):
    """--baselines default,fused: four arms, each call under its own flags (both Megatron
    fusions set together), stock / overlap per baseline; --moe-fusions alone: the fused
    flags in both arms, named as the primary's."""
    ms = {(False, False): 40.0, (True, False): 20.0, (False, True): 30.0, (True, True): 20.0}
    (r,), calls = _fake_prefill(monkeypatch, ["--seq", "16", "--abba", "--iters", "4",
                                              "--baselines", "default,fused"], ms)
    assert set(r["policies"]) == {"stock", "overlap", "stock-fused", "overlap-fused"}
    assert r["speedups_by_baseline"] == {"default": 2.0, "fused": 1.5} and r["speedup"] == 2.0
    assert r["baselines"] == ["default", "fused"] and r["moe_fusions"] is False
    assert all(permute == router for _, permute, router in calls)
    assert {c for c in calls} == {(o, f, f) for o in (False, True) for f in (False, True)}
    (r,), calls = _fake_prefill(monkeypatch, ["--seq", "16", "--abba", "--iters", "2",
                                              "--moe-fusions"], ms)
    assert set(r["policies"]) == {"stock", "overlap"} and r["moe_fusions"] is True
    assert r["speedups_by_baseline"] == {"fused": 1.5} and all(c[1] for c in calls)
    with pytest.raises(ValueError, match="--moe-fusions is --baselines fused"):
        prefill.parse_args(["--moe-fusions", "--baselines", "default"])
    with pytest.raises(ValueError, match="--baselines"):
        prefill.parse_args(["--baselines", "default,default"])


def test_report_shows_the_fused_flags_ratio_beside_the_default_one(tmp_path):
    rows = [_result("qwen", 4096, 1.2), _result("qwen", 16384, 1.1)]
    for r, tuned in zip(rows, (1.05, 0.98)):
        r["speedups_by_baseline"] = dict(default=r["speedup"], fused=tuned)
    text = report_model.prefill_section("t", rows, str(tmp_path))
    assert "| speedup, fused MoE flags |" in text
    assert "| 1.200x |" in text and "| 1.050x |" in text and "| 0.980x |" in text
    assert f"| {math.sqrt(1.05 * 0.98):.3f}x | 0.980x |" in text
    assert "fused MoE flags" not in report_model.prefill_section("t", rows[:0] + [
        _result("qwen", 4096, 1.2)], str(tmp_path))


def test_grid_report_adds_the_fused_flags_ratio_from_its_own_files(tmp_path):
    """`gridfused_*` files (stage grid, GRID_FUSED=1) are read with --prefix gridfused, never
    with the plain grid's; each row carries stock / overlap under the fused flags."""
    import json

    import report_grid

    pol = lambda ms: dict(median_ms=ms)  # noqa: E731
    runs = [dict(model="qwen", batch=4, seq=s, policies={
        "stock": pol(12.0), "overlap": pol(10.0), "stock-fused": pol(10.0),
        "overlap-fused": pol(9.0 + i)}, speedups_by_baseline=dict(default=1.2,
                                                                  fused=10.0 / (9.0 + i)))
        for i, s in enumerate((4096, 16384))]
    (tmp_path / "gridfused_h200_prefill_qwen_B4.json").write_text(json.dumps(runs))
    assert report_grid.load_points(str(tmp_path), "h200") == []
    points = report_grid.load_points(str(tmp_path), "h200", prefix="gridfused")
    text = report_grid.table(points) + "\n" + report_grid.summary(points)
    assert "| on / off, fused MoE flags |" in text and "| 1.11x |" in text
    assert "fused MoE flags: min 1.000x over 2 points, geomean at S >= 4096 " \
           f"{math.sqrt(10 / 9):.3f}x" in text


@pytest.mark.parametrize("flags, message", [
    (["--fp8-recipe", "blockwise", "--impls", "local"], "FP8 experts are TE's"),
    (["--fp8-recipe", "tensorwise", "--impls", "te", "--cuda-graph"], "no capture"),
    (["--fp8-recipe", "mxfp8", "--impls", "te"], "invalid choice")])
def test_layer_benchmark_refuses_fp8_runs_it_cannot_make_by_name(flags, message):
    import subprocess

    tool = os.path.join(os.path.dirname(__file__), "..", "tools", "bench_layer.py")
    done = subprocess.run([sys.executable, tool, *flags], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-500:]


def test_layer_benchmark_policy_opts_fp8_layers_in_with_its_fp8_flag():
    import bench_layer

    args = argparse.Namespace(fuse="always", fp8_recipe="blockwise")
    assert bench_layer.layer_policy(args).fp8 is True
    assert bench_layer.layer_policy(argparse.Namespace(fuse="auto")).fp8 is False


def _layer_backward_case(rank, world):
    import mcore_shims

    mcore_shims.install()
    import bench_layer

    from megatron_overlap.mcore import init_parallel

    device = init_parallel(1, 1, seed=0, preload="mcore_shims")
    args = argparse.Namespace(input_layer=0, backend="interpret", fuse="always", tiny=True,
                              no_bias_swiglu_fusion=False, impls=["local"],
                              baseline_list=["default"], backward=True, samples=2, warmup=1,
                              cuda_graph=False)
    return bench_layer.layer_case("qwen", 1, 1, 16, 2, args, device)


def test_layer_benchmark_backward_mode_times_training_steps_after_checking_input_gradients():
    from dist_harness import run_ranks

    (r,) = run_ranks(1, _layer_backward_case)
    assert r["mode"] == "forward+backward", r["mode"]
    assert {"stock", "overlap"} <= set(r["stats"]), r["stats"]
    assert all(len(v) == 2 for v in r["samples"].values()), r["samples"]
    grad = r["grad_agreement"]["local"]
    assert 0 <= grad["rel_err"] < 2e-2 and grad["max_abs_diff"] >= 0, grad
    assert r["rel_err"] < 2e-2, r["rel_err"]
