"""tools/unpermute_rate.py: both of Megatron's unpermutes timed on one routing, checked
equal first, and the rates written into a calibration's step costs (CPU: TE's fused
kernels stood in by Megatron's unfused code, tests/te_moe_doubles.py)."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from dist_harness import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import unpermute_rate  # noqa: E402

from megatron_overlap.planner import load_preset_file  # noqa: E402
from megatron_overlap.planner.presets import CALIBRATION_DIR  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU stand-ins")


def _measure(rank, world, tmp):
    """In a process of its own: the stand-ins patch Megatron's moe_utils and torch.cuda."""
    import te_moe_doubles

    te_moe_doubles.install()
    out, cal = Path(tmp) / "rates.json", Path(tmp) / "h100.json"
    shutil.copy(CALIBRATION_DIR / "h100.json", cal)
    rc = unpermute_rate.main(["--models", "tiny", "--batch", "2", "--seqs", "32",
                              "--samples", "3", "--device", "cpu", "--json", str(out),
                              "--write-calibration", str(cal)])
    return rc, te_moe_doubles.CALLS["unpermute"], json.loads(out.read_text())


def test_both_unpermutes_are_timed_and_their_rates_land_in_the_calibration(tmp_path):
    rc, fused_calls, found = run_ranks(1, _measure, str(tmp_path))[0]
    assert rc == 0 and fused_calls > 0  # the fused arm ran TE's entry point (stood in)
    (case,) = found["cases"]
    assert case["bytes"] == (64 * 2 + 64) * 64 * 2  # (T + M) N b, bf16
    assert set(case["us"]) == {"megatron", "te_fused"} and min(case["us"].values()) > 0
    costs = load_preset_file(tmp_path / "h100.json").step_costs
    three = unpermute_rate.three_digits
    assert costs.fused_combine_bytes_per_us == three(found["rates"]["te_fused"]) > 0
    assert costs.combine_bytes_per_us == three(found["rates"]["megatron"]) > 0
    assert costs.wave_us == load_preset_file(CALIBRATION_DIR / "h100.json").step_costs.wave_us
