"""tools/soak.py on CPU: a few interpreter calls, its memory samples, verdict and JSON."""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import soak  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke of the tool")
SMOKE = ["--smoke", "--calls", "4", "--report-every", "1", "--check-every", "2",
         "--tokens", "16,32", "--seeds", "1", "--wait-timeout-s", "20"]


def test_soak_smoke_reports_memory_at_start_every_report_and_end_and_checks_results(tmp_path):
    out = tmp_path / "soak.json"
    assert soak.main(SMOKE + ["--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [s["calls"] for s in r["samples"]] == [0, 1, 2, 3, 4]
    for s in r["samples"]:
        assert {"rss", "cuda_allocated", "cuda_reserved", "peer_memory", "decisions"} <= set(s)
        assert s["rss"] > 0
    assert r["hang"] is False and r["failures"] == 0
    assert r["checks"]["count"] == 2 and r["checks"]["passed"]
    assert r["growth"]["judged"] and r["verdict"].startswith("ok")
    assert r["call_s"]["max"] < r["call_timeout_s"]


def test_soak_counts_a_failing_call_and_flags_memory_growth(monkeypatch, tmp_path):
    real, seen = soak.gemm2_gather_rs, []

    def fails_once(*args, **kwargs):
        seen.append(1)
        if len(seen) == 2:
            raise ValueError("bad call")
        return real(*args, **kwargs)

    monkeypatch.setattr(soak, "gemm2_gather_rs", fails_once)
    out = tmp_path / "soak.json"
    assert soak.main(SMOKE[:2] + ["3", "--report-every", "1", "--check-every", "5",
                                  "--tokens", "16", "--seeds", "1", "--json", str(out)]) == 1
    r = json.loads(out.read_text())
    assert r["failures"] == 1 and "bad call" in r["first_failures"][0]["error"]
    assert r["verdict"] == "failures"
    # growth: the end against the warm sample, past the tolerances only
    base = dict(calls=0, rss=100 * soak.MIB, cuda_allocated=0, cuda_reserved=0, peer_memory=4096)
    flat = [base, dict(base, calls=1), dict(base, calls=2, rss=base["rss"] + soak.MIB)]
    assert not any(f["grew"] for f in soak.growth(flat)["fields"].values())
    grown = flat[:2] + [dict(base, calls=2, peer_memory=8192, cuda_allocated=2 * soak.MIB)]
    assert soak.verdict([], None, soak.growth(grown)) == \
        "memory growth: cuda_allocated, peer_memory"
    assert not soak.growth(flat[:2])["judged"]


def _soak_rank(rank, world, path):
    import soak as tool

    argv = SMOKE[:1] + ["--calls", "8", "--report-every", "4", "--check-every", "4",
                        "--tokens", "16,32", "--seeds", "1", "--wait-timeout-s", "4",
                        "--fault-every", "3"]
    return tool.main(argv + (["--json", path] if rank == 0 else []))


def test_soak_injects_faults_on_two_ranks_and_every_rank_detects_each_with_no_wrong_result(
        tmp_path):
    """Two gloo ranks: a mismatched size (call 3) and a skipped call (call 6): every
    rank raises for each (the fault call or its next), the calls that return around
    them match the reference, and the run's verdict is ok."""
    from dist_harness import run_ranks

    out = tmp_path / "soak.json"
    assert run_ranks(2, _soak_rank, str(out), timeout=300) == [0, 0]
    r = json.loads(out.read_text())
    f = r["faults"]
    assert f["injected"] == f["detected_every_rank"] == 2 and f["undetected"] == []
    assert f["wrong_results"] == 0 and f["checked"] >= 4
    assert r["failures"] == 0 and r["verdict"].startswith("ok")
