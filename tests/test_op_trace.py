"""GatherRS's trace (`kernels/gather_rs.py`, TRACE; `tools/op_trace.py`): the traced op
gives the untraced op's bits, every program with items in a split leaves one ordered
entry and every tail helper its arrival; the tool's summary finds readiness, GEMM2's end,
the tail and the backlog; malformed traces are refused."""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_overlap.ops import OverlapConfig, launcher
from megatron_overlap.ops import op as op_module
from routing_cases import routed_problem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from op_trace import median_summary, summarize_trace  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backends")
INTERP = OverlapConfig(backend="interpret")
TOKENS, TOPK, HIDDEN = 40, 3, 48


def _items(lp, split: int) -> int:
    """GatherRS's items in `split` (one rank): token blocks x column blocks."""
    width = -(-HIDDEN // lp.splits)
    if split == lp.splits - 1:
        width = HIDDEN - (lp.splits - 1) * width
    return -(-TOKENS // lp.family.comm_tm) * -(-width // lp.family.comm_tn)


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_the_traced_op_gives_the_same_bits_and_an_ordered_entry_per_program_and_split(splits):
    p = routed_problem(0, 1, tokens=TOKENS, experts=4, topk=TOPK, ffn=16, hidden=HIDDEN)
    launch = op_module.prepare(p["x"], p["weight"], p["counts"], p["token_index"], TOKENS,
                               TOPK, config=INTERP, splits=splits)
    lp, comm = launch.launch_plan, launch.launch_plan.plan.comm_ctas
    assert lp.helpers > 0  # (the helpers' entries are checked too)
    outs = []
    trace = torch.full((comm + lp.helpers, splits, 3), -1, dtype=torch.int64)
    for traced in (None, trace):
        out = torch.full((TOKENS, HIDDEN), float("nan"), dtype=p["x"].dtype)
        launcher.launch(launch.buffer, p["x"], p["weight"], launch.routing, lp, None, out,
                        trace=traced)
        launch.buffer.check()
        outs.append(out)
    assert not torch.isnan(outs[0]).any() and torch.equal(outs[0], outs[1])
    rows = trace.tolist()
    for split in range(splits):
        present = [pid for pid, row in enumerate(rows) if row[split][0] >= 0]
        assert all(rows[pid][split][0] <= rows[pid][split][1] <= rows[pid][split][2]
                   for pid in present)
        items = _items(lp, split)
        if split < splits - 1:  # the C programs in turn; helpers skip earlier splits
            assert present == list(range(min(items, comm)))
        else:  # the C + H programs in turn, and every helper's arrival
            assert present == sorted(set(range(min(items, comm + lp.helpers)))
                                     | set(range(comm, comm + lp.helpers)))


def test_a_malformed_trace_is_refused_naming_it():
    p = routed_problem(0, 1, tokens=TOKENS, experts=4, topk=TOPK, ffn=16, hidden=HIDDEN)
    launch = op_module.prepare(p["x"], p["weight"], p["counts"], p["token_index"], TOKENS,
                               TOPK, config=INTERP, splits=2)
    lp = launch.launch_plan
    programs = lp.plan.comm_ctas + lp.helpers
    out = torch.empty(TOKENS, HIDDEN, dtype=p["x"].dtype)
    for bad in (torch.full((programs, 2, 3), -1, dtype=torch.int32),  # dtype
                torch.full((programs - 1, 2, 3), -1, dtype=torch.int64),  # too few programs
                torch.full((programs, 3, 3), -1, dtype=torch.int64),  # another L
                torch.full((programs, 2, 3, 1), -1, dtype=torch.int64)):
        with pytest.raises(ValueError, match="trace must be"):
            launcher.launch(launch.buffer, p["x"], p["weight"], launch.routing, lp, None, out,
                            trace=bad)
    launch.buffer.check()  # refused before anything launched: the buffer is still usable
    launcher.launch(launch.buffer, p["x"], p["weight"], launch.routing, lp, None, out)
    launch.buffer.check()


def _synthetic() -> list:
    """Two GatherRS programs and one tail helper, L = 2 (ns): program 1 is still on split
    0 at 58 us, after the helper arrived at 55 us (GEMM2's end)."""
    return [[[0, 5000, 20000], [20000, 50000, 60000]],
            [[100, 5100, 58000], [58000, 58000, 70000]],
            [[-1, -1, -1], [55000, 55000, 65000]]]


def test_the_summary_finds_readiness_gemm2s_end_the_tail_and_the_backlog():
    s = summarize_trace(_synthetic(), comm_programs=2)
    first, last = s["splits"]
    assert (first["ready"], first["done"], first["programs"]) == (5.0, 58.0, 2)
    assert first["waited"] == pytest.approx(10.0) and first["worked"] == pytest.approx(67.9)
    assert (last["ready"], last["done"], last["programs"]) == (50.0, 70.0, 3)  # (a spun wait)
    assert (s["gemm_end"], s["end"], s["tail"]) == (55.0, 70.0, 15.0)
    assert s["backlog"] == pytest.approx(3.0)  # program 1's split 0 from 55 to 58 us
    # without helpers GEMM2's end is the last split's readiness
    assert summarize_trace(_synthetic()[:2], comm_programs=2)["gemm_end"] == 50.0
    both = median_summary([s, summarize_trace(_synthetic(), comm_programs=2)])
    assert both["tail"] == 15.0 and both["splits"][0]["ready"] == 5.0


def test_a_trace_without_entries_or_out_of_order_is_refused():
    with pytest.raises(ValueError, match="no entry"):
        summarize_trace([[[-1, -1, -1]]], comm_programs=1)
    with pytest.raises(ValueError, match="out of order"):
        summarize_trace([[[0, 9, 5]]], comm_programs=1)


def test_the_tool_traces_the_op_on_the_interpreter_and_writes_a_chart(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           os.path.join(ROOT, "tools", "op_trace.py"), "--smoke", "--runs", "2", "--warmup", "1",
           "--json", str(tmp_path / "trace.json"), "--png-dir", str(tmp_path / "png")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (row,) = json.loads((tmp_path / "trace.json").read_text())["results"]
    assert row["runs"] == 2 and len(row["last_trace"]) == row["comm_ctas"] + row["helpers"]
    assert row["median"]["gemm_end"] is not None and row["median"]["tail"] >= 0
    assert len(list((tmp_path / "png").glob("*.png"))) == 1


def test_y_loaded_evict_first_gives_the_same_bits_and_the_tiles_file_can_ask_for_it(tmp_path):
    """`TileConfig.comm_evict_first` changes only where y's lines go in L2, never a sum:
    the interpreter runs the same loads (with the hint) to the same bits; a tiles file
    turns it on, and a value that is not a switch is refused naming it."""
    import dataclasses

    from megatron_overlap.ops.config import INTERPRET_TILES, load_tiles

    p = routed_problem(0, 1, tokens=TOKENS, experts=4, topk=TOPK, ffn=16, hidden=HIDDEN)
    outs = []
    for evict in (False, True):
        cfg = OverlapConfig(backend="interpret", tiles=dataclasses.replace(
            INTERPRET_TILES, comm_evict_first=evict))
        outs.append(op_module.gemm2_gather_rs(p["x"], p["weight"], p["counts"],
                                              p["token_index"], TOKENS, TOPK, config=cfg,
                                              splits=2))
    assert torch.equal(outs[0], outs[1])
    best = {"gemm": [128, 128, 64, 4, 3, False], "comm": [32, 512, 4, True, 1, True],
            "placement": "shared"}
    for value, expected in ((None, False), (True, True), ("yes", None)):
        path = tmp_path / f"tiles_{value}.json"
        extra = {} if value is None else {"comm_evict_first": value}
        path.write_text(json.dumps({"best": {**best, **extra}}))
        if expected is None:
            with pytest.raises(ValueError, match="a switch must be"):
                load_tiles(str(path))
        else:
            assert load_tiles(str(path)).comm_evict_first is expected
    with pytest.raises(ValueError, match="comm_evict_first must be a bool"):
        dataclasses.replace(INTERPRET_TILES, comm_evict_first=1)


@pytest.mark.parametrize("flags", [["--runs", "0"], ["--warmup", "-1"], ["--splits", "0"]])
def test_the_tool_refuses_counts_that_cannot_run_naming_the_flags(flags):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "op_trace.py"), *flags],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2 and "--runs must be >= 1" in run.stderr, run.stderr[-2000:]
