"""`make demo`'s planner tables: the H200 one shows what the op decides on the device."""

import json
from pathlib import Path

from megatron_overlap.demo import decision_rows, run_demo
from megatron_overlap.planner import get_preset

DATA = Path(__file__).resolve().parent / "data"  # golden files: tests/data/README.md


def test_h200_table_is_every_decision_the_op_recorded_on_the_device():
    # the op on 2 H200s with the shipped calibration (tests/data/h200x2-shipped_*), rank
    # 0's decision per workload (benchmark routing seed 0, as the demo's)
    recorded = {}
    for layout in ("TP2EP1", "TP1EP2"):
        for r in json.loads((DATA / f"h200x2-shipped_{layout}.json").read_text())["results"]:
            recorded[(r["model"], layout, r["seq"], r["routing"])] = (r["comm_ctas"], r["splits"])
    shown = {(row["model"], row["layout"], row["S"], row["routing"]):
             (row["plan"].comm_ctas, row["plan"].splits)
             for row in decision_rows(get_preset("h200"), ("TP2EP1", "TP1EP2"), as_op=True)}
    assert len(recorded) == 36
    assert {k: shown[k] for k in recorded} == recorded


def test_planner_only_demo_prints_both_tables(capsys):
    assert run_demo(planner_only=True) == 0
    out = capsys.readouterr().out
    assert "(the paper's model), preset a100-paper" in out
    assert "(the op's decisions, partition placement; the shared placement, the default on Hopper, takes C = G), preset h200" in out


def test_demo_table_plans_with_the_calibration_of_the_machines_gpu():
    from megatron_overlap.demo import demo_preset

    assert demo_preset("NVIDIA H100 80GB HBM3").name == "h100"
    assert demo_preset("NVIDIA H200").name == "h200"
    # no GPU, or one nothing was calibrated on: the H200 table, as the docs measure it
    assert demo_preset(None).name == "h200"
    assert demo_preset("NVIDIA A10").name == "h200"


def test_h100_table_ranks_l_as_the_op_did_on_the_h100():
    # the op on one H100 with the shipped h100 file (shared
    # placement, so C = G there; the table's C is the partition's), rank 0's workload of
    # each layout alone; within 0.2% of the fastest captured C or L in 11 of 12 workloads
    recorded = {}
    for layout in ("TP2EP1", "TP1EP2"):
        for r in json.loads((DATA / f"h100-graph_{layout}.json").read_text())["results"]:
            recorded[(r["model"], layout, r["seq"], r["routing"])] = r["splits"]
    shown = {(row["model"], row["layout"], row["S"], row["routing"]): row["plan"].splits
             for row in decision_rows(get_preset("h100"), ("TP2EP1", "TP1EP2"), as_op=True)}
    assert len(recorded) == 12 and set(recorded.values()) == {2, 4}
    assert {k: shown[k] for k in recorded} == recorded
