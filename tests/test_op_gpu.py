"""The operator on real GPUs (device machine): `pytest -m gpu tests/test_op_gpu.py`."""

import os

import pytest
import torch

from megatron_overlap.ops import default_session, note_replays

from dist_harness import run_ranks
from megatron_overlap.ops import OverlapConfig, OverlapTimeoutError, gemm2_gather_rs
from routing_cases import rel_err, routed_problem

pytestmark = pytest.mark.gpu
TRITON = OverlapConfig(backend="triton", sync_errors=True)
SHAPE = dict(tokens=4096, experts=60, topk=4, ffn=704, hidden=2048)


def _fp32_partial(p, tokens):
    """This rank's [M, N] contribution, fp32 on the GPU from the same bf16 inputs."""
    x, w = p["x"].float(), p["weight"].float()
    ys, start = [], 0
    for e, n in enumerate(p["counts"].tolist()):
        ys.append(x[start:start + n] @ w[e].t())
        start += n
    y = torch.cat(ys)
    full = torch.zeros(tokens, w.shape[1], dtype=torch.float32, device=x.device)
    return full.index_add_(0, p["token_index"], y)


def _poisoned_call(p, tokens, topk, group=None, **kw):
    out = gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"], tokens, topk,
                          None, group, config=TRITON, **kw)
    return out


def test_single_gpu_matches_fp32_and_is_bitwise_stable_over_c_and_l():
    p = routed_problem(0, 1, device="cuda", **SHAPE)
    ref = _fp32_partial(p, SHAPE["tokens"]).double().cpu()
    outs = {}
    for c in (1, 2, 3, 8, 16):
        for l in (1, 2, 4):
            outs[(c, l)] = _poisoned_call(p, SHAPE["tokens"], SHAPE["topk"], comm_ctas=c, splits=l)
    first = outs[(1, 1)]
    assert not torch.isnan(first).any()
    assert rel_err(first, ref) < 1e-2
    assert all(torch.equal(o, first) for o in outs.values())


@pytest.mark.parametrize("topk", [4, 6])
def test_pipelined_gather_gives_the_same_bits_for_every_depth_and_item_shape(topk):
    """GatherRS's item loop pipelined by cp.async (comm_stages > 1) adds the same slots in
    the same order as the plain loop, with and without tail helpers; top-6 also masks
    the two padding slots of 8."""
    import dataclasses

    from megatron_overlap.ops.config import PARTITION_TILES as GPU_TILES  # (32-warp CTAs)

    shape = dict(SHAPE, topk=topk, tokens=3000)  # 3000: a ragged last item
    p = routed_problem(0, 1, device="cuda", seed=1, **shape)
    ref = _fp32_partial(p, shape["tokens"]).double().cpu()
    outs = [gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"],
                            shape["tokens"], topk, None, comm_ctas=8, splits=4,
                            config=dataclasses.replace(TRITON, tail_helpers=False))]
    for rows, tn, stages in ((256, 1024, 1), (64, 1024, 2), (64, 512, 4), (32, 1024, 4),
                             (32, 1024, 9)):  # 9: more than fits, lowered to what does
        tiles = dataclasses.replace(GPU_TILES, comm_rows=rows, comm_tn=tn, comm_stages=stages)
        cfg = dataclasses.replace(TRITON, tiles=tiles)
        for c, l in ((3, 1), (16, 4)):
            outs.append(gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"],
                                        shape["tokens"], topk, None, comm_ctas=c, splits=l,
                                        config=cfg))
    assert not torch.isnan(outs[0]).any()
    assert rel_err(outs[0], ref) < 1e-2
    assert all(torch.equal(o, outs[0]) for o in outs)


def _over_c_l_and_helpers(p, tokens, tiles_list):
    """The op's top-4 output for each tiles config, with and without tail helpers, at
    three (C, L) points."""
    import dataclasses

    outs = []
    for tiles in tiles_list:
        for helpers in (True, False):
            cfg = dataclasses.replace(TRITON, tiles=tiles, tail_helpers=helpers)
            for c, l in ((3, 1), (16, 4), (40, 2)):
                outs.append(gemm2_gather_rs(p["x"], p["weight"], p["counts"],
                                            p["token_index"], tokens, 4, None,
                                            comm_ctas=c, splits=l, config=cfg))
    return outs


def _ragged_case(seed, ep, tiles):
    """A top-4 problem with a ragged last item, its fp32 reference, and the op's output
    with `tiles` at C = 8, L = 4: what the variants of a test must equal bit for bit."""
    import dataclasses

    shape = dict(SHAPE, tokens=3000)
    p = routed_problem(0, 1, device="cuda", seed=seed, ep=ep, **shape)
    ref = _fp32_partial(p, shape["tokens"]).double().cpu()
    base = gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"],
                           shape["tokens"], 4, None, comm_ctas=8, splits=4,
                           config=dataclasses.replace(TRITON, tiles=tiles))
    return shape, p, ref, base


@pytest.mark.parametrize("ep", [1, 2])
def test_token_major_y_gives_the_bits_of_gemm2_row_order(ep):
    """GEMM2 scattering its rows to (token, slot) order and GatherRS computing their
    addresses (ep=1: every token has its k rows here) sum the same slots in the same
    order as the row-order path, for every C, L, item pipeline and with and without tail
    helpers; ep=2 (tokens with rows elsewhere) keeps the row order with the same tiles."""
    import dataclasses

    from megatron_overlap.ops.config import PARTITION_TILES as GPU_TILES  # (32-warp CTAs)

    R = dataclasses.replace
    shape, p, ref, base = _ragged_case(2, ep, R(GPU_TILES, token_major=False))
    token_major = (GPU_TILES, R(GPU_TILES, comm_rows=128, comm_stages=2))
    assert all(t.token_major for t in token_major)
    outs = _over_c_l_and_helpers(p, shape["tokens"], token_major)
    assert not torch.isnan(base).any()
    assert rel_err(base, ref) < 1e-2
    assert all(torch.equal(o, base) for o in outs)


@pytest.mark.parametrize("ep", [1, 2])
def test_gluon_gemm2_gives_the_ops_bits_for_every_c_l_and_helper_setting(ep):
    """The op with the warp-specialized Gluon GEMM2 (TileConfig.gemm_impl) against the op
    with the Triton GEMM2: token-major (ep=1) and row order (ep=2), over C, L, tails."""
    import dataclasses

    from megatron_overlap.ops.config import PARTITION_TILES as GPU_TILES  # (32-warp CTAs)

    R = dataclasses.replace
    shape, p, ref, base = _ragged_case(3, ep, R(GPU_TILES, gemm_impl="triton"))
    outs = _over_c_l_and_helpers(p, shape["tokens"], [
        R(GPU_TILES, gemm_impl=impl) for impl in ("auto", "gluon", "gluon_inline_publish")])
    assert not torch.isnan(base).any()
    assert rel_err(base, ref) < 1e-2
    assert all(torch.equal(o, base) for o in outs)


@pytest.mark.parametrize("ep", [1, 2])
def test_shared_placement_gives_the_partitions_bits_with_a_comm_cta_on_every_sm(ep):
    """One 4-warp GatherRS CTA beside GEMM2's on every SM (the default, GPU_TILES): the
    compiled kernels fit one SM together (no fall-back warning), the planner takes every
    SM, and the output has the partition's bits for every C, L and tail setting, with
    the default GEMM2 (Gluon under TP) and the Triton one."""
    import dataclasses
    import warnings

    from megatron_overlap.ops.config import GPU_TILES, PARTITION_TILES

    R = dataclasses.replace
    shape, p, ref, base = _ragged_case(4, ep, PARTITION_TILES)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the placement must fit
        out, plan = gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"],
                                    shape["tokens"], 4, None, config=TRITON, return_plan=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert (plan.comm_ctas, plan.reservation) == (sms, 0)
    outs = [out] + _over_c_l_and_helpers(p, shape["tokens"], [
        GPU_TILES, R(GPU_TILES, gemm_impl="triton"), R(GPU_TILES, comm_rows=16, comm_tn=1024)])
    for c in (1, sms // 2, sms):
        outs.append(gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"],
                                    shape["tokens"], 4, None, comm_ctas=c, config=TRITON))
    assert not torch.isnan(base).any()
    assert rel_err(base, ref) < 1e-2
    assert all(torch.equal(o, base) for o in outs)


def test_cached_binary_launches_give_the_bits_of_tritons_own_launches(monkeypatch):
    p = routed_problem(0, 1, device="cuda", **SHAPE)
    fast = [_poisoned_call(p, SHAPE["tokens"], SHAPE["topk"], comm_ctas=8) for _ in range(3)]
    from megatron_overlap.kernels.launch_cache import LaunchCache

    monkeypatch.setattr(LaunchCache, "fast", False)  # every launch through kernel[grid]
    jit = _poisoned_call(p, SHAPE["tokens"], SHAPE["topk"], comm_ctas=8)
    assert not torch.isnan(jit).any()
    assert all(torch.equal(f, jit) for f in fast)


@pytest.mark.parametrize("slots,mapped,driver", [(16, True, True), (2, True, True),
                                                 (16, False, True), (16, True, False)])
def test_calls_queued_far_ahead_of_the_gpu_give_each_routings_own_output(
        slots, mapped, driver, monkeypatch):
    """Host counts of six routings (one hot, one with empty experts) are uploaded while
    the GPU is still busy, with no sync between the calls (every pinned slot, flag and
    buffer of one call must stay that call's until it runs): every output equals that
    routing's synchronized one. With two offset slots the ring wraps while the GPU is
    busy (the host must wait for a slot's reader); unmapped, each call copies them. The
    streams are ordered by the driver's event calls, or by torch's (`driver` False)."""
    from megatron_overlap.ops import counts_ring
    from megatron_overlap.ops.stream_ops import StreamOps

    from megatron_overlap.ops.routing import Router

    from megatron_overlap.ops import session as session_module

    # a fresh default session: its buffer, router (with this ring) and streams (`driver`)
    monkeypatch.setattr(session_module, "_default_sessions", {})
    monkeypatch.setattr(counts_ring, "OFFSET_SLOTS", slots)
    monkeypatch.setattr(Router, "mapped_offsets", mapped)
    monkeypatch.setattr(StreamOps, "driver", driver)  # (read when the buffer makes its own)
    small = dict(tokens=1024, experts=16, topk=4, ffn=256, hidden=512)
    probs = [routed_problem(0, 1, device="cuda", seed=s, hot=s == 2, empty=(3, 5) if s == 4
                            else (), **small) for s in range(6)]
    want = [_poisoned_call(p, small["tokens"], small["topk"]) for p in probs]
    lazy = OverlapConfig(backend="triton")  # errors checked at the next call, no sync
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: the host runs ahead of it
    got = [gemm2_gather_rs(p["x"], p["weight"], p["counts"].tolist(), p["token_index"],
                           small["tokens"], small["topk"], None, config=lazy) for p in probs]
    torch.cuda.synchronize()
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_counts_on_the_device_give_the_host_counts_bits_and_wrong_ones_raise():
    """CUDA counts (int64 and int32), read in place by the routing-table kernel, with no
    host sync: the host counts' bits (the planner's estimate picks C and L, which do not
    change the bits); counts that miss the rows raise ValueError, and the next call works."""
    p = routed_problem(0, 1, device="cuda", hot=True, **SHAPE)
    want = _poisoned_call(p, SHAPE["tokens"], SHAPE["topk"])
    dev = p["counts"].cuda()
    lazy = OverlapConfig(backend="triton")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing torch call raises
    try:
        got = [gemm2_gather_rs(p["x"], p["weight"], c, p["token_index"], SHAPE["tokens"],
                               SHAPE["topk"], config=lazy) for c in (dev, dev.int())]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(g, want) for g in got)
    with pytest.raises(ValueError, match="does not sum to x's rows"):
        gemm2_gather_rs(p["x"], p["weight"], dev + 1, p["token_index"], SHAPE["tokens"],
                        SHAPE["topk"], config=TRITON)
    assert torch.equal(_poisoned_call(p, SHAPE["tokens"], SHAPE["topk"]), want)


def test_capturing_the_op_in_a_cuda_graph_raises_before_queuing_anything():
    p = routed_problem(0, 1, device="cuda", tokens=512, experts=4, topk=2, ffn=128, hidden=256)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        with torch.cuda.stream(stream), torch.cuda.graph(graph):
            gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"], 512, 2,
                            config=TRITON)
    out = gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"], 512, 2,
                          config=TRITON)  # and the op works after it
    assert rel_err(out, _fp32_partial(p, 512).double().cpu()) < 1e-2


def test_warm_up_compiles_the_binaries_and_calls_then_plan_and_capture_without_compiling(
        monkeypatch):
    """On CUDA warm_up compiles the families (residency read from the binaries); calls of
    the shape then plan with the compile hook refusing. A capture at an L warm_up did not
    cover raises before queuing anything; warmed up at that L, it captures and replays
    the eager bits."""
    from megatron_overlap.ops import OverlapSession, plans
    from megatron_overlap.ops.capture import CapturedCall

    session = OverlapSession(None, "cuda", TRITON)
    p = routed_problem(0, 1, device="cuda", tokens=512, experts=4, topk=2, ffn=128, hidden=256)
    families = session.warm_up(256, 2, torch.bfloat16, token_major=True)
    assert families and all(f.resources["gemm2"]["registers"] > 0 for f in families)
    real = plans._occupancies

    def refuse(key):
        raise AssertionError(f"compiled {key} while planning")
    monkeypatch.setattr(plans, "_occupancies", refuse)
    counts = p["counts"].cuda()

    def op(**kw):
        return lambda: session(p["x"], p["weight"], counts, p["token_index"], 512, 2, **kw)
    with torch.no_grad():
        want = op()()
        assert rel_err(want, _fp32_partial(p, 512).double().cpu()) < 1e-2
        assert session.families.at_call == []
        unwarmed = 4  # (N = 256: the planner ranks L = 1, 2; at L = 4 TNc is 64)
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with pytest.raises(RuntimeError, match="is not compiled; call OverlapSession.warm_up"):
            with torch.cuda.stream(stream), torch.cuda.graph(graph):
                op(splits=unwarmed)()
        monkeypatch.setattr(plans, "_occupancies", real)
        session.warm_up(256, 2, torch.bfloat16, splits=unwarmed, token_major=True)
        monkeypatch.setattr(plans, "_occupancies", refuse)
        call = CapturedCall(op(splits=unwarmed), torch.device("cuda"))
        assert call.summary() == dict(captured=True, equal=True, all_written=True,
                                      max_rel_diff=0.0)
        assert torch.equal(op()(), want) and session.families.at_call == []
        call.release()


def test_captured_call_replays_the_eager_bits_and_reports_a_refused_capture():
    """What the benchmarks time as "graph": the op captured on CUDA counts replays the eager
    call's bits into every element; on host counts the op refuses the capture and the
    refusal is the result (nothing to replay), not a crash."""
    from megatron_overlap.ops.capture import CapturedCall

    p = routed_problem(0, 1, device="cuda", tokens=512, experts=4, topk=2, ffn=128, hidden=256)
    counts = p["counts"].cuda()

    def op(c):
        return lambda: gemm2_gather_rs(p["x"], p["weight"], c, p["token_index"], 512, 2,
                                       config=TRITON)

    with torch.no_grad():
        want = op(counts)()
        call = CapturedCall(op(counts), torch.device("cuda"))
        assert call.summary() == dict(captured=True, equal=True, all_written=True,
                                      max_rel_diff=0.0)
        call.out.fill_(float("nan"))
        call.replay()
        torch.cuda.synchronize()
        assert torch.equal(call.out, want)
        call.release()
        refused = CapturedCall(op(p["counts"]), torch.device("cuda"))
        assert refused.graph is None and "from the host" in refused.summary()["error"]
        assert torch.equal(op(counts)(), want)  # and the op works after it


def test_the_second_routing_pass_on_gathers_stream_precedes_gatherrs_reading_the_table():
    """With probabilities GatherRS reads the table, which the op's second routing pass
    writes on GatherRS's stream once GEMM2 has started: the op equals the launch of a
    routing completed before it, bit for bit, over calls queued back to back (the host
    far ahead of the GPU) and replayed from a CUDA graph."""
    from megatron_overlap.ops import launcher
    from megatron_overlap.ops.capture import CapturedCall
    from megatron_overlap.ops import default_session

    prepare = default_session().prepare
    tokens, topk, hidden = 2048, 4, 512
    p = routed_problem(0, 1, device="cuda", tokens=tokens, experts=40, topk=topk, ffn=256,
                       hidden=hidden, seed=9)
    probs = p["probs"].to(torch.bfloat16)
    args = (p["x"], p["weight"], p["counts"].tolist(), p["token_index"], tokens, topk, probs)
    with torch.no_grad():
        launch = prepare(*args, config=TRITON)  # (the table complete before the launch)
        assert launch.routing.slots is None and launch.routing.places is not None
        want = torch.full((tokens, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
        launcher.launch(launch.buffer, p["x"], p["weight"], launch.routing,
                        launch.launch_plan, probs, want)
        outs = [gemm2_gather_rs(*args, config=TRITON) for _ in range(8)]
        counts = p["counts"].cuda()
        call = CapturedCall(lambda: gemm2_gather_rs(p["x"], p["weight"], counts,
                                                    p["token_index"], tokens, topk, probs,
                                                    config=TRITON), torch.device("cuda"))
        call.out.fill_(float("nan"))
        call.replay()
        torch.cuda.synchronize()
    assert not want.isnan().any() and all(torch.equal(o, want) for o in outs)
    assert torch.equal(call.out, want)


def test_captured_call_keeps_the_tensors_its_graph_reads_alive():
    """A callable whose inputs exist only in its closure (bench_op's captured counts): the
    graph replays on those addresses, so CapturedCall must own them. Freed, the caching
    allocator hands their block to the next tensor of that size, and a replay reads it."""
    from megatron_overlap.ops.capture import CapturedCall

    def call_on_private_input():
        src = torch.randn(1 << 20, device="cuda")
        return lambda: src * 3.0, (src * 3.0).clone()

    fn, want = call_on_private_input()
    captured = CapturedCall(fn, torch.device("cuda"))
    del fn
    assert captured.summary()["equal"]
    squatters = [torch.full((1 << 20,), -7.0, device="cuda") for _ in range(4)]
    captured.out.fill_(float("nan"))
    captured.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.out, want)
    del squatters


def test_op_captured_on_device_counts_replays_the_routing_each_replay_finds():
    """Captured once (one rank, CUDA counts, no grad): each replay combines the rows, counts
    and tokens its input tensors then hold (a hot expert, a spread routing), with the bits
    of an eager call on them, every element rewritten (poisoned before); counts that miss
    the rows in a replay raise at `note_replays` and the graph goes on replaying."""

    shape = dict(tokens=512, experts=4, topk=2, ffn=128, hidden=256)
    runs = {"spread": routed_problem(0, 1, device="cuda", **shape),
            "hot": routed_problem(0, 1, device="cuda", hot=True, seed=3, **shape)}
    assert runs["spread"]["x"].shape == runs["hot"]["x"].shape  # T = M k: static shapes
    for r in runs.values():
        r["counts"] = r["counts"].cuda()
    with torch.no_grad():
        want = {n: gemm2_gather_rs(r["x"], r["weight"], r["counts"], r["token_index"], 512, 2,
                                   config=TRITON) for n, r in runs.items()}
        static = {k: v.clone() for k, v in runs["spread"].items()}
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gemm2_gather_rs(static["x"], static["weight"], static["counts"],
                                  static["token_index"], 512, 2, config=TRITON)

        def replay(run):
            for k in ("x", "weight", "counts", "token_index"):
                static[k].copy_(run[k])
            out.fill_(float("nan"))
            graph.replay()
            note_replays()
            torch.cuda.synchronize()
            return out.clone()

        for name in ("hot", "spread", "hot"):
            assert torch.equal(replay(runs[name]), want[name]), name
        assert not torch.equal(want["hot"], want["spread"])
        bad = dict(runs["hot"], counts=runs["hot"]["counts"] + 1)
        replay(bad)
        with pytest.raises(ValueError, match="does not sum to x's rows"):
            note_replays()
        assert torch.equal(replay(runs["spread"]), want["spread"])
        note_replays()
        torch.cuda.synchronize()
        note_replays()  # nothing left to raise


def test_padding_rows_on_device_counts_change_no_bit_and_replay_in_a_graph():
    """EP rank 0's rows padded to a bound (garbage rows, token 0, as the layer's padded
    permutation leaves them) with the counts on the device and `expected_rows`: the
    unpadded call's bits, eagerly and in replays of a captured call on two routings."""

    shape = dict(tokens=1024, experts=8, topk=2, ffn=256, hidden=512, ep=2)
    bound = 1024 * 2
    runs = []
    for seed in (31, 32):
        p = routed_problem(0, 2, device="cuda", seed=seed, **shape)
        rows = p["x"].shape[0]
        want = gemm2_gather_rs(p["x"], p["weight"], p["counts"].cuda(), p["token_index"],
                               1024, 2, config=TRITON)
        pad = dict(p, counts=p["counts"].cuda(),
                   x=torch.cat([p["x"], torch.randn(bound - rows, 256, device="cuda")
                                .bfloat16() * 1e3]),
                   token_index=torch.cat([p["token_index"], torch.zeros(
                       bound - rows, dtype=p["token_index"].dtype, device="cuda")]))
        runs.append((pad, want))
    with torch.no_grad():
        for pad, want in runs:
            got = gemm2_gather_rs(pad["x"], pad["weight"], pad["counts"], pad["token_index"],
                                  1024, 2, config=TRITON, expected_rows=1024)
            assert torch.equal(got, want)
        static = {k: v.clone() for k, v in runs[0][0].items()}
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gemm2_gather_rs(static["x"], static["weight"], static["counts"],
                                  static["token_index"], 1024, 2, config=TRITON,
                                  expected_rows=1024)
        for i in (1, 0, 1):
            for k in ("x", "weight", "counts", "token_index"):
                static[k].copy_(runs[i][0][k])
            out.fill_(float("nan"))
            graph.replay()
            note_replays()
            torch.cuda.synchronize()
            assert torch.equal(out, runs[i][1]), i
        note_replays()


def test_a_prepared_launch_repeated_after_gemm2_alone_waits_for_its_flag_reset():
    """A routing launched again (benchmarks, calibration) forks GatherRS from an event
    of its own call: GEMM2 alone's flag reset, queued behind a long kernel, comes first.
    (Forking from the routing's old event let GatherRS read the flags of GEMM2 alone,
    and the reset then erased the published splits of the op's own GEMM2: a time-out.)"""
    import dataclasses

    from megatron_overlap.ops import launcher
    from megatron_overlap.ops import default_session

    prepare = default_session().prepare
    p = routed_problem(0, 1, device="cuda", **SHAPE)
    args = (p["x"], p["weight"], p["counts"].tolist(), p["token_index"], SHAPE["tokens"],
            SHAPE["topk"], None, None)
    config = dataclasses.replace(TRITON, wait_timeout_s=5.0)  # (a stale fork times out)
    want = gemm2_gather_rs(*args, config=config)
    launch = prepare(*args[:7], config=config)  # (the session knows its group)
    y = torch.empty(p["x"].shape[0], SHAPE["hidden"], dtype=p["x"].dtype, device="cuda")
    for _ in range(3):
        torch.cuda._sleep(50_000_000)  # (the main stream far behind the host)
        launcher.launch_gemm2_alone(launch.buffer, p["x"], p["weight"], launch.routing,
                                    launch.launch_plan, y)
        out = torch.full_like(want, float("nan"))
        launcher.launch(launch.buffer, p["x"], p["weight"], launch.routing,
                        launch.launch_plan, None, out)
        torch.cuda.synchronize()
        assert torch.equal(out, want)


def test_single_gpu_hot_expert_and_planner_choice():
    p = routed_problem(0, 1, device="cuda", hot=True, **SHAPE)
    out, plan = gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"],
                                SHAPE["tokens"], SHAPE["topk"], config=TRITON, return_plan=True)
    assert plan.source == "model"
    assert rel_err(out, _fp32_partial(p, SHAPE["tokens"]).double().cpu()) < 1e-2


def test_missing_producer_raises_instead_of_hanging(monkeypatch):
    from megatron_overlap.kernels import gemm2

    p = routed_problem(0, 1, device="cuda", tokens=512, experts=4, topk=2, ffn=128, hidden=256)
    cfg = OverlapConfig(backend="triton", sync_errors=True, max_spins=10000)
    gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"], 512, 2, config=cfg)
    monkeypatch.setattr(gemm2, "grouped_gemm2_launcher", lambda *a, **k: (lambda stream=None: None))
    with pytest.raises(OverlapTimeoutError, match="split 0"):
        gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"], 512, 2, config=cfg)
    default_session().buffer("triton").reset()


def test_rows_out_of_megatron_order_raise_and_the_next_call_works():
    p = routed_problem(0, 1, device="cuda", tokens=512, experts=4, topk=2, ffn=128, hidden=256)
    with pytest.raises(ValueError, match="permutation order"):
        gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"].flip(0), 512, 2,
                        config=TRITON)
    out = gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"], 512, 2,
                          config=TRITON)
    assert rel_err(out, _fp32_partial(p, 512).double().cpu()) < 1e-2


def _ranks_run(rank, world, one_gpu=False):
    import torch.distributed as dist

    torch.cuda.set_device(0 if one_gpu else rank)
    group = dist.group.WORLD
    res = {}
    layouts = {f"tp{world}": 1, f"ep{world}": world, **({"tp2ep2": 2} if world == 4 else {})}
    for name, ep in layouts.items():
        p = routed_problem(rank, world, device="cuda", ep=ep, seed=11, **SHAPE)
        full = _fp32_partial(p, SHAPE["tokens"])
        full = _all_reduce(full, one_gpu)
        md = SHAPE["tokens"] // world
        mine = full[rank * md:(rank + 1) * md].double().cpu()
        outs = [_poisoned_call(p, SHAPE["tokens"], SHAPE["topk"], group, comm_ctas=c, splits=l)
                for c, l in ((1, 1), (3, 2), (8, 4), (16, 2), (32, 2))]
        # the counts on the device (what a layer with every expert local hands the op)
        outs.append(_poisoned_call(dict(p, counts=p["counts"].cuda()), SHAPE["tokens"],
                                   SHAPE["topk"], group))
        ref = (outs[0] if one_gpu else  # (gloo has no CUDA reduce-scatter)
               gemm2_gather_rs(p["x"], p["weight"], p["counts"], p["token_index"],
                               SHAPE["tokens"], SHAPE["topk"], None, group,
                               config=OverlapConfig(backend="reference")))
        res[name] = dict(err=rel_err(outs[0], mine), ref_err=rel_err(ref, mine),
                         nan=bool(torch.isnan(outs[0]).any()),
                         bitwise=all(torch.equal(o, outs[0]) for o in outs),
                         # (which call differs from the first, in how many elements)
                         differing={i: int((o != outs[0]).sum()) for i, o in enumerate(outs)
                                    if not torch.equal(o, outs[0])})
    # one buffer, models alternating: the peer slots change geometry on every call (this
    # freed peer memory while a peer still wrote into it before the allocation grew only)
    errs = []
    for hidden in (2048, 1024, 2048, 1024):
        p = routed_problem(rank, world, device="cuda", seed=12, **dict(SHAPE, hidden=hidden))
        full = _all_reduce(_fp32_partial(p, SHAPE["tokens"]), one_gpu)
        mine = full.chunk(world)[rank].double().cpu()
        errs.append(rel_err(_poisoned_call(p, SHAPE["tokens"], SHAPE["topk"], group), mine))
    res["alternating"] = dict(err=max(errs), ref_err=0.0, nan=False, bitwise=True)
    return res


def _ranks_graph(rank, world, one_gpu=False):
    """Every rank captures its op call once (TP: every expert local, CUDA counts) and
    replays it on two routings in turn, an eager call between replays: each replay and
    call gives the bits of an eager call on its inputs. The barrier's epoch and the
    receive slots' parity are device words, so an odd and an even number of replays both
    leave the next call its slots (poisoned outputs, all rewritten)."""
    import torch.distributed as dist


    torch.cuda.set_device(0 if one_gpu else rank)
    group = dist.group.WORLD
    shape = dict(tokens=1024, experts=8, topk=2, ffn=256, hidden=512)
    runs = [routed_problem(rank, world, device="cuda", seed=s, **shape) for s in (21, 22)]
    for r in runs:
        r["counts"] = r["counts"].cuda()

    def eager(r):
        return gemm2_gather_rs(r["x"], r["weight"], r["counts"], r["token_index"], 1024, 2,
                               None, group, config=TRITON)

    with torch.no_grad():
        want = [eager(r) for r in runs]
        static = {k: v.clone() for k, v in runs[0].items()}
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gemm2_gather_rs(static["x"], static["weight"], static["counts"],
                                  static["token_index"], 1024, 2, None, group, config=TRITON)
        equal = []
        for i in (1, 0, 1, "eager", 1, 1, 0, "eager"):
            if i == "eager":
                equal.append(torch.equal(eager(runs[0]), want[0]))
                continue
            for k in ("x", "weight", "counts", "token_index"):
                static[k].copy_(runs[i][k])
            out.fill_(float("nan"))
            graph.replay()
            note_replays()
            torch.cuda.synchronize()
            equal.append(torch.equal(out, want[i]))
        note_replays()
        torch.cuda.synchronize()
    return dict(equal=equal, differ=not torch.equal(want[0], want[1]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_ranks_sharing_one_gpu_replay_their_captured_calls_bit_for_bit():
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    for rank, res in enumerate(run_ranks(2, _ranks_graph, True, backend="gloo")):
        assert all(res["equal"]) and res["differ"], (rank, res)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_replay_their_captured_calls_bit_for_bit():
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    for rank, res in enumerate(run_ranks(2, _ranks_graph, backend="nccl")):
        assert all(res["equal"]) and res["differ"], (rank, res)


def _all_reduce(t, on_host):
    """The sum over ranks (through host memory where the group is gloo's)."""
    import torch.distributed as dist

    if not on_host:
        dist.all_reduce(t)
        return t
    host = t.cpu()
    dist.all_reduce(host)
    return host.to(t.device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_sharing_one_gpu_match_fp32_reference_and_are_bitwise_stable(world):
    """The multi-rank protocol (peer pushes into peer memory, the cross-rank barrier,
    parity-alternating receive slots, the final sum) compiled and run on one GPU: the
    ranks' processes share it (time-sliced contexts, CUDA IPC peer memory, a gloo group:
    NCCL refuses two ranks on one device). What a machine of one GPU can check of the
    multi-GPU path."""
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    results = run_ranks(world, _ranks_run, True, backend="gloo")
    for rank, res in enumerate(results):
        for name, r in res.items():
            assert not r["nan"] and r["bitwise"], (rank, name, r)
            assert r["err"] < 1e-2, (rank, name, r)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_match_fp32_reference_and_are_bitwise_stable():
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    results = run_ranks(2, _ranks_run, backend="nccl")
    for rank, res in enumerate(results):
        for name, r in res.items():
            assert not r["nan"] and r["bitwise"], (rank, name, r)
            assert r["err"] < 1e-2 and r["ref_err"] < 1e-2, (rank, name, r)
