"""OverlapSession: one object owns the op's state, with an explicit lifecycle (CPU, the
Triton interpreter)."""

import pytest
import torch

from megatron_overlap.ops import (OverlapConfig, OverlapSession, default_session,
                                  gemm2_gather_rs)
from routing_cases import fp64_rank_partial, rel_err, routed_problem

INTERP = OverlapConfig(backend="interpret")


def _problem():
    return routed_problem(0, 1, tokens=40, experts=4, topk=3, ffn=16, hidden=48)


def _args(p):
    return p["x"], p["weight"], p["counts"], p["token_index"], 40, 3


def test_a_session_gives_the_bits_of_gemm2_gather_rs_and_keeps_its_own_state():
    """Two sessions on one device share nothing (buffer, planner, router), and each gives
    the default session's output bit for bit."""
    p = _problem()
    want = gemm2_gather_rs(*_args(p), config=INTERP)
    first, second = OverlapSession(None, "cpu", INTERP), OverlapSession(None, "cpu", INTERP)
    assert torch.equal(first(*_args(p)), want)
    assert first.planner.cached_counts()["decisions"] == 1
    assert second.planner.cached_counts()["decisions"] == 0 and not second.buffers()
    assert torch.equal(second(*_args(p)), want)
    assert first.buffer("interpret") is not second.buffer("interpret")
    assert first.router is not second.router
    assert rel_err(want, fp64_rank_partial(p, 40)) < 1e-2


def test_prepare_then_launch_equals_one_call_and_the_handle_names_its_plan():
    p = _problem()
    session = OverlapSession(None, "cpu", INTERP)
    handle = session.prepare(*_args(p), splits=2)
    assert handle.plan.splits == 2 and handle.buffer is session.buffer("interpret")
    out = session.launch(handle, p["x"], p["weight"])
    assert torch.equal(out, session(*_args(p), splits=2))


def test_a_sessions_call_trains_as_the_op_does():
    """Gradients through a session's call are those of `gemm2_gather_rs`."""
    p = _problem()
    grads = []
    for run in (lambda *a: gemm2_gather_rs(*a, config=INTERP),
                OverlapSession(None, "cpu", INTERP)):
        x, w = p["x"].clone().requires_grad_(True), p["weight"].clone().requires_grad_(True)
        run(x, w, p["counts"], p["token_index"], 40, 3).float().square().sum().backward()
        grads.append((x.grad, w.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_closed_session_refuses_calls_and_leaves_the_default_table():
    p = _problem()
    session = default_session(None, "cpu")
    session(*_args(p), config=INTERP)
    session.close()
    assert session.closed and not session.buffers()
    with pytest.raises(RuntimeError, match="closed"):
        session(*_args(p), config=INTERP)
    fresh = default_session(None, "cpu")
    assert fresh is not session
    assert torch.equal(fresh(*_args(p), config=INTERP), gemm2_gather_rs(*_args(p), config=INTERP))
    with OverlapSession(None, "cpu", INTERP) as scoped:
        scoped(*_args(p))
    assert scoped.closed


def test_a_call_on_another_device_than_its_session_names_both():
    p = _problem()
    session = OverlapSession(None, "cpu", INTERP)
    with pytest.raises(ValueError, match="x is on meta, the session on cpu"):
        session(p["x"].to("meta"), p["weight"].to("meta"), p["counts"],
                p["token_index"].to("meta"), 40, 3)


def test_a_session_checks_its_config_and_its_calls_config():
    with pytest.raises(TypeError, match="config must be an OverlapConfig"):
        OverlapSession(None, "cpu", {"backend": "interpret"})
    p = _problem()
    session = OverlapSession(None, "cpu", INTERP)
    with pytest.raises(TypeError, match="config must be an OverlapConfig"):
        session(*_args(p), config="interpret")


def test_the_op_keeps_no_process_wide_state_but_the_default_sessions_table():
    """The op's modules hold no registry of buffers, routers, streams, groups or plans:
    every mutable module- or class-level container left in them is the one table of
    default sessions (`gemm2_gather_rs`'s)."""
    import inspect

    from megatron_overlap import ops

    found = []
    for name in ("buffer", "errors", "groups", "launcher", "op", "planning", "plans",
                 "routing", "session", "counts_ring", "residency", "fusion"):
        module = getattr(__import__(f"megatron_overlap.ops.{name}").ops, name)
        for attr, value in vars(module).items():
            if isinstance(value, (dict, list, set)) and not attr.startswith("__"):
                found.append(f"{name}.{attr}")
            if inspect.isclass(value) and value.__module__ == module.__name__:
                found += [f"{name}.{value.__name__}.{a}" for a, v in vars(value).items()
                          if isinstance(v, (dict, list, set)) and not a.startswith("__")]
    assert found == ["session._default_sessions"], found
    assert ops.OverlapSession is OverlapSession


def test_a_handle_runs_only_on_the_open_session_that_prepared_it():
    p = _problem()
    first, second = OverlapSession(None, "cpu", INTERP), OverlapSession(None, "cpu", INTERP)
    second(*_args(p))  # (its own buffer exists: the handle's is still not its)
    handle = first.prepare(*_args(p))
    with pytest.raises(ValueError, match="another OverlapSession"):
        second.launch(handle, p["x"], p["weight"])
    with pytest.raises(TypeError, match="handle must be a Launch"):
        first.launch("not a handle", p["x"], p["weight"])
    with pytest.raises(ValueError, match="must be those the handle was prepared with"):
        first.launch(handle, p["x"][:-1], p["weight"])
    with pytest.raises(ValueError, match="must be those the handle was prepared with"):
        first.launch(handle, p["x"].float(), p["weight"].float())
    first.close()
    with pytest.raises(RuntimeError, match="closed"):
        first.launch_kernels(handle, p["x"], p["weight"], torch.empty(40, 48))


def test_a_padded_handle_refuses_gradients_as_the_op_does():
    p = _problem()
    session = OverlapSession(None, "cpu", INTERP)
    with torch.no_grad():
        handle = session.prepare(*_args(p), expected_rows=p["x"].shape[0])
    x = p["x"].clone().requires_grad_(True)
    with pytest.raises(ValueError, match="expected_rows .* is for inference"):
        session.launch(handle, x, p["weight"])


# ------------------------------------------------------------- compiling and planning

def _counting_compiles(monkeypatch) -> list:
    """Every kernel-family compile (`plans._occupancies`, the one hook: the interpreter's
    fixed residency, a compile of the binaries on CUDA), recorded by key."""
    from megatron_overlap.ops import plans

    compiled, real = [], plans._occupancies
    monkeypatch.setattr(plans, "_occupancies", lambda key: compiled.append(key) or real(key))
    return compiled


def _refusing_compiles(monkeypatch) -> None:
    from megatron_overlap.ops import plans

    def refuse(key):
        raise AssertionError(f"compiled {key} while planning")
    monkeypatch.setattr(plans, "_occupancies", refuse)


def test_warm_up_compiles_each_family_once_and_a_second_warm_up_is_free(monkeypatch):
    compiled = _counting_compiles(monkeypatch)
    session = OverlapSession(None, "cpu", INTERP)
    families = session.warm_up(48, 3, torch.bfloat16)
    # both layouts of y (token_major=None), each once; the L ranked share a comm tile here
    assert len(compiled) == len(set(compiled)) == len(families) == 2
    assert {key.tiles.token_major for key in compiled} == {True, False}
    assert session.warm_up(48, 3, torch.bfloat16) == families and len(compiled) == 2
    assert session.warm_up(48, 3, torch.bfloat16, token_major=True) == families[:1]
    # another L with another communication tile is another family, compiled once
    assert len(session.warm_up(48, 3, torch.bfloat16, splits=(1, 8), token_major=True)) == 2
    assert len(compiled) == 3 and session.families.at_call == []


def test_planning_compiles_nothing_after_warm_up(monkeypatch):
    """After warm_up, calls of that shape and the planner's requests at every routing,
    batch length and explicit C plan without a single compile (the hook raises)."""
    import dataclasses

    session = OverlapSession(None, "cpu", INTERP)
    session.warm_up(48, 3, torch.bfloat16)
    _refusing_compiles(monkeypatch)
    p = _problem()
    handle = session.prepare(*_args(p))
    request = handle.launch_plan.request
    for row_tiles in range(1, 40):
        for tokens, comm_ctas in ((40, None), (80, None), (120, 3)):
            session.planner.plan(dataclasses.replace(request, row_tiles=row_tiles,
                                                     num_tokens=tokens, comm_ctas=comm_ctas))
    for seed in range(4):
        q = routed_problem(0, 1, tokens=40, experts=4, topk=3, ffn=16, hidden=48, seed=seed)
        assert rel_err(session(*_args(q)), fp64_rank_partial(q, 40)) < 1e-2
    assert session.families.at_call == []


def test_a_planner_without_the_family_raises_instead_of_compiling(monkeypatch):
    """The planner only looks families up: a triton family nobody compiled raises
    MissingKernelFamily (a CPU-built request: no device is touched), and one in its
    lookup plans without the hook."""
    import dataclasses

    from megatron_overlap.ops import plans

    session = OverlapSession(None, "cpu", INTERP)
    request = dataclasses.replace(session.prepare(*_args(_problem())).launch_plan.request,
                                  backend="triton")
    _refusing_compiles(monkeypatch)
    families = plans.KernelFamilies()
    with pytest.raises(plans.MissingKernelFamily, match="not compiled: triton GEMM2"):
        plans.Planner(families).plan(request)
    with pytest.raises(plans.MissingKernelFamily):  # nor does a planner of no families
        plans.Planner().plan(request)
    monkeypatch.setattr(plans, "_occupancies", lambda key: (2, 1, None, {}))
    families.warm(plans.request_families(request))
    _refusing_compiles(monkeypatch)
    assert plans.Planner(families).plan(request).family.o_comp == 2


def test_a_call_without_warm_up_compiles_its_families_first_and_logs_it(caplog):
    """The public op needs no warm-up: a session's call compiles the families its plan
    needs before planning, says so (INFO on CUDA, DEBUG under the interpreter), and
    records their keys; the next call of the shape compiles nothing."""
    import logging

    p = _problem()
    session = OverlapSession(None, "cpu", INTERP)
    with caplog.at_level(logging.DEBUG, logger="megatron_overlap"):
        out = session(*_args(p))
    assert session.families.at_call and set(session.families.at_call) <= set(session.families)
    assert "warm_up was not called for this shape" in caplog.text
    first = list(session.families.at_call)
    assert torch.equal(session(*_args(p)), out) and session.families.at_call == first
    warmed = OverlapSession(None, "cpu", INTERP)
    warmed.warm_up(48, 3, p["x"].dtype)
    assert torch.equal(warmed(*_args(p)), out) and warmed.families.at_call == []


def test_a_capture_refuses_a_kernel_family_not_compiled_before_it():
    """A captured call may not compile (a compile allocates and loads a module): the op
    checks its families before routing anything into the capture (CUDA only; the check
    itself is the op's `_refuse_uncompiled`)."""
    from types import SimpleNamespace

    from megatron_overlap.ops import op
    from megatron_overlap.ops.planning import default_tiles

    session = OverlapSession(None, "cpu", INTERP)
    call = SimpleNamespace(config=INTERP, backend="interpret", topk=3, splits=None,
                           scales=None)
    tiles = default_tiles("interpret")
    with pytest.raises(RuntimeError, match="not compiled; call OverlapSession.warm_up"):
        op._refuse_uncompiled(session, call, tiles, 48)
    session.warm_up(48, 3, token_major=tiles.token_major)
    op._refuse_uncompiled(session, call, tiles, 48)  # (warmed: no refusal)


def test_warm_up_checks_its_arguments_and_has_nothing_to_compile_on_the_reference_path():
    session = OverlapSession(None, "cpu", INTERP)
    with pytest.raises(ValueError, match="hidden"):
        session.warm_up(0, 3)
    with pytest.raises(TypeError, match="config must be an OverlapConfig"):
        session.warm_up(48, 3, config="interpret")
    assert session.warm_up(48, 3, config=OverlapConfig(backend="reference")) == ()
    session.close()
    with pytest.raises(RuntimeError, match="closed"):
        session.warm_up(48, 3)
