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


@pytest.mark.parametrize("field", ["comm_evict_first", "gemm_tail_evict_last"])
def test_y_loaded_evict_first_or_stored_evict_last_gives_the_same_bits(tmp_path, field):
    """`TileConfig.comm_evict_first` (GatherRS's loads of y) and `gemm_tail_evict_last`
    (GEMM2's stores of the last split's y) change only where y's lines go in L2, never a
    sum: the interpreter runs the same loads and stores (with the hint) to the same bits;
    a tiles file turns each on, and a value that is not a switch is refused naming it."""
    import dataclasses

    from megatron_overlap.ops.config import INTERPRET_TILES

    p = routed_problem(0, 1, tokens=TOKENS, experts=4, topk=TOPK, ffn=16, hidden=HIDDEN)
    outs = []
    for evict in (False, True):
        cfg = OverlapConfig(backend="interpret", tiles=dataclasses.replace(
            INTERPRET_TILES, **{field: evict}))
        outs.append(op_module.gemm2_gather_rs(p["x"], p["weight"], p["counts"],
                                              p["token_index"], TOKENS, TOPK, config=cfg,
                                              splits=2))
    assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1])
    check_tiles_file_switch(tmp_path, field)


def check_tiles_file_switch(tmp_path, field: str) -> None:
    """A tune_tiles file sets the TileConfig switch `field` (absent: off; true/false or
    1/0), a value that is not a switch is refused, and so is a non-bool in the config."""
    import dataclasses

    from megatron_overlap.ops.config import INTERPRET_TILES, load_tiles

    best = {"gemm": [128, 128, 64, 4, 3, False], "comm": [32, 512, 4, True, 1, True],
            "placement": "shared"}
    for value, expected in ((None, False), (True, True), (0, False), ("yes", None)):
        path = tmp_path / f"tiles_{field}_{value}.json"
        extra = {} if value is None else {field: value}
        path.write_text(json.dumps({"best": {**best, **extra}}))
        if expected is None:
            with pytest.raises(ValueError, match="a switch must be"):
                load_tiles(str(path))
        else:
            assert getattr(load_tiles(str(path)), field) is expected
    with pytest.raises(ValueError, match=f"{field} must be a bool"):
        dataclasses.replace(INTERPRET_TILES, **{field: 1})


@pytest.mark.parametrize("flags", [["--runs", "0"], ["--warmup", "-1"], ["--splits", "0"]])
def test_the_tool_refuses_counts_that_cannot_run_naming_the_flags(flags):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "op_trace.py"), *flags],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2 and "--runs must be >= 1" in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_claimed_items_give_the_ops_bits_and_leave_the_counters_zero(splits):
    """`TileConfig.comm_dynamic_items` through the op's launch (C programs, then the tail
    helpers after GEMM2): the default tiles' output bit for bit, the claims back at zero
    for the next call, the trace ordered and each helper's arrival kept. (The interpreter
    runs programs one after another, so the first program with items claims them all.)"""
    import dataclasses

    from megatron_overlap.ops.config import INTERPRET_TILES

    p = routed_problem(0, 1, tokens=TOKENS, experts=4, topk=TOPK, ffn=16, hidden=HIDDEN)
    outs = []
    for claimed in (False, True):
        cfg = OverlapConfig(backend="interpret", tiles=dataclasses.replace(
            INTERPRET_TILES, comm_dynamic_items=claimed))
        launch = op_module.prepare(p["x"], p["weight"], p["counts"], p["token_index"], TOKENS,
                                   TOPK, config=cfg, splits=splits)
        lp, comm = launch.launch_plan, launch.launch_plan.plan.comm_ctas
        trace = torch.full((comm + lp.helpers, splits, 3), -1, dtype=torch.int64)
        for _ in range(2):  # a second call finds the counters reset
            out = torch.full((TOKENS, HIDDEN), float("nan"), dtype=p["x"].dtype)
            launcher.launch(launch.buffer, p["x"], p["weight"], launch.routing, lp, None, out,
                            trace=trace)
            launch.buffer.check()
            assert int(launch.buffer.claims.abs().sum()) == 0
        outs.append(out)
    assert not torch.isnan(outs[0]).any() and torch.equal(outs[0], outs[1])
    rows = trace.tolist()
    assert all(e[0] <= e[1] <= e[2] for row in rows for e in row if e[0] >= 0)
    for split in range(splits - 1):
        assert [pid for pid, row in enumerate(rows) if row[split][0] >= 0] == [0]
    assert all(rows[pid][splits - 1][0] >= 0 for pid in range(comm, comm + lp.helpers))


def test_a_timed_out_call_leaves_no_claim_behind():
    """After a time-out the host zeroes the flags it cannot trust, the claims too: the
    next call (after the buffer's check raised) combines every item."""
    import dataclasses

    from megatron_overlap.ops import OverlapTimeoutError
    from megatron_overlap.ops.config import INTERPRET_TILES

    p = routed_problem(0, 1, tokens=TOKENS, experts=4, topk=TOPK, ffn=16, hidden=HIDDEN)
    cfg = OverlapConfig(backend="interpret", tiles=dataclasses.replace(
        INTERPRET_TILES, comm_dynamic_items=True))
    launch = op_module.prepare(p["x"], p["weight"], p["counts"], p["token_index"], TOKENS,
                               TOPK, config=cfg, splits=2)
    buf = launch.buffer
    buf.claims[:2] = 10 ** 6  # a broken call's claims left behind
    buf.error.fill_(1 << 24)  # ... and its time-out recorded
    with pytest.raises(OverlapTimeoutError):
        buf.note_launch(None, sync=True)  # (checks the error word at once)
        buf.check()
    assert int(buf.claims.abs().sum()) == 0
    buf.reset()
    out = torch.full((TOKENS, HIDDEN), float("nan"), dtype=p["x"].dtype)
    launcher.launch(buf, p["x"], p["weight"], launch.routing, launch.launch_plan, None, out)
    buf.check()
    assert not torch.isnan(out).any()


def test_gemm2s_end_is_the_helpers_first_arrival_at_any_split():
    """With claimed items a helper may take a backlog item of split 0 first: GEMM2's end
    is its arrival there (55 us), and that item's time after it is backlog."""
    trace = _synthetic()
    trace[2] = [[55000, 55000, 56000], [56000, 56000, 65000]]  # the helper took split 0 first
    s = summarize_trace(trace, comm_programs=2)
    assert s["gemm_end"] == 55.0 and s["tail"] == 15.0
    assert s["backlog"] == pytest.approx(3.0 + 1.0)  # program 1's 3 us and the helper's 1


def test_tile_arms_name_tileconfig_changes_and_refuse_unknown_names():
    from workloads import tile_arms

    from megatron_overlap.ops.config import GPU_TILES

    arms = tile_arms("dynamic_items,evict_first+dynamic_items", GPU_TILES)
    assert list(arms) == ["dynamic_items", "evict_first+dynamic_items"]
    assert arms["dynamic_items"].comm_dynamic_items and not arms["dynamic_items"].comm_evict_first
    assert arms["evict_first+dynamic_items"].comm_evict_first
    assert tile_arms("", GPU_TILES) == {}
    with pytest.raises(ValueError, match="unknown arm 'fast'"):
        tile_arms("dynamic_items,fast", GPU_TILES)


def test_bench_op_refuses_an_arm_whose_output_differs_from_the_default(monkeypatch):
    """bench_op checks each tile arm's eager output against the default tiles' before it
    times anything: equal bits pass, a changed element is refused naming the arm."""
    import bench_op
    from workloads import OpCase, rank_inputs, tile_arms

    from megatron_overlap.ops.config import INTERPRET_TILES

    inp = rank_inputs(OpCase("tiny", "TP1EP1", 16, "uniform"), 0, "cpu")
    arms = tile_arms("dynamic_items", INTERPRET_TILES)
    err = bench_op.check_against_reference(inp, None, [3], "interpret", None, (), arms)
    assert err < 2e-2
    real = bench_op.gemm2_gather_rs

    def off_by_one_element(*args, config, **kw):
        out = real(*args, config=config, **kw)
        if config.tiles is not None and config.tiles.comm_dynamic_items:
            out[0, 0] += 1
        return out
    monkeypatch.setattr(bench_op, "gemm2_gather_rs", off_by_one_element)
    with pytest.raises(RuntimeError, match="tile arm dynamic_items"):
        bench_op.check_against_reference(inp, None, [3], "interpret", None, (), arms)


def test_a_tiles_file_can_ask_for_each_switch_and_a_non_switch_is_refused(tmp_path):
    check_tiles_file_switch(tmp_path, "comm_dynamic_items")
    check_tiles_file_switch(tmp_path, "gemm_places_from_marks")


def test_the_tool_traces_each_variant_and_refuses_bad_lists(tmp_path):
    """--tile-arms x --helper-scale x --last-split-tiles: a row per workload and variant
    (a last split the plan's L cannot narrow is skipped, said in a line), the op's time per
    run beside the trace; bad lists are refused before any process starts."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           os.path.join(ROOT, "tools", "op_trace.py"), "--smoke", "--runs", "1", "--warmup", "0",
           "--splits", "2", "--tile-arms", "dynamic_items", "--helper-scale", "1,2",
           "--last-split-tiles", "0,1,9", "--json", str(tmp_path / "trace.json")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads((tmp_path / "trace.json").read_text())["results"]
    assert [(r["arm"], r["helper_scale"], r["last_split_tiles"]) for r in rows] == [
        (arm, scale, last) for arm in ("default", "dynamic_items") for scale in (1, 2)
        for last in (0, 1)]  # (9 tiles: more than the tiny model's N holds)
    assert run.stdout.count("skipped") == 4
    assert rows[1]["helpers"] == rows[0]["helpers"] > 0
    assert rows[2]["helpers"] == 2 * rows[0]["helpers"]
    assert rows[0]["split_width"] is None and rows[1]["split_width"] > 0
    assert all(len(r["last_trace"]) == r["comm_ctas"] + r["helpers"] for r in rows)
    assert all(r["median"]["op_us"] > 0 for r in rows)
    for flags, why in ((["--helper-scale", "0"], "--helper-scale (ints >= 1)"),
                       (["--last-split-tiles", "x"], "--last-split-tiles (ints >= 0)"),
                       (["--tile-arms", "fast"], "unknown arm 'fast'")):
        bad = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "op_trace.py"), *flags],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert bad.returncode == 2 and why in bad.stderr, bad.stderr[-2000:]


@pytest.mark.parametrize("hidden,splits,last,width", [
    (1024, 2, 2, 768), (1024, 2, 1, 896), (2048, 4, 1, 640), (2048, 4, 0, None)])
def test_a_narrowed_last_split_keeps_whole_tiles_in_the_others(hidden, splits, last, width):
    from op_trace import narrowed_width

    assert narrowed_width(hidden, splits, last, 128) == width


@pytest.mark.parametrize("hidden,splits,last", [(1024, 1, 1), (1024, 2, 8), (256, 4, 3)])
def test_a_last_split_that_cannot_be_narrowed_is_refused(hidden, splits, last):
    from op_trace import NotNarrowable, narrowed_width

    with pytest.raises(NotNarrowable):
        narrowed_width(hidden, splits, last, 128)
