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
