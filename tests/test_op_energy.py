"""The op's energy measurement (`tools/op_energy.py`): the byte model of each arm, the
parts' energy fit, the power roof, and a run of the tool on the interpreter."""

import json
import math
import os
import subprocess
import sys

import pytest

TOOLS = os.path.join(os.path.dirname(__file__), "..", "tools")
sys.path.insert(0, TOOLS)

import op_energy  # noqa: E402
import roofline  # noqa: E402

GRANITE_4K = dict(model="granite", layout="TP1EP1", seq=4096, gemm_flops=2 * 131072 * 1024 * 512)
TRUE = dict(p0_w=150.0, e_flop_pj=0.35, e_byte_pj=45.0)  # a made-up GPU


def test_the_ops_bytes_are_its_two_parts_and_y_on_chip_saves_ys_round_trip():
    """Granite TP1EP1 S = 4096 at L = 2: the op moves what GEMM2 (x once per split) and
    GatherRS (y back, the output) move; with y on chip x once, W and the output."""
    sizes = roofline.op_bytes(GRANITE_4K)
    assert sizes == dict(x=131072 * 512 * 2, w=32 * 1024 * 512 * 2, y=131072 * 1024 * 2,
                         out=16384 * 1024 * 2)
    b = op_energy.arm_bytes(sizes, splits=2)
    assert b["op"] == b["gemm2(ours)"] + b["gather_rs"]
    assert b["gemm2(ours)"] - b["gemm2(torch)"] == sizes["x"]  # the second split's re-read
    assert b["op"] - b["fused"] == 2 * sizes["y"] + sizes["x"]
    assert roofline.bounds(GRANITE_4K, 790.0, 4.3)["bytes_today"] == op_energy.arm_bytes(
        sizes, splits=1)["op"] == b["stored"]


def test_blocks_that_keep_y_in_l2_pay_only_where_their_re_reads_cost_less_than_ys_trip():
    """A block's y (at most an L2) stays on chip; every token band re-reads W, every
    column split x. Bands alone beat storing y only where W < 2 L2, splits alone where
    x < 2 L2 (per L2 of y, the re-read against the L2's round trip): Granite's 32 MiB of W
    pays, so its best blocks are bands; Qwen's 330 MiB of W and 176 MiB of x do not,
    and no mix of the two does. An L2 as large as y is one block, nothing re-read."""
    qwen = dict(model="qwen", layout="TP1EP1", seq=4096, gemm_flops=2 * 65536 * 2048 * 1408)
    for row, cheaper in ((GRANITE_4K, True), (qwen, False)):
        sizes = roofline.op_bytes(row)
        x, w, y, out = sizes["x"], sizes["w"], sizes["y"], sizes["out"]
        assert (w < 2 * op_energy.L2_BYTES) is cheaper and x > 2 * op_energy.L2_BYTES
        b = op_energy.arm_bytes(sizes, splits=4)
        assert (b["blocks"] < b["stored"]) is cheaper
        n = math.ceil(y / op_energy.L2_BYTES)
        assert b["blocks"] <= min(x + w * n + out, x * n + w + out)
        got, bands, splits = op_energy.l2_blocks(sizes, op_energy.L2_BYTES)
        assert got == b["blocks"] == w * bands + x * splits + out and bands * splits >= n
        assert b["fused"] < min(b["blocks"], b["stored"]) <= b["stored"] < b["op"]
        assert op_energy.arm_bytes(sizes, 4, l2_bytes=y)["blocks"] == b["fused"]
    assert op_energy.l2_blocks(roofline.op_bytes(GRANITE_4K), op_energy.L2_BYTES)[1:] == (6, 1)
    with pytest.raises(ValueError, match="l2_bytes must be > 0"):
        op_energy.arm_bytes(sizes, 4, l2_bytes=0)


def _points(model, noise=()):
    """(t, F, B, E) of GEMM2s and GatherRS-alone windows of three sizes, E from `model`."""
    pts = []
    for i, (t, f, b) in enumerate([(3e-4, 1.4e11, 4.7e8), (1e-3, 5.5e11, 1.9e9),
                                   (7e-4, 5.0e11, 6.0e8), (2.6e-3, 2.0e12, 2.4e9),
                                   (1.1e-4, 0, 3.0e8), (6e-4, 0, 1.2e9)]):
        e = op_energy.energy_j(model, t, f, b) * (1 + (noise[i] if noise else 0))
        pts.append((t, f, b, e))
    return pts


def test_the_fit_recovers_a_known_gpus_coefficients_and_tolerates_noise():
    got = op_energy.fit_energy(_points(TRUE))
    for key, want in TRUE.items():
        assert got[key] == pytest.approx(want, rel=1e-6)
    assert got["rms_rel"] < 1e-9 and got["points"] == 6
    noisy = op_energy.fit_energy(_points(TRUE, noise=(0.01, -0.01, 0.005, -0.005, 0.01, -0.01)))
    assert noisy["e_flop_pj"] == pytest.approx(TRUE["e_flop_pj"], rel=0.1)
    assert noisy["e_byte_pj"] == pytest.approx(TRUE["e_byte_pj"], rel=0.2)
    assert 0.001 < noisy["max_rel"] < 0.02


def test_windows_at_one_power_leave_p0_unidentified_and_the_fit_says_so():
    """Every window at the cap (600 W): each one's time is its dynamic energy over the
    450 W above P_0, so t is proportional to e_F F + e_B B and any P_0 <= 600 W fits as
    well; cond shows it, where the windows of `_points` (various powers) do not."""
    dyn = lambda f, b: (TRUE["e_flop_pj"] * f + TRUE["e_byte_pj"] * b) * 1e-12  # noqa: E731
    capped = [(dyn(f, b) / 450.0, f, b, 600.0 * dyn(f, b) / 450.0) for _, f, b, _ in _points(TRUE)]
    assert op_energy.fit_energy(capped)["cond"] > 1e6 * op_energy.fit_energy(_points(TRUE))["cond"]


def test_the_fit_refuses_too_few_points_and_energies_that_are_not_positive():
    with pytest.raises(ValueError, match=">= 3 points"):
        op_energy.fit_energy(_points(TRUE)[:2])
    with pytest.raises(ValueError, match="energy must be > 0"):
        op_energy.fit_energy(_points(TRUE)[:3] + [(1e-3, 1e9, 1e9, 0.0)])


def test_the_power_roof_is_the_dynamic_energy_over_the_power_left_above_p0():
    ms = op_energy.power_roof_ms(TRUE, 1e12, 1e9, cap_w=700.0)
    assert ms == pytest.approx((0.35 * 1e12 + 45.0 * 1e9) * 1e-12 / 550.0 * 1e3)
    with pytest.raises(ValueError, match="must exceed P_0"):
        op_energy.power_roof_ms(TRUE, 1e12, 1e9, cap_w=150.0)


def test_an_op_running_at_its_roof_reads_one_and_the_roof_ratio_is_the_energies_ratio():
    """Synthetic windows drawn from TRUE at a 700 W cap: the parts (at different powers,
    which is what tells P_0 from the e's) give back TRUE, the op (timed at its roof)
    reads 1.00 of it, and its energy is predicted from the parts."""
    flops = GRANITE_4K["gemm_flops"]
    b = op_energy.arm_bytes(roofline.op_bytes(GRANITE_4K), splits=2)
    f = op_energy.arm_flops(flops)
    arms, slower = {}, {"op": 1.0, "gemm2(torch)": 1.0, "gemm2(ours)": 1.1, "gather_rs": 2.0}
    for arm in op_energy.ARMS:
        ms = op_energy.power_roof_ms(TRUE, f[arm], b[arm], 700.0) * slower[arm]
        arms[arm] = dict(ms_per_call=ms,
                         energy_j_per_call=op_energy.energy_j(TRUE, ms * 1e-3, f[arm], b[arm]))
    got = op_energy.assess([dict(case="granite", arms=arms, flops=f, bytes=b)], cap_w=700.0)
    assert got["model"]["p0_w"] == pytest.approx(TRUE["p0_w"], rel=1e-4)
    w = got["workloads"][0]
    assert w["op_over_roof"] == pytest.approx(1.0, rel=1e-4)
    assert w["op_energy_pred"] == pytest.approx(arms["op"]["energy_j_per_call"], rel=1e-4)
    dyn = lambda arm: 0.35 * f[arm] + 45.0 * b[arm]  # noqa: E731
    assert w["ratio_roof"] == pytest.approx(dyn("op") / dyn("gemm2(torch)"), rel=1e-4)
    assert w["ratio_roof_fused"] < w["ratio_roof_stored"] < w["ratio_roof"]
    assert w["ratio_roof_blocks"] == pytest.approx(dyn("blocks") / dyn("gemm2(torch)"), rel=1e-4)
    lines = op_energy.table([dict(case="granite", arms={
        a: dict(v, power_w_from_energy=700.0, sm_clock_mhz_mean=1700.0, power_cap_share=1.0)
        for a, v in arms.items()})], got)
    assert any("P_0 = 150 W" in line for line in lines)
    assert sum(line.startswith("| granite |") for line in lines) == 4 + 1


def test_a_window_holds_enough_calls_and_refuses_what_cannot_be_timed():
    assert op_energy.window_calls(0.3, 3.0) == 10000
    assert op_energy.window_calls(5000.0, 3.0) == 1
    for bad in ((0.0, 3.0), (0.3, 0.0), (float("nan"), 3.0)):
        with pytest.raises(ValueError, match="must be > 0"):
            op_energy.window_calls(*bad)


def _tool(*args, tmp_path, launcher=("-m", "torch.distributed.run", "--nproc-per-node", "1")):
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, *launcher, os.path.join(TOOLS, "op_energy.py"), *args],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)


def test_the_tool_times_every_arm_on_the_interpreter_and_says_why_it_fits_nothing(tmp_path):
    """Without a GPU: every arm launched (no graph) and timed, the bytes and FLOPs of
    each recorded, no energy (no NVML), and no fit, said so."""
    got = _tool("--smoke", "--json", str(tmp_path / "e.json"), tmp_path=tmp_path)
    assert got.returncode == 0, got.stderr[-2000:]
    assert "no energy fit" in got.stdout
    row = json.load(open(tmp_path / "e.json"))["results"][0]
    assert set(row["arms"]) == set(op_energy.ARMS)
    assert all(a["ms_per_call"] > 0 and a["how"] == "eager" and a["windows"] == 2
               for a in row["arms"].values())
    assert row["bytes"]["op"] == row["bytes"]["gemm2(ours)"] + row["bytes"]["gather_rs"]


@pytest.mark.parametrize("flags", [["--window-s", "0"], ["--rounds", "0"], ["--cap-w", "-1"]])
def test_the_tool_refuses_flags_that_cannot_run_naming_them(flags, tmp_path):
    got = _tool("--smoke", *flags, tmp_path=tmp_path, launcher=())
    assert got.returncode == 2 and "--window-s, --cap-w and --l2-mb must be > 0" in got.stderr


def test_reassessing_a_stored_measurement_adds_the_designs_roofs_without_a_gpu(tmp_path):
    """The H100's measurement, written before the stored and blocks designs existed: the
    fit is the one published (P_0 214 W) and every workload gains their roofs."""
    data = os.path.join(TOOLS, "..", "docs", "data", "op_energy_h100_TP1EP1.json")
    got = _tool("--reassess", data, "--l2-mb", "50", "--json", str(tmp_path / "r.json"),
                tmp_path=tmp_path, launcher=())
    assert got.returncode == 0, got.stderr[-2000:]
    assert "stored / blocks / fused" in got.stdout
    out = json.load(open(tmp_path / "r.json"))
    assert out["assessed"]["model"]["p0_w"] == pytest.approx(214, abs=1)
    assert out["l2_bytes"] == 50 * 2 ** 20 and len(out["assessed"]["workloads"]) == 6
    for w in out["assessed"]["workloads"]:
        assert w["ratio_roof_fused"] < w["ratio_roof_stored"] < w["ratio_roof"]
        assert (w["ratio_roof_blocks"] < w["ratio_roof_stored"]) == w["case"].startswith("granite")
