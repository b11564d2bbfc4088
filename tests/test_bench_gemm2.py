"""tools/bench_gemm2.py: its CPU smoke mode checks GEMM2 against torch before timing and
writes its JSON; a malformed variant is refused naming it."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))


def test_gemm2_bench_smoke_checks_y_against_torch_then_times_both(tmp_path):
    out = tmp_path / "gemm2.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           os.path.join(ROOT, "tools", "bench_gemm2.py"), "--smoke", "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (only,) = json.loads(out.read_text())["runs"]
    assert only["over_torch"]["torch"] == 1.0
    (name,) = [n for n in only["facts"]]
    assert only["facts"][name]["error_vs_torch"] < 1e-2  # checked before it was timed
    assert set(only["stats"]) == {"torch", name}


def test_a_malformed_variant_is_refused_naming_it():
    from bench_gemm2 import parse_variant
    from megatron_overlap.ops.config import GPU_TILES

    t = parse_variant("triton:128x256x64:8:3", GPU_TILES)
    assert (t.block_n, t.gemm_warps, t.gemm_impl) == (256, 8, "triton")
    for bad in ("gluon:128x128:4:3", "triton:128x128x64:4", "triton:128x96x64:4:3"):
        with pytest.raises(ValueError, match="--variants"):
            parse_variant(bad, GPU_TILES)
