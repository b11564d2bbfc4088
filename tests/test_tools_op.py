"""The one-GPU operator's tools: the roofline table, the split sweep's regret and the
correctness sweep's fp64 reference (their CPU parts)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))

import check_op  # noqa: E402
import roofline  # noqa: E402
import split_sweep  # noqa: E402
from megatron_overlap.ops import OverlapConfig, gemm2_gather_rs  # noqa: E402

RECORDED = os.path.join(os.path.dirname(__file__), "..", "docs", "data",
                        "op_h200_tp1ep1_graph_TP1EP1.json")


def test_roofline_counts_granites_flops_and_bytes_and_bounds_by_the_larger():
    """Granite TP1EP1 S=4096: T = 16384 x 8 rows, K = 512, N = 1024, 32 experts."""
    row = dict(model="granite", layout="TP1EP1", seq=4096,
               gemm_flops=2 * 131072 * 1024 * 512)
    b = roofline.bounds(row, tflops=790.0, tbs=4.3)
    fused = 2 * (131072 * 512 + 32 * 1024 * 512 + 16384 * 1024)  # x, W, out (bf16)
    assert b["bytes_fused"] == fused
    assert b["bytes_today"] == fused + 2 * 2 * 131072 * 1024  # + y written, read back
    assert b["bound_fused_ms"] == pytest.approx(b["flops"] / 790e9)  # FLOP-bound
    slow_memory = roofline.bounds(row, tflops=790.0, tbs=1.0)
    assert slow_memory["bound_today_ms"] == pytest.approx(b["bytes_today"] / 1e9)


def test_roofline_table_has_a_row_per_recorded_workload_with_the_ops_ratio():
    import json
    rows = json.load(open(RECORDED))["results"]
    lines = roofline.table(rows, 790.0, 4.3)
    assert len(lines) == 2 + len(rows)
    first = rows[0]["stats"]
    ratio = first[roofline.OP]["median"] / first[roofline.GEMM2]["median"]
    assert f"| {ratio:.2f} |" in lines[2]


def test_check_op_reference_is_the_ops_sum_over_each_tokens_rows():
    g = torch.Generator().manual_seed(0)
    token_index = torch.tensor([0, 2, 3, 1, 2, 0, 1, 3])  # experts of 3, 2, 3 rows
    counts = [3, 2, 3]
    x = torch.randn(8, 16, generator=g)
    w = torch.randn(3, 8, 16, generator=g)
    inp = dict(x=x, weight=w, counts_list=counts, token_index=token_index, tokens=4)
    want = gemm2_gather_rs(x, w, counts, token_index, 4, 3,
                           config=OverlapConfig(backend="reference"))
    got = check_op.fp64_reference(inp)
    assert got.dtype == torch.float64
    assert torch.allclose(got.float(), want, rtol=1e-5, atol=1e-5)
    assert check_op.rel_err(want, got) < 1e-6


def _swept(case, model, chosen, ms, predicted, planner_ms, spread=0.03):
    stats = {f"graph L={l}": {"median": v, "ci_low": v - spread, "ci_high": v + spread}
             for l, v in ms.items()}
    stats[split_sweep.OP] = {"median": planner_ms}
    stats[split_sweep.GEMM2] = {"median": 1.0}
    return dict(case=case, model=model, splits=chosen, stats=stats,
                predicted_by_splits={str(l): t for l, t in predicted.items()})


def test_split_sweep_regret_is_the_planners_l_against_the_fastest_swept_l():
    right = split_sweep.sweep_row(_swept("a", "granite", 2, {1: 1.1, 2: 1.0, 4: 1.2},
                                         {1: 30.0, 2: 29.0, 4: 28.0}, 0.99))
    wrong = split_sweep.sweep_row(_swept("b", "qwen", 4, {1: 1.3, 2: 1.0, 4: 1.1},
                                         {1: 30.0, 2: 29.0, 4: 28.0}, 1.12))
    assert (right["best"], right["chosen"]) == (2, 2)
    assert right["regret"] == pytest.approx(-0.01)  # two captures of one L: noise
    assert right["sweep_regret"] == 0.0
    assert wrong["best"] == 2 and wrong["regret"] == pytest.approx(0.12)
    assert wrong["sweep_regret"] == pytest.approx(0.1)
    assert right["candidates"] == (1, 2) and wrong["candidates"] == (1, 2, 4)  # N 1024, 2048
    s = split_sweep.summary([right, wrong])
    assert s["chosen_is_best"] == 1 and s["max_regret"] == pytest.approx(0.12)
    assert s["mean_sweep_regret"] == pytest.approx(0.05)
    # b's L = 4 (1.1 +- 0.03) against L = 2 (1.0 +- 0.03): apart; a's is its best
    assert (right["beyond_ci"], wrong["beyond_ci"], s["slower_beyond_ci"]) == (False, True, 1)
    close = split_sweep.sweep_row(_swept("d", "qwen", 4, {2: 1.0, 4: 1.1}, {}, 1.1, 0.06))
    assert close["sweep_regret"] == pytest.approx(0.1) and close["beyond_ci"] is False
    lines = split_sweep.table([right, wrong])
    assert len(lines) == 4 and "+12.0% (10.0%)" in lines[3]
    assert "1.034 / 1.000 / 0.966" in lines[2]  # the model's T(L) over its T at L* = 2


def test_split_sweep_scores_a_replanned_l_within_the_sweeps_own_captures():
    """`--replan`: the new L's regret is its sweep capture against the sweep's best (the
    planner's capture was of the old L), its CI test redone for it."""
    row = split_sweep.sweep_row(_swept("b", "qwen", 4, {1: 1.3, 2: 1.0, 4: 1.1},
                                       {1: 30.0, 2: 29.0, 4: 28.0}, 1.12))
    to_best = split_sweep.replanned_row(row, 2)
    assert (to_best["chosen"], to_best["regret"], to_best["beyond_ci"]) == (2, 0.0, False)
    to_one = split_sweep.replanned_row(row, 1)
    assert to_one["regret"] == pytest.approx(0.3) and to_one["beyond_ci"] is True
    assert split_sweep.summary([to_best, to_one])["chosen_is_best"] == 1


def test_split_sweep_refuses_a_run_without_a_captured_l_sweep():
    row = _swept("c", "granite", 2, {}, {}, 1.0)
    with pytest.raises(ValueError, match="--graph-sweep"):
        split_sweep.sweep_row(row)
