"""The `plan` command line is a contract other tools call: keys, table, plot, errors."""

import json
import subprocess
import sys

import pytest

PLAN = [sys.executable, "-m", "megatron_overlap", "plan", "--preset", "a100-paper",
        "--tokens", "16384", "--hidden", "2048", "--ffn", "704", "--world", "4",
        "--splits", "2", "--expert-counts", "120,0,77,1000,3000"]


def run(args):
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def test_plan_json_has_the_contract_keys():
    out = run(PLAN + ["--json"])
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    for key in ("comm_ctas", "reservation", "compute_slots", "predicted", "solver_us",
                "solver_first_us"):
        assert key in result
    assert [p["C"] for p in result["predicted"]] == list(range(1, 17))
    best = min(p["T"] for p in result["predicted"])
    assert next(p["T"] for p in result["predicted"] if p["C"] == result["comm_ctas"]) == best
    assert result["compute_slots"] == 2 * (108 - result["reservation"])


def test_plan_table_and_plot(tmp_path):
    png = tmp_path / "curve.png"
    out = run(PLAN + ["--groups", "1", "--plot", str(png)])
    assert out.returncode == 0, out.stderr
    assert "<- C*" in out.stdout and "R(C)" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("bad,message", [
    (["--expert-counts", "1,-2"], "expert_counts[1]"),
    (["--expert-counts", "1,x"], "comma-separated integers"),
    (["--world", "0"], "world"),
])
def test_plan_rejects_bad_input_with_a_clear_message(bad, message):
    args = list(PLAN)
    flag = bad[0]
    i = args.index(flag)
    args[i + 1] = bad[1]
    out = run(args + ["--json"])
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_plan_rejects_a_non_positive_topk_with_a_clear_message():
    out = run(list(PLAN) + ["--topk", "0", "--json"])
    assert out.returncode == 2
    assert "topk" in out.stderr and "Traceback" not in out.stderr


def test_package_import_is_light_and_exposes_the_public_names():
    code = ("import sys, megatron_overlap as m; assert 'torch' not in sys.modules; "
            "assert m.plan and m.Workload; "
            "assert m.gemm2_gather_rs.__name__ == 'gemm2_gather_rs'; print('ok')")
    out = run([sys.executable, "-c", code])
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_plan_models_the_ops_tail_helpers_and_local_rows_when_asked():
    h200 = [sys.executable, "-m", "megatron_overlap", "plan", "--preset", "h200",
            "--tokens", "16384", "--hidden", "2048", "--ffn", "704", "--world", "2",
            "--splits", "4", "--expert-counts", ",".join(["1092"] * 60), "--topk", "4",
            "--json"]
    paper = json.loads(run(h200).stdout)
    helped = json.loads(run(h200 + ["--tail-helpers"]).stdout)
    local = json.loads(run(h200 + ["--tail-helpers", "--local-topk", "2"]).stdout)
    # the helpers serve the last split after GEMM2 (never slower), and fewer local rows
    # per token make a communication tile cheaper
    assert helped["predicted_T"] < paper["predicted_T"]
    assert local["rho"] == pytest.approx(helped["rho"] * 3 / 5)  # (2 + 1) / (4 + 1)
    bad = run(h200 + ["--local-topk", "-1"])
    assert bad.returncode == 2 and "local_topk" in bad.stderr


def test_plan_says_which_placement_its_c_is_for_and_what_the_op_runs_by_default():
    argv = [sys.executable, "-m", "megatron_overlap", "plan", "--preset", "h200", "--tokens",
            "16384", "--hidden", "2048", "--ffn", "1408", "--world", "2", "--splits", "2",
            "--expert-counts", "4096,4096,4096,4096"]
    text = run(argv).stdout
    assert "the paper's partition placement" in text and "C = G = 132" in text
    found = json.loads(run(argv + ["--json"]).stdout)
    assert found["placement"] == "partition"
    assert found["op_default"] == {"placement": "shared", "comm_ctas": 132}
