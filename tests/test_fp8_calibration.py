"""The FP8 kernel families' calibration: a preset carries one per scaling kind, the op's
planner and fuse-or-not plan an FP8 GEMM2 with its own family (the bf16 family's where
none is calibrated, said once), and tools/calibrate.py --fp8 derives it from GEMM2's
two waves measured side by side."""

import dataclasses
import json
import logging
import os
import sys

import pytest
import torch

from megatron_overlap.ops import OverlapConfig, fusion_decision, quantize_fp8_operands
from megatron_overlap.ops.config import calibration_for
from megatron_overlap.planner import DeviceSpec, Preset, get_preset
from megatron_overlap.planner import Fp8Family

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import calibrate  # noqa: E402


def _with_block_family(wave_scale: float = 0.5, rho_scale: float = 2.0) -> Preset:
    """H200's shipped preset with a "block" family whose compute wave is `wave_scale` of
    bf16's (rho `rho_scale` times)."""
    h200 = get_preset("h200")
    calib = dataclasses.replace(h200.calibration,
                                rho_ref=h200.calibration.rho_ref * rho_scale)
    family = Fp8Family(calib, h200.step_costs.wave_us * wave_scale)
    return dataclasses.replace(h200, name="h200-fp8-test", fp8={"block": family})


def _preset_file(tmp_path, preset: Preset) -> str:
    path = tmp_path / f"{preset.name}.json"
    path.write_text(json.dumps({"preset": preset.to_json()}))
    return str(path)


def test_a_preset_carries_fp8_families_through_json_and_plans_each_kind_with_its_own():
    preset = _with_block_family()
    assert Preset.from_json(json.loads(json.dumps(preset.to_json()))) == preset
    calib, costs = preset.for_operands("block")
    assert calib is preset.fp8["block"].calibration
    assert costs.wave_us == preset.fp8["block"].wave_us
    assert dataclasses.replace(costs, wave_us=preset.step_costs.wave_us) == preset.step_costs
    # an uncalibrated kind and bf16 take the bf16 family's terms
    for operands in ("tensor", None):
        assert preset.for_operands(operands) == (preset.calibration, preset.step_costs)
    # a family without a wave of its own keeps the bf16 step costs
    no_wave = dataclasses.replace(preset, fp8={"block": Fp8Family(calib)})
    assert no_wave.for_operands("block") == (calib, preset.step_costs)
    # the shipped files load as before (no "fp8": every kind planned as bf16)
    assert "fp8" not in get_preset("h200").to_json() or get_preset("h200").fp8


def test_a_preset_rejects_unknown_fp8_kinds_and_malformed_families():
    preset = _with_block_family()
    family = preset.fp8["block"]
    with pytest.raises(ValueError, match="Preset.fp8 maps a scaling kind"):
        dataclasses.replace(preset, fp8={"mxfp8": family})
    with pytest.raises(ValueError, match="Preset.fp8 maps a scaling kind"):
        dataclasses.replace(preset, fp8={"block": preset.calibration})
    with pytest.raises(ValueError, match="Fp8Family.wave_us"):
        Fp8Family(preset.calibration, 0.0)
    with pytest.raises(ValueError, match="Fp8Family.calibration"):
        Fp8Family({"rho_ref": 1.0})
    data = preset.to_json()
    data["fp8"] = {"block": {"wave_us": 1.0}}  # no calibration
    with pytest.raises(ValueError, match="malformed calibration preset"):
        Preset.from_json(data)


def test_the_op_plans_fp8_with_its_family_and_warns_once_where_there_is_none(
        tmp_path, caplog):
    path = _preset_file(tmp_path, _with_block_family())
    device = DeviceSpec("NVIDIA H200", 132)
    assert calibration_for(device, path, "block").rho_ref == pytest.approx(
        2 * get_preset("h200").calibration.rho_ref)
    assert calibration_for(device, path, None) == get_preset("h200").calibration
    with caplog.at_level(logging.WARNING, logger="megatron_overlap"):
        for _ in range(3):
            assert calibration_for(device, path, "tensor") == get_preset("h200").calibration
    said = [r for r in caplog.records if "no FP8 tensor-scaled family" in r.getMessage()]
    assert len(said) == 1 and "calibrate.py --fp8 tensor" in said[0].getMessage()


def _decision(path: str, fp8):
    return fusion_decision(num_tokens=4096, hidden=256, ffn=128, topk=2, local_experts=8,
                           experts=8, dtype=torch.bfloat16, device=torch.device("cpu"),
                           config=OverlapConfig(backend="interpret", preset=path), fp8=fp8)


def test_fuse_or_not_prices_an_fp8_gemm2_with_its_familys_wave(tmp_path):
    """Both sides run GEMM2, so a faster FP8 wave lowers both predictions; without a
    family the FP8 call is priced as bf16 (the same times)."""
    with_family = _preset_file(tmp_path, _with_block_family(wave_scale=0.5))
    without = _preset_file(tmp_path, dataclasses.replace(get_preset("h200"), name="bare"))
    bf16 = _decision(without, None)
    as_bf16 = _decision(without, "block")
    fp8 = _decision(with_family, "block")
    assert (as_bf16.fused_us, as_bf16.unfused_us) == pytest.approx(
        (bf16.fused_us, bf16.unfused_us))
    assert fp8.unfused_us < bf16.unfused_us and fp8.fused_us < bf16.fused_us


def test_quantized_operands_dequantize_to_the_bf16_product_within_e4m3s_step():
    torch.manual_seed(0)
    counts = [5, 0, 11]
    x = torch.randn(sum(counts), 256)
    w = torch.randn(3, 64, 256) / 16
    ref = torch.cat([xe @ we.t() for xe, we in zip(x.split(counts), w)])
    from megatron_overlap.ops.fp8 import reference_y

    for kind in ("tensor", "block"):
        xq, wq, scales = quantize_fp8_operands(x, w, counts, kind)
        assert xq.dtype == wq.dtype == torch.float8_e4m3fn and scales.kind == kind
        got = reference_y(xq, wq, counts, scales).float()
        assert (got - ref).abs().max() / ref.abs().max() < 0.1  # e4m3: 3 mantissa bits
    with pytest.raises(ValueError, match="kind"):
        quantize_fp8_operands(x, w, counts, "mxfp8")
    with pytest.raises(ValueError, match="counts summing to T"):
        quantize_fp8_operands(x, w, [1, 2, 3], "tensor")


def test_calibrate_fp8_family_is_the_same_comm_wave_over_the_fp8_compute_wave():
    base = get_preset("h200")
    b = base.calibration
    tile = (b.tm_ref, b.tn_ref)
    same = calibrate.fp8_family(base, b.k_ref, tile, tile, 2.0, 2.0, b.k_epi)
    assert same.calibration.rho_ref == pytest.approx(b.rho_ref, rel=1e-3)
    assert same.wave_us == pytest.approx(base.step_costs.wave_us, rel=1e-3)
    fast = calibrate.fp8_family(base, b.k_ref, tile, tile, 2.0, 1.0, 10.0)
    assert fast.calibration.rho_ref == pytest.approx(2 * b.rho_ref, rel=1e-3)
    assert fast.wave_us == pytest.approx(base.step_costs.wave_us / 2, rel=1e-3)
    assert fast.calibration.k_epi == 10.0 and fast.calibration.c_max == b.c_max
    # measured at half K_ref, the base's rho is first carried to that K (its K_epi)
    half = calibrate.fp8_family(base, b.k_ref // 2, tile, tile, 1.0, 1.0, b.k_epi)
    epi = b.k_epi or 0.0
    assert half.calibration.rho_ref == pytest.approx(
        b.rho_ref * (b.k_ref + epi) / (b.k_ref // 2 + epi), rel=1e-3)
    assert half.calibration.k_ref == b.k_ref // 2
