"""`tools/report.py` regenerates its tables and figures from the shipped docs/data without
an error (it crashed on op_energy's file, which shares the op_ prefix with bench_op's)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_report_regenerates_its_tables_from_the_shipped_data(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "tools" / "report.py"), "--data",
                           str(REPO / "docs" / "data"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    tables = (tmp_path / "results_tables.md").read_text()
    assert "### op_h200_1gpu_graph" in tables  # a bench_op table
    assert "### op_energy" not in tables  # (op_energy.py reports its own file)
    assert list(tmp_path.glob("*.png"))
