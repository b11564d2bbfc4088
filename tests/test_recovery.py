"""Issue 55: after a fault on any rank every rank raises (for that call or its next one),
within the bound, no rank ever combines partials of two calls, and the group recovers
by itself (the barrier's protocol, `kernels/flags.py`): the call after is correct.

Two and four gloo ranks on the interpreter, one process group each, the four faults in
a row: a skipped call, a call of other sizes, a rank that raises before launching, a
rank on another backend."""

import time

import pytest
import torch

from megatron_overlap.ops import OverlapConfig, gemm2_gather_rs
from dist_harness import run_ranks
from routing_cases import fp64_rank_partial, rel_err, routed_problem

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backends")
BASE = dict(tokens=24, experts=4, topk=2, ffn=16, hidden=32)
#: the waits' bound: far above a call's skew between interpreter processes on two cores
WAIT_S = {2: 6.0, 4: 8.0}
ERRORS = ("OverlapTimeoutError", "OverlapPeerError", "OverlapMismatchError")


def _call(rank, world, seed, check=True, backend="interpret", tokens=24, **kw):
    """(outcome, error against fp64 or the message, seconds) of one call on this rank;
    `check`: every rank makes this call alike (the fp64 sum is all-reduced first)."""
    import torch.distributed as dist

    p = routed_problem(rank, world, seed=seed, **dict(BASE, tokens=tokens))
    if check:
        full = fp64_rank_partial(p, tokens, with_probs=True)
        dist.all_reduce(full)
    config = OverlapConfig(backend=backend, wait_timeout_s=WAIT_S[world])
    start = time.monotonic()
    try:
        out = gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"], tokens,
                              BASE["topk"], p["probs"], dist.group.WORLD, config=config, **kw)
    except Exception as err:  # noqa: BLE001 - reported to the parent process
        return (type(err).__name__, str(err), time.monotonic() - start)
    seconds = time.monotonic() - start
    if not check:  # (a call that must have raised: what it returned, as numbers)
        return ("ok", float(out.float().abs().sum()), seconds)
    return ("ok", rel_err(out, full.chunk(world)[rank]), seconds)


def _faults(rank, world):
    import torch.distributed as dist

    last = world - 1
    res = {"first": _call(rank, world, 6)}
    # 1. the last rank skips a call: its peers' waits run out (and their recovery's);
    # the skipping rank's next call comes after that (gloo's barrier), so the op sees it
    if rank != last:
        res["skip"] = _call(rank, world, 7, check=False)
    dist.barrier()
    res["skip, next call"] = _call(rank, world, 8, check=False)
    res["skip, then"] = _call(rank, world, 9)
    # 2. rank 0 launches other sizes (M = 48: it would grow its peer memory)
    res["sizes"] = _call(rank, world, 10, check=False, tokens=48 if rank == 0 else 24)
    res["sizes, then"] = _call(rank, world, 11)
    # 3. rank 0 raises before it launches (an invalid C)
    res["raises"] = _call(rank, world, 12, check=False, comm_ctas=0 if rank == 0 else None)
    res["raises, then"] = _call(rank, world, 13)
    # 4. the last rank runs the reference backend (a gloo reduce-scatter)
    res["backend"] = _call(rank, world, 14, check=False,
                           backend="reference" if rank == last else "interpret")
    res["backend, then"] = _call(rank, world, 15)
    dist.barrier()
    return res


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def faulted(request):
    world = request.param
    return world, run_ranks(world, _faults, timeout=400)


def _raised(outcome, bound, *kinds):
    kind, message, seconds = outcome
    assert kind in (kinds or ERRORS), outcome
    assert seconds < bound, outcome
    return message


def _correct(outcome):
    kind, err, _ = outcome
    assert kind == "ok" and err < 1e-2, outcome


def test_a_skipped_call_raises_on_every_rank_and_the_group_recovers_by_itself(faulted):
    """The ranks that made the call raise once their wait runs out (it and the
    recovery's wait: 2 bounds); on the next call every rank raises (the skipping rank
    included, whose partial would have paired with the peers' stale ones), at once;
    the call after is correct on every rank, with no reset."""
    world, results = faulted
    wait = WAIT_S[world]
    for rank, res in enumerate(results):
        _correct(res["first"])
        if rank != world - 1:
            message = _raised(res["skip"], 2 * wait + 30, "OverlapTimeoutError")
            assert f"waiting for rank {world - 1}" in message and "next call" in message
        message = _raised(res["skip, next call"], wait + 30)
        assert "recover" in message and "no reset needed" in message
        _correct(res["skip, then"])


@pytest.mark.parametrize("case", ["sizes", "raises", "backend"])
def test_other_sizes_a_raise_before_launching_and_another_backend_raise_on_every_rank(
        faulted, case):
    """Every rank raises for that call, at once (no wait runs out: each sees what the
    other launched), naming what each rank launched; the next call is correct."""
    world, results = faulted
    for rank, res in enumerate(results):
        if case == "raises" and rank == 0:
            _raised(res[case], WAIT_S[world] + 30, "ValueError")
        else:
            message = _raised(res[case], WAIT_S[world], "OverlapMismatchError")
            assert {"sizes": "M=48", "raises": "raised before it launched",
                    "backend": "on the reference backend"}[case] in message, message
        _correct(res[case + ", then"])


def _skip_without_a_pause(rank, world):
    """Issue 55's case exactly: the last rank skips a call and makes its next one at once,
    while its peers still wait in the skipped one; with call tags (the seed) the two calls
    do not pair."""
    last = world - 1
    res = {"first": _call(rank, world, 6, call_tag=6)}
    if rank != last:
        res["skipped"] = _call(rank, world, 7, check=False, call_tag=7)
    res["next"] = _call(rank, world, 8, check=False, call_tag=8)
    res["then"] = _call(rank, world, 9, check=False, call_tag=9)
    # then calls the ranks make alike (each after an all-reduce): a recovery that was
    # pending may take one of them, the rest are correct
    res["after"] = [_call(rank, world, 10 + i, call_tag=10 + i) for i in range(3)]
    return res


def test_call_tags_turn_a_skip_paired_with_the_next_call_into_errors_on_every_rank():
    for rank, res in enumerate(run_ranks(2, _skip_without_a_pause, timeout=300)):
        assert res["first"][0] == "ok" and res["first"][1] < 1e-2, (rank, res)
        # no call between the first and the last returns: each raises, none mixes calls
        middle = [res[k] for k in ("skipped", "next", "then") if k in res]
        assert all(outcome[0] in ERRORS for outcome in middle), (rank, res)
        after = res["after"]
        assert all(o[0] in ERRORS or (o[0] == "ok" and o[1] < 1e-2) for o in after), res
        assert [o[0] for o in after[1:]] == ["ok", "ok"], (rank, res)
