"""The planner package's layout: the names it exports and the size of its pieces.

model.py was split into inputs, calibration, quantities, curve and search; every name it
defined stays importable from `megatron_overlap.planner` and from `planner.model` (tools
import some there), as the same objects.
"""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_overlap.planner as planner
from megatron_overlap.planner import model

#: the public names planner/model.py defined before the split
MODEL_NAMES = {
    "Calibration", "DEFAULT_COMM_CTAS", "DeviceSpec", "KernelSpec", "MAX_C", "Plan", "Workload",
    "comm_tiles", "compute_slots", "compute_tiles", "expert_row_tiles", "makespan", "plan",
    "ranking_calibration", "reservation", "service_ratio", "service_time", "solve", "tail_ctas",
    "timed_plan",
}
PLANNER_DIR = Path(planner.__file__).parent


def test_the_former_model_names_are_the_same_objects_in_both_places():
    assert set(model.__all__) == MODEL_NAMES
    for name in MODEL_NAMES:
        assert getattr(planner, name) is getattr(model, name), name


def test_every_name_in_planner_all_is_defined():
    assert MODEL_NAMES <= set(planner.__all__)
    assert all(hasattr(planner, name) for name in planner.__all__)


def test_planner_modules_and_functions_stay_small():
    """The project's style rule: a module under ~400 lines, a function under ~60."""
    for path in sorted(PLANNER_DIR.glob("*.py")):
        source = path.read_text()
        assert source.count("\n") <= 400, path.name
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno < 60, f"{path.name}: {node.name}"
