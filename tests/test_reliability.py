"""Issue 29: every bad input a clear error or a correct result, ranks that disagree detected
(CPU: one rank, and two gloo ranks on the interpreter)."""

import dataclasses
import json

import pytest
import torch

from megatron_overlap.ops import default_session

from megatron_overlap import cli
from megatron_overlap.ops import OverlapConfig, gemm2_gather_rs
from megatron_overlap.ops import config as config_module
from megatron_overlap.planner import A100_PAPER, Calibration, Workload, load_preset_file
from dist_harness import run_ranks
from routing_cases import fp64_rank_partial, rel_err, routed_problem

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backends")
INTERP = OverlapConfig(backend="interpret")
REF = OverlapConfig(backend="reference")


def problem(**kw):
    return routed_problem(0, 1, **{**dict(tokens=24, experts=3, topk=2, ffn=16, hidden=32), **kw})


def call(p, tokens=24, topk=2, config=INTERP, probs=None, **kw):
    return gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"], tokens, topk,
                           probs, config=config, **kw)


# ----------------------------------------------------------------- 1: strided probs
def test_non_contiguous_probs_give_the_result_of_contiguous_ones():
    """GatherRS reads probs[row] at a flat offset: a strided view (a column of a stack,
    every other element) must give the bits of its contiguous copy, and match the
    reference backend."""
    p = problem(dtype=torch.float32)
    base = p["probs"]
    views = (torch.stack([base, 1 - base], 1)[:, 0],
             torch.stack([1 - base, base, base], 1)[:, 1],
             torch.repeat_interleave(base, 2)[::2])
    want = call(p, probs=base)
    for view in views:
        assert not view.is_contiguous()
        ref = call(p, probs=view.contiguous(), config=REF)
        got = call(p, probs=view)
        assert torch.equal(got, call(p, probs=view.contiguous()))
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(call(p, probs=views[0]), want)


# ----------------------------------------------------------------- 3: infinite rho
def _preset_file(tmp_path, **calibration):
    data = A100_PAPER.to_json()
    data["calibration"].update(calibration)
    path = tmp_path / "calib.json"
    path.write_text(json.dumps(data))  # (inf is written as JSON's Infinity)
    return path


@pytest.mark.parametrize("field,value", [("rho_ref", 1e308), ("rho_ref", float("inf")),
                                         ("k_epi", float("inf")), ("c_sat", float("nan"))])
def test_a_calibration_with_infinite_or_overflowing_rho_is_a_clear_error(tmp_path, field,
                                                                          value):
    path = _preset_file(tmp_path, **{field: value})
    p = problem()
    with pytest.raises(ValueError, match="finite"):
        call(p, config=OverlapConfig(backend="interpret", preset=str(path)))
    code = cli.main(["plan", "--preset", str(path), "--tokens", "4096", "--hidden", "2048",
                     "--ffn", "704", "--world", "4", "--expert-counts", "100,200"])
    assert code == 2


# ----------------------------------------------------------------- 4: explicit zeros
@pytest.mark.parametrize("kw", [dict(comm_ctas=0), dict(splits=0), dict(comm_ctas=-2),
                                dict(splits=65)])
def test_explicit_zero_comm_ctas_or_splits_is_an_error_not_the_default(kw):
    (name, value), = kw.items()
    with pytest.raises(ValueError, match=name):
        call(problem(), **kw)
    with pytest.raises(ValueError, match=name):
        OverlapConfig(**kw)


# ----------------------------------------------------------------- 5: environment
# (OverlapConfig.from_env, the one reader of the environment: tests/test_config_env.py)


# ----------------------------------------------------------------- 6: files
@pytest.mark.parametrize("gemm,comm", [
    (["64", 128, 64, 4, 3, False], [32, 512, 4]), ([64.0, 128, 64, 4, 3, False], [32, 512, 4]),
    ([float("nan"), 128, 64, 4, 3, False], [32, 512, 4]), ([-64, 128, 64, 4, 3, False], [32, 512, 4]),
    ([0, 128, 64, 4, 3, False], [32, 512, 4]), ([1 << 40, 128, 64, 4, 3, False], [32, 512, 4]),
    ([64, 128, 64, 4, 3, False], [32, 512, 4, "yes"]), ([64, 128, 64, 3, 3, False], [32, 512, 4]),
])
def test_tiles_file_values_are_validated_and_the_error_names_the_file(tmp_path, gemm, comm):
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"best": {"gemm": gemm, "comm": comm}}))
    config_module.load_tiles.cache_clear()
    with pytest.raises(ValueError, match="tiles.json: not a tune_tiles result"):
        config_module.load_tiles(str(path))


def test_tile_config_rejects_zero_and_odd_sizes():
    for field, bad in (("block_m", 0), ("block_n", 24), ("comm_tn", 1 << 40),
                       ("gemm_stages", 0), ("comm_warps", 64), ("token_major", 1)):
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(config_module.INTERPRET_TILES, **{field: bad})


@pytest.mark.parametrize("text,message", [
    ("[1, 2]", "top level is a JSON list"), ('{"name": "x", "kernel": {', "Expecting"),
    ('{"preset": 3}', "not an object"), ("{}", "name"),
])
def test_calibration_file_errors_name_the_file(tmp_path, text, message):
    path = tmp_path / "calib.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"calib.json.*{message}"):
        load_preset_file(path)
    with pytest.raises(ValueError, match="missing.json"):
        load_preset_file(tmp_path / "missing.json")


def test_calibration_bounds_c_max_and_default_splits(tmp_path):
    with pytest.raises(ValueError, match="c_max"):
        dataclasses.replace(A100_PAPER.calibration, c_max=10 ** 9)
    data = A100_PAPER.to_json()
    data["default_splits"] = -3
    path = tmp_path / "calib.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="calib.json.*default_splits"):
        load_preset_file(path)


# ----------------------------------------------------------------- 7: CLI
PLAN = ["plan", "--tokens", "4096", "--hidden", "2048", "--ffn", "704", "--world", "4",
        "--expert-counts", "100,200"]


@pytest.mark.parametrize("extra,message", [
    (["--preset", "missing/calib.json"], "missing/calib.json"),
    (["--plot", "/nonexistent-dir/x/curve.png"], "curve.png"),
    (["--local-topk", "inf"], "local_topk"), (["--local-topk", "nan"], "local_topk"),
])
def test_cli_reports_files_and_non_finite_numbers_without_a_traceback(capsys, extra, message):
    pytest.importorskip("matplotlib") if "--plot" in extra else None
    assert cli.main(PLAN + extra) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# ----------------------------------------------------------------- 8, 9: odd arguments
@pytest.mark.parametrize("change,error,message", [
    (dict(topk=2.5), TypeError, "topk must be an int"),
    (dict(topk=True), TypeError, "topk must be an int"),
    (dict(num_tokens=24.0), TypeError, "num_tokens must be an int"),
    (dict(num_tokens=torch.tensor(24)), TypeError, "num_tokens must be an int"),
    (dict(splits=2.0), TypeError, "splits must be an int"),
    (dict(comm_ctas=True), TypeError, "comm_ctas must be an int"),
    (dict(counts=lambda p: [float(c) for c in p["counts"]]), TypeError, r"tokens_per_expert\[0\]"),
    (dict(counts=lambda p: [True] * 3), TypeError, r"tokens_per_expert\[0\]"),
    (dict(counts=lambda p: p["counts"].bool()), ValueError, "tokens_per_expert must hold integers"),
    (dict(weight=lambda p: p["weight"][0]), ValueError, r"weight \[E, N, K\]"),
    (dict(probs=lambda p: p["probs"].to(torch.int32)), ValueError, "probs must have a dtype"),
    (dict(config="interpret"), TypeError, "config must be an OverlapConfig"),
    (dict(expected_rows=3.5), TypeError, "expected_rows must be an int"),
    (dict(topk=1 << 20), ValueError, r"topk must be an int in \[1, 256\]"),
])
def test_odd_typed_arguments_raise_errors_naming_the_argument(change, error, message):
    p = problem()
    args = dict(tokens=24, topk=2, probs=None)
    kw = {}
    for key, value in change.items():
        if callable(value):
            p[key] = value(p)
            if key == "probs":
                args["probs"] = p["probs"]
        elif key in ("topk", "num_tokens"):
            args["topk" if key == "topk" else "tokens"] = value
        else:
            kw[key] = value
    with pytest.raises(error, match=message):
        call(p, args["tokens"], args["topk"], probs=args["probs"], **kw)


def test_partial_dtype_is_validated():
    with pytest.raises(ValueError, match="partial_dtype"):
        OverlapConfig(partial_dtype=torch.int32)
    assert OverlapConfig(partial_dtype=torch.float32).partial_dtype == torch.float32


def test_workload_and_calibration_reject_non_finite_numbers():
    with pytest.raises(ValueError, match="local_topk"):
        Workload(64, 64, 64, 1, 1, (8,), topk=2, local_topk=float("inf"))
    with pytest.raises(ValueError, match="overlap_factor"):
        dataclasses.replace(A100_PAPER.calibration, overlap_factor=float("inf"))
    with pytest.raises(ValueError, match="rho_ref"):
        Calibration(rho_ref=None, k_ref=1, tm_ref=1, tn_ref=1, d_ref=1, c_max=1)


# ----------------------------------------------------------------- fuzz
def _fuzz_case(draw):
    from hypothesis import strategies as st

    experts = draw(st.integers(1, 3))
    true_k = draw(st.integers(1, experts))
    tokens = draw(st.integers(1, 10))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    ffn = draw(st.sampled_from([8, 16]))
    p = routed_problem(0, 1, tokens=tokens, experts=experts, topk=true_k, ffn=ffn,
                       hidden=draw(st.integers(1, 20)), dtype=dtype,
                       seed=draw(st.integers(0, 3)))
    counts = draw(st.sampled_from(["tensor", "list", "int32"] * 3 + ["off by one", "floats"]))
    p["counts"] = {"tensor": p["counts"], "list": p["counts"].tolist(),
                   "int32": p["counts"].int(), "off by one": (p["counts"] + 1).tolist(),
                   "floats": p["counts"].float()}[counts]
    probs = draw(st.sampled_from([None, "contiguous", "strided"] * 3 + ["int", "short"]))
    pr = p["probs"]
    p["probs"] = {None: None, "contiguous": pr, "strided": torch.stack([pr, pr], 1)[:, 1],
                  "int": (pr * 3).int(), "short": pr[:-1]}[probs]
    if p["probs"] is not None and p["probs"].is_floating_point():
        p["probs"] = p["probs"].to(dtype)
    # (mostly valid values, so most examples reach the kernels)
    any_int = st.one_of(st.none(), st.none(), st.integers(1, 8), st.integers(-1, 70),
                        st.just(2.0), st.just(True))
    args = dict(num_tokens=draw(st.sampled_from([tokens] * 6 + [tokens + 3, tokens - 1,
                                                                float(tokens)])),
                topk=draw(st.one_of(st.just(true_k), st.just(true_k + 1), st.integers(0, 4),
                                    st.just(1.5))),
                comm_ctas=draw(any_int), splits=draw(any_int))
    return p, args


def _run(p, args, config):
    return gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"],
                           args["num_tokens"], args["topk"], p["probs"], None, config=config,
                           comm_ctas=args["comm_ctas"], splits=args["splits"])


def test_fuzzed_public_arguments_give_a_clear_error_or_the_reference_result():
    """Over the op's public arguments (shapes, dtypes, counts as lists and tensors, probs
    strided or wrong, C and L of any kind): the interpreter backend either raises a
    ValueError / TypeError, or gives the reference backend's result."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    outcomes = {"error": 0, "result": 0}

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def check(data):
        p, args = _fuzz_case(data.draw)
        try:
            got = _run(p, args, INTERP)
        except (ValueError, TypeError) as err:
            assert str(err)  # a message, not a bare exception
            outcomes["error"] += 1
            return
        outcomes["result"] += 1
        want = _run(p, args, REF)
        tol = 1e-5 if got.dtype == torch.float32 else 2e-2
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), args

    assert hypothesis  # (imported for the skip)
    check()
    assert outcomes["result"] >= 20, outcomes  # (the kernels ran, not only the checks)


# ----------------------------------------------------------------- 10: waits by time
def test_waits_are_bounded_by_time_and_the_error_says_how_long(monkeypatch):
    """A producer that never publishes (GEMM2 skipped): with no poll bound the wait ends
    after wait_timeout_s of the clock, and the error names that time; the bound is
    checked (its variable: tests/test_config_env.py)."""
    from megatron_overlap.kernels import gemm2
    from megatron_overlap.ops import OverlapTimeoutError

    monkeypatch.setattr(gemm2, "launch_grouped_gemm2", lambda *a, **k: None)
    config = OverlapConfig(backend="interpret", wait_timeout_s=0.25, sm_margin=1)
    assert config.max_spins == (1 << 31) - 1  # (no poll bound: time alone ends the wait)
    import time

    start = time.monotonic()
    with pytest.raises(OverlapTimeoutError, match=r"split 0 .*after waiting 0.25 s"):
        call(problem(), config=config, comm_ctas=1, splits=1)
    assert time.monotonic() - start < 20
    default_session(None, "cpu").buffer("interpret").reset()
    for bad in (0, -1.0, float("nan"), 1e9, True):
        with pytest.raises(ValueError, match="wait_timeout_s"):
            OverlapConfig(wait_timeout_s=bad)


# ----------------------------------------------------------------- 2: ranks that disagree
#: the wait bound of the two-rank cases: short, but far above a call's skew between the
#: two interpreter processes
DISAGREE_WAIT_S = 20.0
#: most a call may take there (a hang or a wait that ran out would take longer)
DISAGREE_BOUND_S = 15.0
BASE = dict(tokens=24, experts=4, topk=2, ffn=16, hidden=32, ep=1)


def _attempt(rank, world, group, case, check=True, **kw):
    """(outcome, message or error against fp64, seconds) of one interpreter call of `case`
    on this rank; `check`: both ranks call the same case, and the result is compared
    with the fp64 sum (an all-reduce, before the call: never one rank alone)."""
    import time

    import torch.distributed as dist

    p = routed_problem(rank, world, seed=6, **case)
    if check:
        full = fp64_rank_partial(p, case["tokens"], with_probs=True)
        dist.all_reduce(full, group=group)
    config = OverlapConfig(backend="interpret", wait_timeout_s=DISAGREE_WAIT_S)
    start = time.monotonic()
    try:
        out = gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"],
                              case["tokens"], case["topk"], p["probs"], group,
                              config=config, **kw)
    except Exception as err:  # noqa: BLE001 - reported to the parent process
        return (type(err).__name__, str(err), time.monotonic() - start)
    seconds = time.monotonic() - start
    if not check:
        return ("ok", tuple(out.shape), seconds)
    return ("ok", rel_err(out, full.chunk(world)[rank]), seconds)


def _disagreeing_ranks(rank, world):
    import torch.distributed as dist


    group = dist.group.WORLD
    res = {}

    def both(name, mine, **kw):
        """rank 0 calls BASE, rank 1 `mine`; then both call BASE (the buffer after)."""
        res[name] = _attempt(rank, world, group, BASE if rank == 0 else mine, False, **kw)
        res[name + " then"] = _attempt(rank, world, group, BASE)

    # the group's first call: no peer memory yet (its allocation is collective)
    both("first call, M", dict(BASE, tokens=48))
    res["agree"] = _attempt(rank, world, group, BASE)
    both("M, rank 1 grows", dict(BASE, tokens=48))
    both("M, fits", dict(BASE, tokens=16))
    both("N", dict(BASE, hidden=48))
    both("N, fits", dict(BASE, hidden=16))
    both("dtype", dict(BASE, dtype=torch.float32))
    # both grow together: the agreement passes and the memory grows
    res["both grow"] = _attempt(rank, world, group, dict(BASE, tokens=64, hidden=48))
    # C and L are each rank's own (under EP each rank plans from its own counts): ranks
    # that differ there pair correctly
    res["C, L"] = _attempt(rank, world, group, BASE, comm_ctas=1 + 2 * rank, splits=1 + rank)
    # (faults between ranks and the recovery from them: tests/test_recovery.py)
    default_session(group, "cpu").buffer("interpret").reset()
    res["after reset"] = _attempt(rank, world, group, BASE)
    dist.barrier()
    return res


@pytest.fixture(scope="module")
def disagreeing():
    # (bounded: before ranks were checked, one of these cases left a rank in a collective
    # its peer never joined)
    return run_ranks(2, _disagreeing_ranks, timeout=300)


def _mismatch(outcome, *fields):
    kind, message, seconds = outcome
    assert kind == "OverlapMismatchError", outcome
    assert seconds < DISAGREE_BOUND_S, outcome
    for field in fields:
        assert field in message, (field, message)


def _fine(outcome):
    kind, err, seconds = outcome
    assert kind == "ok" and err < 1e-2, outcome


@pytest.mark.parametrize("name,fields", [
    ("first call, M", ["M=24", "M=48"]),
    ("M, rank 1 grows", ["M=24", "M=48"]),
    ("M, fits", ["M=24", "M=16"]),
    ("N", ["N=32", "N=48"]),
    ("N, fits", ["N=32", "N=16"]),
    ("dtype", ["bfloat16", "float32"]),
])
def test_ranks_that_disagree_on_the_shapes_all_raise_naming_both_and_the_buffer_works_after(
        disagreeing, name, fields):
    """Every rank raises at once (no wait runs out), naming what each rank launched; the
    next matching call on the same buffer is correct (no reset needed)."""
    for rank, res in enumerate(disagreeing):
        _mismatch(res[name], "rank 0 launched", "rank 1 launched", *fields)
        _fine(res[name + " then"])
    assert all(res["agree"][0] == "ok" for res in disagreeing)


def test_ranks_that_grow_together_agree_and_ranks_with_their_own_c_and_l_pair(disagreeing):
    for res in disagreeing:
        _fine(res["both grow"])
        _fine(res["C, L"])


def test_a_reset_on_every_rank_rebuilds_a_buffer_that_then_pairs(disagreeing):
    for res in disagreeing:
        _fine(res["after reset"])
