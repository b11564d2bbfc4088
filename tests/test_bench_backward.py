"""tools/bench_backward.py's CPU smoke mode: it runs, checks before timing, writes its JSON."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("ranks", [1, 2])
def test_backward_bench_smoke_times_every_policy_after_checking_it_against_stock(tmp_path, ranks):
    out = tmp_path / "bwd.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", os.path.join(ROOT, "tools", "bench_backward.py"),
           "--smoke", "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "| case |" in run.stdout
    rows = json.loads(out.read_text())["results"]
    assert [r["model"] for r in rows] == ["tiny", "tiny-unaligned"]
    for r in rows:
        assert r["tp"] * r["ep"] == ranks
        assert all(e < 1e-2 for e in r["rel_err"].values()), r["rel_err"]
        assert {"stock", "ours", "ours(loop wgrad)"} <= set(r["stats"])
        assert r["speedup_over_stock"]["stock"] == 1.0
        assert all(len(v) == 3 for v in r["samples"].values())  # the smoke's 3 samples
    # the unaligned shape takes the padded path; torch's own layout rules decide stock's
    assert "stock(autograd)" in rows[0]["stats"] and rows[1]["hidden"] * 2 % 16
