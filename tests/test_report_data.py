"""docs/RESULTS.md is regenerated from the shipped docs/data: every report tool runs over it
without an error, every figure RESULTS shows is one a tool makes from it, and every data
file RESULTS names is there (and no data file is left that RESULTS does not name)."""

import glob
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "docs" / "data"
RESULTS = (REPO / "docs" / "RESULTS.md").read_text()

#: each figure of docs/figures: the command that makes it from docs/data (argv after
#: `python tools/`, OUT the output folder) and the file it writes there
FIGURES = {
    "operator_h200_1gpu_speedup_regret.png": ("report", "op_h200_1gpu_graph_speedup_regret.png"),
    "operator_h100_1gpu_speedup_regret.png": ("report", "op_h100_1gpu_graph_speedup_regret.png"),
    "operator_2xh200_speedup_regret.png": ("report", "op_2xh200_speedup_regret.png"),
    "prefill_h200_1gpu_graph_speedup.png": ("report", "prefill_h200graph_speedup.png"),
    "prefill_h100_1gpu_speedup.png": ("report", "prefill_h100_speedup.png"),
    "prefill_2xh200_speedup.png": ("report", "prefill_2xh200_speedup.png"),
    "fuse_or_not_h200_te_on_over_off.png": ("grid_h200", "grid_on_over_off.png"),
    "operator_h200_tp1ep1_roofline.png": ("roofline", "roofline.png"),
    "operator_h200_split_sweep.png": ("split_sweep", "split_sweep.png"),
}


def _commands(out: Path) -> dict[str, list[str]]:
    data = str(DATA)
    return {
        "report": ["report.py", "--data", data, "--out", str(out / "report")],
        "grid_h200": ["report_grid.py", "--data", data, "--device", "h200",
                      "--out", str(out / "grid_h200")],
        "grid_h100": ["report_grid.py", "--data", data, "--device", "h100",
                      "--out", str(out / "grid_h100")],
        "gridfused_h100": ["report_grid.py", "--data", data, "--prefix", "gridfused",
                           "--device", "h100", "--out", str(out / "gridfused_h100")],
        "roofline": ["roofline.py", str(DATA / "op_h200_tp1ep1_graph_TP1EP1.json"),
                     "--png", str(out / "roofline" / "roofline.png")],
        "split_sweep": ["split_sweep.py", *sorted(glob.glob(str(DATA / "op_h200_lsweep_*.json"))),
                        "--replan", "h200", "--png", str(out / "split_sweep" / "split_sweep.png")],
    }


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report")
    for name, argv in _commands(out).items():
        (out / name).mkdir(exist_ok=True)
        done = subprocess.run([sys.executable, str(REPO / "tools" / argv[0]), *argv[1:]],
                              capture_output=True, text=True, timeout=600, cwd=REPO)
        assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
    return out


def test_every_report_tool_regenerates_its_tables_from_the_shipped_data(generated):
    tables = (generated / "report" / "results_tables.md").read_text()
    for section in ("### op_h200_1gpu_graph", "### op_2xh200", "MoE layer, layer_h200graph",
                    "Complete-model prefill, h200_core_te", "Training step, train_h200_core_te",
                    "Megatron-LM's training loop", "Host syncs per MoE layer call"):
        assert section in tables, section
    for grid in ("grid_h200", "grid_h100", "gridfused_h100"):
        assert "| " in (generated / grid / "grid.md").read_text()


def test_every_figure_results_shows_is_made_from_the_shipped_data(generated):
    shown = set(re.findall(r"\(figures/([\w.]+\.png)\)", RESULTS))
    on_disk = {p.name for p in (REPO / "docs" / "figures").glob("*.png")}
    assert shown == on_disk, "docs/figures holds exactly the figures RESULTS shows"
    assert shown == set(FIGURES), "each figure has its generating command in FIGURES"
    for figure, (command, made) in FIGURES.items():
        assert (generated / command / made).is_file(), f"{figure}: {command} made no {made}"


def test_every_data_file_results_names_is_shipped_and_none_is_left_unnamed():
    named = set()
    for ref in re.findall(r"docs/data/([\w*{},.-]+)", RESULTS) + re.findall(
            r"`((?:op|layer|prefill|train|grid|gridfused|calibration|tiles|gemm2)_[\w*{},.-]+)`",
            RESULTS):
        ref = ref.rstrip(".,").replace("{model}", "*")
        if not ("." in ref or "*" in ref):  # (a stage's or a section's name, not a file)
            continue
        for alt in _braces(ref):
            hits = glob.glob(str(DATA / alt)) or glob.glob(str(DATA / (alt + "*")))
            assert hits, f"RESULTS names {ref}, not in docs/data"
            named.update(Path(h).name for h in hits)
    shipped = {p.name for p in DATA.iterdir()}
    assert shipped - named == set(), "data files no table of RESULTS names"


def _braces(ref: str) -> list[str]:
    """`a_{x,y}_b` -> [`a_x_b`, `a_y_b`] (shell brace expansion, one level per group)."""
    match = re.search(r"\{([^{}]*)\}", ref)
    if not match:
        return [ref]
    return [alt for part in match.group(1).split(",")
            for alt in _braces(ref[:match.start()] + part + ref[match.end():])]
