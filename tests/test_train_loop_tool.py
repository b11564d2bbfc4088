"""tools/train_loop.py reads Megatron-LM's log lines as training.py writes them, and its
verdict fails a run that loses a MoE layer to stock or drifts from stock's loss."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import train_loop  # noqa: E402


def _line(iteration, ms, loss, iters=50):
    # training.py's training_log, core_r0.19 (timestamp, then these fields in this order)
    return (f" [2026-12-06 05:00:00.000000] iteration {iteration:8d}/{iters:8d} |"
            f" consumed samples: {iteration * 2:12d} | elapsed time per iteration (ms): "
            f"{ms:.1f} | learning rate: 1.000000E-04 | global batch size:     2 |"
            f" lm loss: {loss:.6E} | load_balancing_loss: 1.000000E+00 | loss scale: 1.0 |")


def _log(losses, ms, build=None):
    lines = ["INFO: unrelated"] + ([build] if build else [])
    lines += [_line(5 * (i + 1), ms + (100 if i == 0 else 0), x) for i, x in enumerate(losses)]
    return "\n".join(lines)


def _run(text):
    return dict(rc=0, **train_loop.parse_log(text))


def test_megatrons_logged_iterations_and_our_build_line_are_read():
    text = _log([11.5, 10.25], 180.0, "megatron-overlap: 4 of 4 MoE layers overlapped (x)")
    found = train_loop.parse_log(text)
    assert found["iterations"] == {5: (280.0, 11.5), 10: (180.0, 10.25)}
    assert found["build"] == ["megatron-overlap: 4 of 4 MoE layers overlapped (x)"]


def test_verdict_passes_equal_losses_and_times_after_the_first_interval():
    stock = _run(_log([11.5, 10.25, 9.5], 240.0))
    ours = _run(_log([11.5, 10.2501, 9.5], 180.0,
                     "megatron-overlap: 4 of 4 MoE layers overlapped (x)"))
    v = train_loop.compare(stock, ours, rtol=2e-3, log_interval=5)
    assert v["ok"] and v["every_moe_layer_overlapped"] and v["logged"] == [5, 10, 15]
    assert (v["stock_ms"], v["overlap_ms"]) == (240.0, 180.0)  # (iteration 5 left out)
    assert abs(v["speedup"] - 240 / 180) < 1e-12


def test_verdict_fails_a_stock_layer_a_drifting_loss_or_a_failed_run():
    stock = _run(_log([11.5, 10.25], 240.0))
    partial = _run(_log([11.5, 10.25], 180.0, "megatron-overlap: 3 of 4 MoE layers overlapped"))
    assert not train_loop.compare(stock, partial, 2e-3, 5)["ok"]
    drift = _run(_log([11.5, 10.5], 180.0, "megatron-overlap: 4 of 4 MoE layers overlapped"))
    assert not train_loop.compare(stock, drift, 2e-3, 5)["ok"]
    failed = dict(_run(""), rc=1)
    assert not train_loop.compare(stock, failed, 2e-3, 5)["ok"]


def test_te_graph_runs_must_show_tes_capture_line_in_both_arms():
    capture = "INFO:megatron.core.transformer.cuda_graphs:Time spent in CUDA Graphs capture on rank 0: 0.43s"
    stock = _run(_log([11.5, 10.25], 240.0) + "\n" + capture)
    ours = _run(_log([11.5, 10.25], 180.0, "megatron-overlap: 4 of 4 MoE layers overlapped"))
    assert stock["graph_captures"] == [0.43] and ours["graph_captures"] == []
    assert train_loop.compare(stock, ours, 2e-3, 5)["ok"]  # (graphs not asked for)
    v = train_loop.compare(stock, ours, 2e-3, 5, graphs=True)
    assert not v["ok"] and v["cuda_graphs_captured"] is False
    ours["graph_captures"] = [0.41]
    assert train_loop.compare(stock, ours, 2e-3, 5, graphs=True)["cuda_graphs_captured"]
    assert train_loop.asks_te_graphs(["--cuda-graph-impl", "transformer_engine"])
    assert train_loop.asks_te_graphs(["--cuda-graph-impl=transformer_engine"])
    assert not train_loop.asks_te_graphs(["--cuda-graph-impl", "local", "transformer_engine"])
