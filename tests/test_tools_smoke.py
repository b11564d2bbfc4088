"""The device tools' CPU smoke modes (two ranks, the Triton interpreter): each runs the op
through the session's public calls, checks it before timing and writes its JSON."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _smoke(tool: str, tmp_path, *flags) -> dict:
    out = tmp_path / f"{tool}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(ROOT, "tools", f"{tool}.py"), "--smoke", *flags, "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env=dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(out.read_text())


def test_bench_op_smoke_checks_every_policy_then_times_the_prepared_and_one_side_calls(tmp_path):
    rows = _smoke("bench_op", tmp_path, "--layout", "TP2EP1", "--routing", "uniform")["results"]
    assert len(rows) == 1 and rows[0]["world"] == 2
    r = rows[0]
    assert r["rel_err"] < 2e-2  # the planner's op against the reference, before timing
    stats = set(r["stats"])
    assert {"reference", "planner", "planner(prepared)", "reference(prepared)",
            "gemm2_alone(ours,P=all)", "gemm2_alone(ours,P=all,L=1)"} <= stats
    assert any(name.startswith("comm_alone(C=") for name in stats)
    assert all(len(v) == 3 for v in r["samples"].values())


def test_calibrate_smoke_measures_each_side_alone_and_writes_a_preset(tmp_path):
    data = _smoke("calibrate", tmp_path, "--layout", "TP2EP1")
    assert {"preset", "measured", "env", "command"} <= set(data)
    assert data["measured"]


def test_calibrate_fp8_smoke_adds_the_fp8_family_to_its_base_and_keeps_the_rest(tmp_path):
    from megatron_overlap.planner import get_preset, load_preset_file

    data = _smoke("calibrate", tmp_path, "--layout", "TP1EP2", "--fp8", "block",
                  "--base", "h200")
    preset = load_preset_file(tmp_path / "calibrate.json")
    base = get_preset("h200")
    assert set(preset.fp8) == {"block"} and preset.calibration == base.calibration
    assert preset.step_costs == base.step_costs
    family = preset.fp8["block"]
    assert family.calibration.k_ref == data["measured"]["k"] and family.wave_us > 0
    assert set(data["measured"]["ms"]) == {"bf16", "fp8", "fp8 K/2"}


def test_tune_tiles_smoke_picks_gemm2_and_gatherrs_tiles(tmp_path):
    data = _smoke("tune_tiles", tmp_path)
    assert set(data["best"]) >= {"gemm", "comm", "placement"}
    assert any(name.startswith("gemm2 ") for name in data["info"])
