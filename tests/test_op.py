"""gemm2_gather_rs on CPU: interpret and reference backends, 1 and 2 ranks."""

import dataclasses
import warnings

import pytest
import torch

from dist_harness import run_ranks
from megatron_overlap.ops import OverlapConfig, OverlapTimeoutError, gemm2_gather_rs
from megatron_overlap.ops import groups
from megatron_overlap.ops import op as op_module
from megatron_overlap.ops.config import GPU_TILES, INTERPRET_SMS, INTERPRET_TILES, PARTITION_TILES
from megatron_overlap.ops import launcher, planning
from megatron_overlap.ops.routing import Router
from megatron_overlap.ops.session import default_session
from routing_cases import fp64_rank_partial, rel_err, routed_problem

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backends")
INTERP = OverlapConfig(backend="interpret")


def CPU_SESSION():
    """The session `gemm2_gather_rs` runs one-rank CPU calls on."""
    return default_session(None, "cpu")


def groups_refusal() -> str:
    """Why a capture of a session's first call (nothing prepared yet) is refused."""
    x = torch.empty(1)
    try:
        groups.call_backend(INTERP, x, None, True, (), True)
    except RuntimeError as err:
        return str(err)
    return ""
REF = OverlapConfig(backend="reference")
NO_HELPERS = OverlapConfig(backend="interpret", tail_helpers=False)


def _row_order_config():
    import dataclasses

    from megatron_overlap.ops.config import INTERPRET_TILES

    return OverlapConfig(backend="interpret",
                         tiles=dataclasses.replace(INTERPRET_TILES, token_major=False))


ROW_ORDER = _row_order_config()  # GEMM2's output in its own row order (not token-major)
# one small communication CTA beside GEMM2's on every SM of the virtual device
SHARED = OverlapConfig(backend="interpret",
                       tiles=dataclasses.replace(INTERPRET_TILES, placement="shared"))


def call(p, tokens, topk, config, probs=False, group=None, **kw):
    return gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"], tokens, topk,
                           p["probs"] if probs else None, group, config=config, **kw)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("probs", [False, True])
def test_single_rank_matches_fp64_reference(dtype, tol, probs):
    p = routed_problem(0, 1, tokens=45, experts=5, topk=2, ffn=24, hidden=40, dtype=dtype)
    ref = fp64_rank_partial(p, 45, with_probs=probs)
    for config in (INTERP, REF):
        out = call(p, 45, 2, config, probs=probs)
        assert out.shape == (45, 40) and out.dtype == dtype
        assert rel_err(out, ref) < tol


def test_output_independent_of_comm_ctas_and_splits():
    p = routed_problem(0, 1, tokens=40, experts=4, topk=3, ffn=16, hidden=48)
    outs = {(c, l): call(p, 40, 3, INTERP, comm_ctas=c, splits=l)
            for c in (1, 2, 3, 8, 16) for l in (1, 2, 4)}
    outs["no helpers"] = call(p, 40, 3, NO_HELPERS, comm_ctas=2, splits=2)
    first = outs[(1, 1)]
    assert all(torch.equal(o, first) for o in outs.values())


@pytest.mark.parametrize("splits,widths", [(2, (24, 32, 40, 47)), (3, (16, 20, 23)),
                                           (4, (12, 14, 15))])
def test_narrower_last_split_gives_the_same_bits_and_writes_every_element(splits, widths):
    """Splits 0..L-2 of width sw and a last one of the N - (L-1) sw columns left (the
    default sw = ceil(N/L) first): GEMM2's exact tile counts per split, GatherRS's items
    and the readiness counts agree, and the sum order is the same."""
    p = routed_problem(0, 1, tokens=40, experts=4, topk=3, ffn=16, hidden=48)
    launch = CPU_SESSION().prepare(p["x"], p["weight"], p["counts"], p["token_index"], 40, 3,
                               config=INTERP, splits=splits)
    outs = []
    for width in widths:
        out = torch.full((40, 48), float("nan"), dtype=p["x"].dtype)
        launcher.launch(launch.buffer, p["x"], p["weight"], launch.routing, launch.launch_plan,
                        None, out, width=width)
        launch.buffer.check()
        assert not torch.isnan(out).any()
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert torch.equal(outs[0], call(p, 40, 3, INTERP, splits=splits))
    with pytest.raises(ValueError, match="to the last of"):
        launcher.launch(launch.buffer, p["x"], p["weight"], launch.routing, launch.launch_plan,
                        None, out, width=48 // splits - 1)


def test_shared_placement_gives_the_partitions_bits_with_a_comm_cta_on_every_sm():
    from megatron_overlap.ops.config import INTERPRET_SMS

    p = routed_problem(0, 1, tokens=40, experts=4, topk=3, ffn=16, hidden=48, empty=(2,))
    first = call(p, 40, 3, INTERP, comm_ctas=2, splits=2)
    out, plan = call(p, 40, 3, SHARED, return_plan=True)
    # GEMM2 keeps every SM; the planner puts one communication CTA beside it on each
    assert (plan.comm_ctas, plan.reservation, plan.compute_slots) == (
        INTERPRET_SMS, 0, 2 * INTERPRET_SMS)
    assert torch.equal(out, first)
    for c, l in ((1, 1), (3, 4), (INTERPRET_SMS, 2)):
        assert torch.equal(call(p, 40, 3, SHARED, comm_ctas=c, splits=l), first)
    with pytest.raises(ValueError, match="one communication CTA beside GEMM2's per SM"):
        call(p, 40, 3, SHARED, comm_ctas=INTERPRET_SMS + 1)


def _planned_as_misfit(monkeypatch, o_comp: int, o_comm: int, sm_margin: int):
    """A problem and a shared-placement config whose kernels plan as compiled binaries
    that do not fit one SM together (the interpreter has none: their residency given),
    in a plan cache of its own (`sm_margin`)."""
    from megatron_overlap.ops import plans

    families = plans.KernelFamilies()  # (fresh ones, compiled by the patched hook below)
    monkeypatch.setattr(CPU_SESSION(), "families", families)
    monkeypatch.setattr(CPU_SESSION(), "planner", plans.Planner(families))
    monkeypatch.setattr(plans, "_occupancies", lambda *a: (o_comp, o_comm, "registers", {}))
    p = routed_problem(0, 1, tokens=30, experts=3, topk=2, ffn=16, hidden=32)
    return p, dataclasses.replace(SHARED, sm_margin=sm_margin)


def test_shared_placement_that_does_not_fit_an_sm_plans_the_partition(monkeypatch):
    """Where the compiled kernels do not fit one SM together (the op reads it from the
    binaries on CUDA), the op warns and plans and launches the partition placement."""
    p, config = _planned_as_misfit(monkeypatch, o_comp=2, o_comm=1, sm_margin=3)
    with pytest.warns(RuntimeWarning, match="shared placement does not fit one SM"):
        out, plan = call(p, 30, 2, config, return_plan=True)
    assert plan.reservation >= 1 and plan.comm_ctas < 17
    assert rel_err(out, fp64_rank_partial(p, 30)) < 1e-2


def test_a_partition_of_small_comm_ctas_reserves_one_sm_per_cta(monkeypatch):
    """The block scheduler spreads GatherRS's CTAs over the SMs, so a partition of small
    CTAs (a shared placement that does not fit, o_comm = 5) must reserve one SM per CTA:
    at C = G packed planning left GEMM2 no SM and GatherRS waited for it until its
    time-out on an H200. Now C = G is refused and every C leaves GEMM2 G - C SMs."""
    p, config = _planned_as_misfit(monkeypatch, o_comp=1, o_comm=5, sm_margin=4)
    with pytest.warns(RuntimeWarning, match="shared placement does not fit one SM"):
        out, plan = call(p, 30, 2, config, return_plan=True)
        for c in (1, 7, INTERPRET_SMS - 5):
            _, at_c = call(p, 30, 2, config, comm_ctas=c, return_plan=True)
            assert (at_c.reservation, at_c.compute_slots) == (c, INTERPRET_SMS - 4 - c)
        with pytest.raises(ValueError):
            call(p, 30, 2, config, comm_ctas=INTERPRET_SMS - 4)
    assert plan.compute_slots == INTERPRET_SMS - 4 - plan.reservation >= 1
    assert rel_err(out, fp64_rank_partial(p, 30)) < 1e-2


def test_placement_and_register_caps_are_validated():
    with pytest.raises(ValueError, match="placement must be one of"):
        dataclasses.replace(INTERPRET_TILES, placement="interleaved")
    for bad in (20, 250, 100, True):
        with pytest.raises(ValueError, match="multiple of 8 in"):
            dataclasses.replace(INTERPRET_TILES, comm_maxnreg=bad)
    assert GPU_TILES.placement == "shared" and PARTITION_TILES.placement == "partition"
    assert (GPU_TILES.comm_warps, PARTITION_TILES.comm_warps) == (4, 32)


@pytest.mark.parametrize("ep", [1, 2])
def test_token_major_y_gives_the_bits_of_gemm2_row_order(ep):
    """The default tiles store GEMM2's rows token-major where every token has its k rows
    here (ep=1); row order is the other layout (and ep=2's, tokens with rows elsewhere):
    the same sums for every C and L."""
    from megatron_overlap.ops.config import INTERPRET_TILES

    assert INTERPRET_TILES.token_major and not ROW_ORDER.tiles.token_major
    p = routed_problem(0, 1, tokens=40, experts=4, topk=3, ffn=16, hidden=48, ep=ep)
    base = call(p, 40, 3, ROW_ORDER, probs=True, comm_ctas=2, splits=2)
    assert rel_err(base, fp64_rank_partial(p, 40, with_probs=True)) < 1e-2
    launch = CPU_SESSION().prepare(p["x"], p["weight"], p["counts"], p["token_index"], 40, 3,
                               config=INTERP)
    assert (launch.routing.dest is not None) == (ep == 1)
    # token-major only where T = M k: y has no more rows than GEMM2 has
    assert launch.routing.dest is None or launch.table.numel() == p["x"].shape[0]
    for c, l in ((1, 1), (3, 4)):
        assert torch.equal(call(p, 40, 3, INTERP, probs=True, comm_ctas=c, splits=l), base)


def test_host_offsets_through_the_pinned_ring_equal_a_copy_for_more_calls_than_slots():
    """The routing-table kernel sums the counts it reads from the ring's slots into the
    device offsets; every call, past a full turn of the ring, gets its own counts'
    offsets, and the same output as the path that builds them on the host and copies."""
    from megatron_overlap.kernels import gemm2
    from megatron_overlap.ops.buffer import OverlapBuffer
    from megatron_overlap.ops.counts_ring import OFFSET_SLOTS

    buf = OverlapBuffer(None, torch.device("cpu"), "interpret")
    router = Router(torch.device("cpu"))
    problems = [routed_problem(s, 1, tokens=24, experts=3 + s % 3, topk=2, ffn=16, hidden=16)
                for s in range(OFFSET_SLOTS + 3)]
    for p in problems:
        counts = p["counts"].tolist()
        r = router.route(p["token_index"], counts, buf.error, 16, 24, 2)
        assert r.routed is None  # (CPU: no streams to fork)
        want_rows, want_tiles = gemm2.expert_offsets(p["counts"], 16)
        assert torch.equal(r.row_start, want_rows) and torch.equal(r.tile_start, want_tiles)
        assert r.counts_dev.tolist() == counts and r.row_tiles == int(want_tiles[-1])
        assert torch.equal(r.table, rt_combine(p["token_index"], 24, 2))
    mapped = [call(p, 24, 2, INTERP) for p in problems[:3]]
    CPU_SESSION().router.mapped_offsets = False
    try:
        copied = [call(p, 24, 2, INTERP) for p in problems[:3]]
    finally:
        CPU_SESSION().router.mapped_offsets = True
    assert all(torch.equal(a, b) for a, b in zip(mapped, copied))


def test_a_gpu_that_cannot_read_pinned_memory_in_place_falls_back_to_copies(monkeypatch):
    """Triton's launcher refuses a host pointer the device cannot map (before anything is
    queued): one warning, the copy path from then on, the same offsets and table; any
    other ValueError still propagates."""
    from megatron_overlap.kernels import gemm2
    from megatron_overlap.ops import routing as routing_module
    from megatron_overlap.ops.buffer import OverlapBuffer

    real = routing_module.route_rows

    def unmappable(*args, from_counts=None, **kw):
        if from_counts is not None:
            raise ValueError("Pointer argument cannot be accessed from Triton (cpu tensor?)")
        return real(*args, **kw)

    monkeypatch.setattr(routing_module, "route_rows", unmappable)
    buf = OverlapBuffer(None, torch.device("cpu"), "interpret")
    router = Router(torch.device("cpu"))
    p = routed_problem(1, 1, tokens=24, experts=4, topk=2, ffn=16, hidden=16)
    counts = p["counts"].tolist()
    with pytest.warns(RuntimeWarning, match="cannot read pinned host memory"):
        r = router.route(p["token_index"], counts, buf.error, 16, 24, 2)
    assert not router.mapped_offsets
    want_rows, want_tiles = gemm2.expert_offsets(p["counts"], 16)
    assert torch.equal(r.row_start, want_rows) and torch.equal(r.tile_start, want_tiles)
    assert torch.equal(r.table, rt_combine(p["token_index"], 24, 2))

    def other(*args, from_counts=None, **kw):
        raise ValueError("something else")

    monkeypatch.setattr(routing_module, "route_rows", other)
    router.mapped_offsets = True
    with pytest.raises(ValueError, match="something else"):
        router.route(p["token_index"], counts, buf.error, 16, 24, 2)


@pytest.mark.parametrize("probs", [False, True])
def test_the_ops_second_routing_pass_waits_for_the_launch_and_gives_the_same_bits(probs):
    """`prepare(defer_slots=True)` (the op's own): the table is left to the launch, which
    queues it on GatherRS's side before GatherRS, while GEMM2 places its token-major rows
    from the first pass's marks; the output equals that of a routing complete before the
    launch, bit for bit, with probabilities (GatherRS then reads the table) and without,
    and a second launch of the same routing rewrites the same table."""
    prepare = CPU_SESSION().prepare

    tokens, topk = 24, 2
    p = routed_problem(0, 1, tokens=tokens, experts=5, topk=topk, ffn=16, hidden=32)
    pr = p["probs"].to(p["x"].dtype) if probs else None
    args = (p["x"], p["weight"], p["counts"].tolist(), p["token_index"], tokens, topk, pr)
    outs = []
    for defer in (False, True):
        launch = prepare(*args, config=INTERP, defer_slots=defer)
        r = launch.routing
        assert (r.slots is not None) is defer and r.places is not None  # (TP: token-major)
        assert (r.places.dest is None) is defer  # (GEMM2 reads dest where it is complete)
        if defer:
            assert (r.table == -1).all()  # the first pass's fill only
        out = torch.full((tokens, 32), float("nan"), dtype=p["x"].dtype)
        for _ in range(2):
            launcher.launch(launch.buffer, p["x"], p["weight"], r, launch.launch_plan, pr, out)
            assert torch.equal(r.table, rt_combine(p["token_index"], tokens, topk))
        outs.append(out.clone())
    assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1])


def test_the_op_defers_the_second_routing_pass_only_where_gemm2_does_not_read_dest(tmp_path):
    """The op's choice (`prepare(defer_slots=None)`): a token-major y keeps the second
    pass before GEMM2, which reads its dest; row order defers it (GEMM2 reads nothing of
    it); both give the same bits."""
    import dataclasses

    from megatron_overlap.ops.config import INTERPRET_TILES
    prepare = CPU_SESSION().prepare

    tokens, topk = 24, 2
    p = routed_problem(0, 1, tokens=tokens, experts=5, topk=topk, ffn=16, hidden=32)
    args = (p["x"], p["weight"], p["counts"].tolist(), p["token_index"], tokens, topk)
    row_order = dataclasses.replace(INTERP, tiles=dataclasses.replace(
        INTERPRET_TILES, token_major=False))
    outs = []
    for config, deferred, reads_dest in ((INTERP, False, True), (row_order, True, False)):
        r = prepare(*args, config=config, defer_slots=None).routing
        assert (r.slots is not None) is deferred
        assert (r.places is not None and r.places.dest is r.dest) is reads_dest
        outs.append(gemm2_gather_rs(*args, None, None, config=config))
    assert not outs[0].isnan().any()
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


@pytest.mark.parametrize("helpers", [0, 5])
@pytest.mark.parametrize("reservation", [0, 7])
def test_the_deferred_second_pass_precedes_gatherrs_on_its_stream_or_the_fork(
        reservation, helpers, monkeypatch):
    """The CUDA stream order, recorded with stand-ins (the interpreter runs launches one
    after another): in the shared placement GEMM2 goes first and the second routing
    pass ahead of GatherRS on the side stream, with an event right after it that the
    tail helpers (on the caller's stream, behind GEMM2) wait for, as they read its
    table too; in the partition GatherRS must reach the GPU before GEMM2 spreads over
    its SMs, so the pass runs on the caller's stream before a fork of its own, which
    GatherRS's stream waits for and the helpers follow on the caller's stream."""
    import contextlib
    import types

    log = []

    class Ops:
        def record(self, event, stream="main"):
            log.append(("record", event, stream))

        def wait(self, event, stream="main"):
            log.append(("wait", event, stream))

    streams = types.SimpleNamespace(side="side", ops=Ops(), fork="fork", join="join",
                                    slotted="slotted")
    monkeypatch.setattr(launcher, "streams_of", lambda buf: streams)
    buf = types.SimpleNamespace(all_or_broken=contextlib.nullcontext)
    slots = types.SimpleNamespace(
        launch=lambda stream=None: log.append(("slots", stream or "main")))
    lp = types.SimpleNamespace(plan=types.SimpleNamespace(reservation=reservation),
                               helpers=helpers, tiles=None)
    comm = launcher._Comm.__new__(launcher._Comm)
    comm.args, comm.fork, comm.helpers, comm.trace, comm.slots = (), "routed", 0, None, slots

    def gather_rs(*a, stream=None, launch_helpers=False, **kw):
        log.append(("helpers" if launch_helpers else "gather_rs", stream or "main"))

    monkeypatch.setattr(launcher, "_launch_comm", gather_rs)
    launcher._overlapped(buf, lp, lambda: log.append(("gemm2", "main")), comm)
    if reservation:
        assert log[:5] == [("slots", "main"), ("record", "fork", "main"),
                           ("wait", "fork", "side"), ("gather_rs", "side"), ("gemm2", "main")]
        after = [("helpers", "main")] * bool(helpers)
    else:
        assert log[:5] == [("gemm2", "main"), ("wait", "routed", "side"), ("slots", "side"),
                           ("record", "slotted", "side"), ("gather_rs", "side")]
        after = [("wait", "slotted", "main"), ("helpers", "main")] * bool(helpers)
    assert log[5:] == after + [("record", "join", "side"), ("wait", "join", "main")]
    assert log.count(("slots", "main")) + log.count(("slots", "side")) == 1


def rt_combine(token_index, tokens, topk):
    from megatron_overlap.kernels.routing_table import combine_table

    return combine_table(token_index, tokens, topk)


def test_one_hot_expert_and_empty_experts_are_correct():
    for case in (dict(hot=True), dict(empty=(1, 2, 3))):
        p = routed_problem(0, 1, tokens=33, experts=5, topk=2, ffn=16, hidden=32, **case)
        assert rel_err(call(p, 33, 2, INTERP), fp64_rank_partial(p, 33)) < 1e-2


def test_a_strided_token_index_gives_the_bits_of_a_contiguous_one():
    """A column of an [T, 2] index tensor (as nonzero returns) is a strided view."""
    p = routed_problem(0, 1, tokens=33, experts=5, topk=2, ffn=16, hidden=32)
    pairs = torch.stack([torch.zeros_like(p["token_index"]), p["token_index"]], dim=1)
    strided = dict(p, token_index=pairs[:, 1])
    assert not strided["token_index"].is_contiguous()
    for config in (INTERP, REF):
        assert torch.equal(call(strided, 33, 2, config), call(p, 33, 2, config))


def test_no_rows_at_all_gives_zeros():
    p = routed_problem(0, 1, tokens=8, experts=2, topk=1, ffn=16, hidden=16)
    empty = dict(x=p["x"][:0], weight=p["weight"], counts=torch.zeros(2, dtype=torch.int64),
                 token_index=p["token_index"][:0], probs=p["probs"][:0])
    out = call(empty, 8, 1, INTERP)
    assert torch.equal(out, torch.zeros(8, 16, dtype=out.dtype))


def test_planner_decision_is_returned_and_explicit_c_wins():
    p = routed_problem(0, 1, tokens=40, experts=4, topk=2, ffn=16, hidden=32)
    _, plan = call(p, 40, 2, INTERP, return_plan=True)
    assert plan.source == "model" and plan.comm_ctas >= 1
    _, plan = call(p, 40, 2, INTERP, comm_ctas=5, return_plan=True)
    assert (plan.comm_ctas, plan.source) == (5, "user")
    _, plan = call(p, 40, 2, OverlapConfig(backend="interpret", planner=False), return_plan=True)
    assert (plan.comm_ctas, plan.source) == (3, "disabled")


@pytest.mark.parametrize("change,message", [
    (dict(x=lambda p: p["x"].half()), "share a dtype"),
    (dict(x=lambda p: p["x"][:, :-1]), "K="),
    (dict(counts=lambda p: p["counts"] + 1), "sums to"),
    (dict(counts=lambda p: p["counts"][:-1]), "one per local expert"),
    (dict(token_index=lambda p: p["token_index"] + 100), "must lie in"),
    (dict(token_index=lambda p: p["token_index"].float()), "int32 or int64"),
    (dict(x=lambda p: p["x"].to(torch.int32)), "share a dtype"),
    (dict(token_index=lambda p: p["token_index"].flip(0)), "permutation order"),
])
def test_bad_input_raises_a_clear_value_error(change, message):
    p = routed_problem(0, 1, tokens=30, experts=3, topk=2, ffn=16, hidden=32)
    for key, fn in change.items():
        p[key] = fn(p)
    with pytest.raises(ValueError, match=message):
        call(p, 30, 2, INTERP)


def test_device_counts_that_miss_the_rows_raise_at_the_check_and_the_buffer_stays_usable():
    """Counts the host never saw (a tensor handed to `route`, as the op does with CUDA
    counts) that do not sum to the rows: ValueError at the next check, naming the counts,
    not a broken buffer; the right counts then route as the host's do."""

    p = routed_problem(0, 1, tokens=30, experts=3, topk=2, ffn=16, hidden=32)
    buf = CPU_SESSION().buffer("interpret")
    router = CPU_SESSION().router
    for bad in (p["counts"] + 1, p["counts"] - 1):
        router.route(p["token_index"], bad, buf.error, 16, 30, 2)
        with pytest.raises(ValueError, match="does not sum to x's rows"):
            buf.note_launch(None, sync=True)
        assert buf.broken is None and int(buf.error) == 0
    dev = router.route(p["token_index"], p["counts"], buf.error, 16, 30, 2)
    host = router.route(p["token_index"], p["counts"].tolist(), buf.error, 16, 30, 2)
    buf.note_launch(None, sync=True)
    assert dev.row_tiles is None and host.row_tiles == int(dev.tile_start[-1])
    assert torch.equal(dev.table, host.table) and torch.equal(dev.counts_dev, host.counts_dev)
    assert torch.equal(dev.row_start, host.row_start)
    assert torch.equal(dev.tile_start, host.tile_start)


@pytest.mark.parametrize("config", [INTERP, REF], ids=["interpret", "reference"])
def test_padding_rows_past_the_counts_change_no_bit_of_the_output(config):
    """x, token_index a bound of the rows (Megatron's padded permutation under EP): the
    rows past the counts' sum hold garbage and token 0, and the output is the unpadded
    call's, bit for bit; device-like counts (a tensor handed to `route`) give the same
    table without an error; expected_rows is checked, and refused with gradients."""

    p = routed_problem(0, 2, tokens=30, experts=4, topk=2, ffn=16, hidden=32, ep=2)
    rows = p["x"].shape[0]
    want = call(p, 30, 2, config)
    pad = dict(p, x=torch.cat([p["x"], torch.randn(7, 16).to(p["x"].dtype) * 1e3]),
               token_index=torch.cat([p["token_index"], torch.zeros(7, dtype=torch.int64)]))
    got = call(pad, 30, 2, config, expected_rows=rows)
    assert torch.equal(got, want)
    buf = CPU_SESSION().buffer("interpret")
    router = CPU_SESSION().router
    table = router.route(pad["token_index"], p["counts"], buf.error, 16, 30, 2,
                         padded=True).table
    buf.note_launch(None, sync=True)  # (raises if the kernel flagged anything)
    assert torch.equal(table, router.route(p["token_index"], p["counts"].tolist(), buf.error,
                                           16, 30, 2).table)
    for bad in (-1, rows + 8):
        with pytest.raises(ValueError, match="expected_rows must lie in"):
            call(pad, 30, 2, config, expected_rows=bad)
    with pytest.raises(ValueError, match="sums to"):  # without it the padding is an error
        call(pad, 30, 2, config)
    x = pad["x"].clone().requires_grad_(True)
    with pytest.raises(ValueError, match="for inference"):
        gemm2_gather_rs(x, pad["weight"], p["counts"], pad["token_index"], 30, 2,
                        config=config, expected_rows=rows)


def test_counts_off_the_host_must_be_int32_or_int64():
    """Counts the kernel reads in place (any tensor off the host; "meta" stands in for a
    GPU here) must be one of the two integer types it loads."""
    from megatron_overlap.ops.validation import host_counts

    with pytest.raises(ValueError, match="int32 or int64"):
        host_counts(torch.zeros(3, dtype=torch.int16, device="meta"), 6, 3,
                    torch.device("meta"))
    for dtype in (torch.int32, torch.int64):
        counts, on_device = host_counts(torch.zeros(3, dtype=dtype, device="meta"), 6, 3,
                                        torch.device("meta"))
        assert counts is None and on_device.dtype == dtype


def test_bad_sizes_and_backends_raise_clear_errors():
    p = routed_problem(0, 1, tokens=30, experts=3, topk=2, ffn=16, hidden=32)
    with pytest.raises(ValueError, match="topk is 1"):
        call(p, 30, 1, INTERP)
    with pytest.raises(ValueError, match="splits"):
        call(p, 30, 2, INTERP, splits=33)
    with pytest.raises(ValueError, match="needs CUDA"):
        call(p, 30, 2, OverlapConfig(backend="triton"))
    with pytest.raises(ValueError, match="backend"):
        OverlapConfig(backend="cuda")
    with pytest.raises(ValueError, match="tail_helpers must be a bool"):
        OverlapConfig(tail_helpers=1)
    with pytest.raises(ValueError, match="tail_helpers must be a bool"):
        OverlapConfig(tail_helpers="yes")
    with pytest.raises(ValueError, match="gemm_impl must be one of"):
        dataclasses.replace(INTERPRET_TILES, gemm_impl="cutlass")
    with pytest.raises(ValueError, match="128 x"):  # the Gluon kernel's one tile shape
        dataclasses.replace(INTERPRET_TILES, gemm_impl="gluon")
    gluon = dataclasses.replace(GPU_TILES, gemm_impl="gluon")
    with pytest.raises(ValueError, match="Gluon kernel for bf16 on CUDA"):
        call(p, 30, 2, dataclasses.replace(INTERP, tiles=gluon))


def test_captures_that_could_not_replay_raise_a_clear_error(monkeypatch):
    """(Faked on CPU; the GPU tests capture for real.) A replay reruns the recorded kernels
    with the capture's arguments: host counts (a pinned slot the host rewrites), a
    backward that splits rows on the host and the reference backend would replay stale
    state, and a group's first call sets up peer memory collectively, so the op refuses
    first."""
    from megatron_overlap.ops.validation import capture_refusal

    p = routed_problem(0, 1, tokens=30, experts=3, topk=2, ffn=16, hidden=32)
    monkeypatch.setattr(op_module, "capturing", lambda t: True)
    for backend, why in (("interpret", "counts come from the host"),
                         ("reference", "reference backend")):
        with pytest.raises(RuntimeError, match=f"cannot be captured in a CUDA graph here: .*{why}"):
            call(p, 30, 2, OverlapConfig(backend=backend))
    x = p["x"].clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="with gradients"):
        gemm2_gather_rs(x, p["weight"], p["counts"], p["token_index"], 30, 2, config=INTERP)
    assert capture_refusal("triton", None) is None  # device counts (None on the host)
    assert "from the host" in capture_refusal("triton", [10, 20])
    assert "first call sets up peer memory" in groups_refusal()


def test_a_replays_errors_reach_the_host_at_note_replays_and_the_buffer_stays_usable():
    """A captured call queues nothing for the host (`note_launch(captured=True)`); the
    error word its kernels set in a replay is sticky, and `note_replays` raises it as the
    op's next call would (here: device counts that miss the rows, ERR_COUNTS)."""

    p = routed_problem(0, 1, tokens=30, experts=3, topk=2, ffn=16, hidden=32)
    buf = CPU_SESSION().buffer("interpret")
    buf.check()
    try:
        router = CPU_SESSION().router
        router.route(p["token_index"], p["counts"] + 1, buf.error, 16, 30, 2)  # a "replay"
        buf.note_launch(None, sync=False, captured=True)
        assert buf.captured and buf._pending is None
        with pytest.raises(ValueError, match="does not sum to x's rows"):
            CPU_SESSION().note_replays()
        assert buf.broken is None and int(buf.error) == 0
        router.route(p["token_index"], p["counts"], buf.error, 16, 30, 2)
        CPU_SESSION().note_replays()  # a clean replay raises nothing
        out = call(p, 30, 2, INTERP)  # and eager calls go on
        assert rel_err(out, fp64_rank_partial(p, 30)) < 1e-2
    finally:
        buf.captured = False


def test_auto_gemm_kernel_is_the_triton_one_off_cuda():
    """gemm_impl "auto" (the GPU default) resolves per device and dtype; on CPU tensors
    (the interpreter) it is the Triton kernel, and the op runs with it."""
    from megatron_overlap.kernels import gemm2

    x = torch.empty(4, 16, dtype=torch.bfloat16)
    assert GPU_TILES.gemm_impl == "auto" and INTERPRET_TILES.gemm_impl == "triton"
    assert gemm2.resolve_impl("auto", x.device, x.dtype, 128, 128, 4, True) == "triton"
    assert planning.resolved(GPU_TILES, x.device, x.dtype).gemm_impl == "triton"
    auto = dataclasses.replace(INTERPRET_TILES, gemm_impl="auto")
    p = routed_problem(0, 1, tokens=30, experts=3, topk=2, ffn=16, hidden=32)
    got = call(p, 30, 2, dataclasses.replace(INTERP, tiles=auto))
    assert rel_err(got, fp64_rank_partial(p, 30)) < 1e-2


def test_auto_takes_the_gluon_kernel_only_where_y_is_token_major(monkeypatch):
    """Where the Gluon GEMM2 runs (Hopper, bf16), "auto" takes it for a token-major y
    (TP) and keeps the Triton kernel for GEMM2's row order (EP), where it measured no
    faster; an explicit choice stays."""
    from megatron_overlap.kernels import gemm2

    monkeypatch.setattr(gemm2, "_gluon_runs_on", lambda device_index: True)
    planning.resolved.cache_clear()
    cuda, bf16 = torch.device("cuda", 0), torch.bfloat16  # (no tensor is made there)
    try:
        assert planning.resolved(GPU_TILES, cuda, bf16).gemm_impl == "gluon"
        rows = dataclasses.replace(GPU_TILES, token_major=False)
        assert planning.resolved(rows, cuda, bf16).gemm_impl == "triton"
        assert planning.resolved(GPU_TILES, cuda, torch.float16).gemm_impl == "triton"
        forced = dataclasses.replace(rows, gemm_impl="gluon")
        assert planning.resolved(forced, cuda, bf16).gemm_impl == "gluon"
        # the shared placement (GPU_TILES) gets the register caps of the kernel chosen
        caps = {impl: (t.gemm_maxnreg, t.comm_maxnreg) for impl, t in (
            ("gluon", planning.resolved(GPU_TILES, cuda, bf16)),
            ("triton", planning.resolved(rows, cuda, bf16)))}
        assert caps == {"gluon": (104, 96), "triton": (200, 96)}
        assert planning.resolved(PARTITION_TILES, cuda, bf16).gemm_maxnreg is None
    finally:
        planning.resolved.cache_clear()


def test_tiles_file_named_by_the_environment_gives_from_envs_tiles(tmp_path, monkeypatch):
    import json

    from megatron_overlap.ops import config

    def env_tiles():  # (the file is cached by path: each rewrite clears the cache)
        return config.OverlapConfig.from_env().tiles

    good = tmp_path / "tiles.json"
    good.write_text(json.dumps({"best": {"gemm": [64, 128, 64, 4, 3, False],
                                         "comm": [128, 512, 16, False]}}))
    monkeypatch.setenv("MEGATRON_OVERLAP_TILES", str(good))
    tiles = env_tiles()
    assert (tiles.block_m, tiles.comm_rows, tiles.comm_tn, tiles.comm_slot_loop) == (
        64, 128, 512, False)
    assert tiles.comm_stages == 1  # files from before the item pipeline: none
    assert not tiles.token_major  # the [TM, k, TN] gather reads y in GEMM2's row order
    good.write_text(json.dumps({"best": {"gemm": [64, 128, 64, 4, 3, False],
                                         "comm": [64, 1024, 32, True, 3]}}))
    config.load_tiles.cache_clear()
    tiles = env_tiles()
    assert (tiles.comm_rows, tiles.comm_warps, tiles.comm_slot_loop, tiles.comm_stages) == (
        64, 32, True, 3)
    assert tiles.token_major  # files from before the layout choice: the default layout
    good.write_text(json.dumps({"best": {"gemm": [64, 128, 64, 4, 3, False],
                                         "comm": [64, 1024, 32, True, 1, False]}}))
    config.load_tiles.cache_clear()
    assert not env_tiles().token_major
    assert env_tiles().gemm_impl == "auto"  # files before the Gluon kernel: the default
    good.write_text(json.dumps({"best": {"gemm": [128, 128, 64, 4, 3, False, "gluon"],
                                         "comm": [256, 1024, 32, True, 1, True]}}))
    config.load_tiles.cache_clear()
    assert env_tiles().gemm_impl == "gluon"
    assert env_tiles().placement == "partition"  # files before the shared placement
    good.write_text(json.dumps({"best": {"gemm": [128, 128, 64, 4, 3, False, "auto"],
                                         "comm": [32, 512, 4, True, 1, True],
                                         "placement": "shared"}}))
    config.load_tiles.cache_clear()
    assert (env_tiles().placement, env_tiles().comm_warps) == ("shared", 4)
    for bad, text in (("missing.json", None), ("broken.json", "{"),
                      ("wrong.json", json.dumps({"best": {"gemm": [1, 2]}}))):
        path = tmp_path / bad
        if text is not None:
            path.write_text(text)
        monkeypatch.setenv("MEGATRON_OVERLAP_TILES", str(path))
        with pytest.raises(ValueError,
                           match=f"MEGATRON_OVERLAP_TILES=.*{bad}: not a tune_tiles result"):
            env_tiles()


def test_peerless_group_falls_back_to_reference_with_one_warning(monkeypatch):
    """A session whose group spans hosts (peer memory cannot reach every rank) says so
    once, when it is built, and runs every call on the reference path."""
    from megatron_overlap.ops import OverlapSession, session as session_module

    monkeypatch.setattr(session_module, "hosts_agree", lambda group, world: False)
    p = routed_problem(0, 1, tokens=20, experts=2, topk=1, ffn=16, hidden=16)
    with pytest.warns(UserWarning, match="reference path"):
        session = OverlapSession(None, "cpu", INTERP)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, plan = session(p["x"], p["weight"], p["counts"], p["token_index"], 20, 1,
                            return_plan=True)
        session(p["x"], p["weight"], p["counts"], p["token_index"], 20, 1)
    assert plan is None and rel_err(out, fp64_rank_partial(p, 20)) < 1e-2
    assert not session.buffers()  # (nothing of peer memory was made)


def test_missing_producer_raises_timeout_naming_split_and_rank(monkeypatch):
    from megatron_overlap.kernels import gemm2

    p = routed_problem(0, 1, tokens=20, experts=2, topk=1, ffn=16, hidden=32)
    group_cfg = OverlapConfig(backend="interpret", max_spins=50)
    monkeypatch.setattr(gemm2, "launch_grouped_gemm2", lambda *a, **k: None)
    with pytest.raises(OverlapTimeoutError, match=r"rank 0 timed out waiting for split 0"):
        call(p, 20, 1, group_cfg, splits=2)
    monkeypatch.undo()
    _refused_until_reset(p, group_cfg, "rebuilt")


def _refused_until_reset(p, config, message):
    """A broken buffer refuses calls with `message` until reset, then computes again."""

    with pytest.raises(OverlapTimeoutError, match=message):
        call(p, 20, 1, config)
    CPU_SESSION().buffer("interpret").reset()
    assert rel_err(call(p, 20, 1, config), fp64_rank_partial(p, 20)) < 1e-2


def test_a_launch_failing_after_gatherrs_started_breaks_the_buffer_until_reset(monkeypatch):
    """The tail helpers' launch failing leaves done/ready mid-call: the next call must
    not read them as its own (it raises until every rank resets the buffer)."""
    from megatron_overlap.kernels import gather_rs as grs

    p = routed_problem(0, 1, tokens=20, experts=2, topk=1, ffn=16, hidden=32)
    real = grs.launch_gather_rs

    def helpers_fail(*args, launch_helpers=False, **kwargs):
        if launch_helpers:
            raise RuntimeError("no launch")
        return real(*args, **kwargs)

    monkeypatch.setattr(grs, "launch_gather_rs", helpers_fail)
    with pytest.raises(RuntimeError, match="no launch"):
        call(p, 20, 1, INTERP, comm_ctas=2)
    monkeypatch.undo()
    _refused_until_reset(p, INTERP, "launch failed after another launch of the call had started")


def _grads(p, tokens, topk, config, probs, group=None, seed=0):
    leaves = {k: p[k].detach().clone().requires_grad_(True) for k in ("x", "weight", "probs")}
    q = dict(p, **leaves)
    out = call(q, tokens, topk, config, probs=probs, group=group)
    g = torch.Generator().manual_seed(seed + 7)
    grad = torch.randn(out.shape, generator=g).to(out.dtype)
    out.backward(grad)
    return {k: leaves[k].grad for k in (("x", "weight", "probs") if probs else ("x", "weight"))}


def test_backward_matches_reference_gradients():
    p = routed_problem(0, 1, tokens=24, experts=3, topk=2, ffn=16, hidden=32,
                       dtype=torch.float32)
    for probs in (False, True):
        a = _grads(p, 24, 2, INTERP, probs)
        b = _grads(p, 24, 2, REF, probs)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------- two ranks (gloo)
def _two_rank_scenarios(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD
    results = {}
    cases = {
        "tp2_bf16": dict(tokens=44, experts=4, topk=2, ffn=16, hidden=48, ep=1),
        "ep2_uneven": dict(tokens=50, experts=6, topk=3, ffn=16, hidden=40, ep=2, empty=(4,)),
        "ep2_hot": dict(tokens=36, experts=4, topk=2, ffn=16, hidden=32, ep=2, hot=True),
        "tp2_fp32": dict(tokens=30, experts=3, topk=2, ffn=16, hidden=32, ep=1,
                         dtype=torch.float32),
    }
    for name, case in cases.items():
        tokens, topk = case["tokens"], case["topk"]
        p = routed_problem(rank, world, seed=3, **case)
        partial = fp64_rank_partial(p, tokens, with_probs=True)
        full = partial.clone()
        dist.all_reduce(full)
        mine = full[rank * tokens // world:(rank + 1) * tokens // world]
        outs = {}
        for c, l in ((1, 1), (2, 2), (3, 4), (8, 1), (16, 2)):
            outs[(c, l)] = call(p, tokens, topk, INTERP, probs=True, group=group,
                                comm_ctas=c, splits=l)
        # the last split left to the C communication programs alone (no tail helpers)
        outs["no helpers"] = call(p, tokens, topk, NO_HELPERS, probs=True, group=group,
                                  comm_ctas=3, splits=4)
        outs["row order"] = call(p, tokens, topk, ROW_ORDER, probs=True, group=group,
                                 comm_ctas=2, splits=2)
        outs["shared"] = call(p, tokens, topk, SHARED, probs=True, group=group)
        outs["shared C=3"] = call(p, tokens, topk, SHARED, probs=True, group=group,
                                  comm_ctas=3, splits=4)
        ref = call(p, tokens, topk, REF, probs=True, group=group)
        first = outs[(1, 1)]
        results[name] = dict(
            err=rel_err(first, mine), ref_err=rel_err(ref, mine),
            bitwise=all(torch.equal(o, first) for o in outs.values()),
            shape=tuple(first.shape))
    # one buffer, models alternating (hidden 48 / 40 / 64): the slot geometry changes
    # every call, the allocation grows once and is reused
    alternating = []
    for case in [cases["tp2_bf16"], cases["ep2_uneven"]] * 2 + [dict(cases["tp2_bf16"], hidden=64)]:
        p = routed_problem(rank, world, seed=4, **case)
        partial = fp64_rank_partial(p, case["tokens"], with_probs=True)
        dist.all_reduce(partial)
        mine = partial.chunk(world)[rank]
        alternating.append(rel_err(call(p, case["tokens"], case["topk"], INTERP, probs=True,
                                        group=group, comm_ctas=2), mine))
    results["alternating"] = alternating
    # gradients through the all-gather of the backward
    p = routed_problem(rank, world, tokens=20, experts=4, topk=2, ffn=16, hidden=32, ep=2,
                       dtype=torch.float32, seed=5)
    a = _grads(p, 20, 2, INTERP, True, group, seed=rank)
    b = _grads(p, 20, 2, REF, True, group, seed=rank)
    results["grad_err"] = max(float((a[k] - b[k]).abs().max()) for k in a)
    # not divisible by the world size: a clear error on every rank
    try:
        call(p, 21, 2, INTERP, group=group)
        results["indivisible"] = "no error"
    except ValueError as err:
        results["indivisible"] = str(err)
    # a peer that never arrives: rank 0 times out at the barrier naming rank 1
    if rank == 0:
        try:
            call(p, 20, 2, OverlapConfig(backend="interpret", max_spins=200), group=group)
            results["barrier"] = "no error"
        except OverlapTimeoutError as err:
            results["barrier"] = str(err)
    dist.barrier()
    return results


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(2, _two_rank_scenarios)


@pytest.mark.parametrize("case", ["tp2_bf16", "ep2_uneven", "ep2_hot", "tp2_fp32"])
def test_two_ranks_match_fp64_and_are_bitwise_stable_over_c_and_l(two_ranks, case):
    for rank, res in enumerate(two_ranks):
        r = res[case]
        tol = 1e-5 if case.endswith("fp32") else 1e-2
        assert r["err"] < tol and r["ref_err"] < tol, (rank, r)
        assert r["bitwise"], (rank, r)


# ---------------------------------------------------------------- four ranks (gloo)
def _four_rank_scenarios(rank, world):
    """TP2EP2 (two ranks per expert group, the rows in row order) and EP4: each rank's
    output against fp64, and the calls over C, L, the placement and the tail helpers
    that differ from the first (how many elements)."""
    import torch.distributed as dist

    group = dist.group.WORLD
    results = {}
    for name, ep in (("tp2ep2", 2), ("ep4", 4)):
        case = dict(tokens=48, experts=8, topk=2, ffn=16, hidden=48, ep=ep)
        p = routed_problem(rank, world, seed=11, **case)
        full = fp64_rank_partial(p, 48, with_probs=True)
        dist.all_reduce(full)
        outs = [call(p, 48, 2, INTERP, probs=True, group=group, comm_ctas=c, splits=l)
                for c, l in ((1, 1), (3, 2), (8, 4), (16, 2))]
        outs += [call(p, 48, 2, config, probs=True, group=group, comm_ctas=3, splits=2)
                 for config in (SHARED, NO_HELPERS)]
        results[name] = dict(err=rel_err(outs[0], full.chunk(world)[rank]),
                             differing={i: int((o != outs[0]).sum())
                                        for i, o in enumerate(outs)
                                        if not torch.equal(o, outs[0])})
    dist.barrier()
    return results


def test_four_ranks_tp2ep2_and_ep4_match_fp64_with_the_same_bits_for_every_choice():
    """The protocol with four ranks (each rank's partials pushed to three peers, the
    barrier over four, the final sum of four slots), in a layout the two-rank tests do
    not have: TP2EP2, and EP4."""
    for rank, res in enumerate(run_ranks(4, _four_rank_scenarios)):
        for name, r in res.items():
            assert r["err"] < 1e-2 and not r["differing"], (rank, name, r)


def test_one_buffer_serves_alternating_hidden_sizes(two_ranks):
    for rank, res in enumerate(two_ranks):
        assert all(e < 1e-2 for e in res["alternating"]), (rank, res["alternating"])


def test_two_ranks_backward_matches_reference(two_ranks):
    assert all(r["grad_err"] < 1e-4 for r in two_ranks)


def test_tokens_not_divisible_by_world_size_raise(two_ranks):
    assert all("multiple of the group size" in r["indivisible"] for r in two_ranks)


def test_absent_peer_raises_barrier_timeout_naming_the_peer(two_ranks):
    assert "rank 0 timed out at the cross-rank barrier waiting for rank 1" in two_ranks[0]["barrier"]


@pytest.mark.parametrize("helpers", [True, False])
def test_planner_sees_the_tail_helpers_and_the_rows_per_token_this_rank_holds(helpers):
    from megatron_overlap.planner import Workload, plan

    # rank 0 of two EP ranks: about half of each token's k = 4 rows live here
    p = routed_problem(0, 2, tokens=64, experts=8, topk=4, ffn=16, hidden=32, ep=2)
    config = OverlapConfig(backend="interpret", preset="h200", tail_helpers=helpers, splits=2)
    launch = CPU_SESSION().prepare(p["x"], p["weight"], p["counts"], p["token_index"], 64, 4,
                               config=config)
    cache = launch.launch_plan.cache
    assert cache.kernel.tail_helpers is helpers
    local = round(4 * p["x"].shape[0] / 64) / 4
    assert 1.5 <= local <= 2.5
    want = plan(Workload(64, 32, 16, 1, 2, p["counts"].tolist(), topk=4, local_topk=local),
                cache.kernel, cache.device, cache.calib)
    assert (launch.plan.comm_ctas, launch.plan.predicted) == (want.comm_ctas, want.predicted)
    all_rows = plan(Workload(64, 32, 16, 1, 2, p["counts"].tolist(), topk=4),
                    cache.kernel, cache.device, cache.calib)
    assert all_rows.predicted != want.predicted  # the term is live with this calibration


def test_splits_ranked_without_the_helper_terms_and_c_from_the_full_model(tmp_path):
    import dataclasses
    import json

    from megatron_overlap.planner import KernelSpec, Workload, get_preset, plan

    p = routed_problem(0, 1, tokens=128, experts=8, topk=4, ffn=32, hidden=64)
    # the H200's calibration without the splits' roofline (tests/test_roofline.py): the
    # wave model alone ranks L here
    h200 = get_preset("h200")
    waves_only = dataclasses.replace(h200, calibration=dataclasses.replace(
        h200.calibration, hbm_balance=None))
    path = tmp_path / "h200_waves.json"
    path.write_text(json.dumps(waves_only.to_json()))
    config = OverlapConfig(backend="interpret", preset=str(path))
    launch = CPU_SESSION().prepare(p["x"], p["weight"], p["counts"], p["token_index"], 128, 4,
                               config=config)
    full = launch.launch_plan.cache
    t = launch.launch_plan.tiles

    def decide(splits, helpers):
        kernel = KernelSpec(t.block_m, t.block_n, *t.comm_shape(4, -(-64 // splits)),
                            full.kernel.o_comp, full.kernel.o_comm, helpers)
        calib = full.calib if helpers else dataclasses.replace(full.calib, overlap_factor=None)
        w = Workload(128, 64, 32, 1, splits, p["counts"].tolist(), topk=4, local_topk=4.0)
        return plan(w, kernel, full.device, calib)

    ranked = min((1, 2), key=lambda s: (decide(s, False).predicted, s))
    full_ranked = min((1, 2), key=lambda s: (decide(s, True).predicted, s))
    assert ranked != full_ranked  # the two models disagree on this workload
    assert launch.plan.splits == ranked
    assert launch.plan.comm_ctas == decide(ranked, True).comm_ctas


def test_config_placement_picks_the_default_tiles_of_that_placement():
    """OverlapConfig.placement (Megatron's --moe-overlap-placement, also
    MEGATRON_OVERLAP_PLACEMENT through OverlapConfig.from_env) chooses the placement of
    the default tiles: on CUDA the tuned tiles of each (GPU_TILES, PARTITION_TILES),
    under the interpreter its tiles."""
    from megatron_overlap.ops.planning import default_tiles

    assert default_tiles("triton") is GPU_TILES
    assert default_tiles("triton", "partition") is PARTITION_TILES
    assert default_tiles("triton", "shared") is GPU_TILES
    assert default_tiles("interpret", "shared") == dataclasses.replace(INTERPRET_TILES,
                                                                       placement="shared")
    with pytest.raises(ValueError, match="placement must be one of"):
        OverlapConfig(placement="interleaved")
    p = routed_problem(0, 1, tokens=30, experts=3, topk=2, ffn=16, hidden=32)
    _, plan = call(p, 30, 2, OverlapConfig(backend="interpret", placement="shared"),
                   return_plan=True)
    assert plan.reservation == 0


def test_the_planned_splits_are_the_least_of_the_models_predictions_it_reports():
    p = routed_problem(0, 1, tokens=40, experts=4, topk=2, ffn=16, hidden=64)
    launch = CPU_SESSION().prepare(p["x"], p["weight"], p["counts"], p["token_index"], 40, 2,
                               config=INTERP)
    lp = launch.launch_plan
    assert lp.request is not None
    predicted = CPU_SESSION().split_predictions(lp.request, (1, 2, 4, 8))
    assert set(predicted) == {1, 2, 4, 8} and all(t > 0 for t in predicted.values())
    ranked = {l: predicted[l] for l in planning.split_candidates(64)}
    assert planning.split_candidates(64) == (1, 2)  # up to 2 x max(1, N // 1024)
    assert lp.splits == min(ranked, key=lambda l: (ranked[l], l))
    # past N there is no such split, and the model is not asked
    assert set(CPU_SESSION().split_predictions(lp.request, (1, 128))) == {1}
