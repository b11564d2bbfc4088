"""The op's third stage: GEMM2 (P programs) and GatherRS (C programs) of one planned
launch, overlapped on two streams, then the local sum over ranks.

`launch` is the production path. `launch_gemm2_alone` and `launch_comm_alone` run one
side by itself, for calibration and benchmarks (the flags preset or cleared around it).
The buffer lends the flags, the epoch, the error word and the peer slots; the plan
(`planning.LaunchPlan`) and the routing (`routing.Routing`) are values.
"""

from __future__ import annotations

import torch

from ..kernels import gather_rs as grs
from ..kernels import gemm2
from .buffer import OverlapBuffer
from .planning import LaunchPlan
from .routing import Routing
from .stream_ops import StreamOps


class _Streams:
    """GatherRS's stream and the fork / join events of one buffer's launches (kept on the
    buffer: `streams_of`)."""

    def __init__(self, device: torch.device):
        self.side = torch.cuda.Stream(device)
        self.ops = StreamOps(device)  # (event records and waits through the driver)
        self.fork = torch.cuda.Event()  # main -> side before GatherRS
        self.join = torch.cuda.Event()  # side -> main after it
        self.slotted = torch.cuda.Event()  # side -> the tail helpers: the table is complete


def streams_of(buf: OverlapBuffer) -> _Streams:
    """The buffer's launch streams, made at its first overlapped launch."""
    if buf.launch_streams is None:
        buf.launch_streams = _Streams(buf.device)
    return buf.launch_streams


def _gemm2_args(buf: OverlapBuffer, lp: LaunchPlan, hidden: int, width: int, places,
                scales=None) -> dict:
    t = lp.tiles
    return dict(splits=lp.splits, programs=lp.plan.compute_slots, block_m=t.block_m,
                block_n=t.block_n, block_k=t.block_k, num_warps=t.gemm_warps,
                num_stages=t.gemm_stages, upcast=buf.backend == "interpret",
                flatten=t.gemm_flatten, places=places, impl=t.gemm_impl, maxnreg=t.gemm_maxnreg,
                width=width, scales=scales)


def _launch_comm(buf: OverlapBuffer, lp: LaunchPlan, y, routing: Routing, probs, out,
                 width: int, helpers: int = 0, **kw) -> None:
    """GatherRS (or, with `launch_helpers`, its tail helpers) into the buffer's slots."""
    t, hidden = lp.tiles, out.shape[1]
    col_tiles, last_col_tiles = gemm2.split_col_tiles(hidden, lp.splits, width, t.block_n)
    target = buf.comm_target(out)
    grs.launch_gather_rs(
        y, routing.table, probs, target.dst, target.signals, buf.ready, buf.done, buf.error,
        routing.tile_start, tokens_per_rank=lp.tokens_per_rank, splits=lp.splits,
        rank=buf.rank, world=buf.world, gemm_col_tiles=col_tiles,
        gemm_last_col_tiles=last_col_tiles, width=width, epoch=buf.epoch,
        max_spins=lp.max_spins, wait_timeout_s=lp.wait_timeout_s,
        partial_like=target.partial_like, dst_slot_stride=target.slot_stride,
        dst_row_stride=target.row_stride, programs=lp.plan.comm_ctas,
        block_tm=lp.family.comm_tm, block_tn=lp.family.comm_tn, num_warps=t.comm_warps,
        item_stages=t.comm_stages, slot_loop=t.comm_slot_loop, helpers=helpers,
        token_major=routing.dest is not None, maxnreg=t.comm_maxnreg, **target.descriptor,
        **kw)


def _overlapped(buf, lp, launch_gemm2, comm) -> None:
    """GEMM2 on the caller's stream (which already orders the offsets and the routing's
    first pass before it), GatherRS on the side stream from the same point, after the
    routing's second pass where it was deferred, and the tail helpers behind GEMM2 after
    that pass too; the caller's stream then waits for GatherRS. (No `torch.cuda.stream`
    switch: it costs more than a launch.)"""
    streams = streams_of(buf)
    side, ops = streams.side, streams.ops
    fork, slots = comm.fork, comm.slots
    if lp.plan.reservation > 0 and slots is not None:
        # The partition's GatherRS must reach the GPU before GEMM2 spreads over its SMs
        # (below): the routing's second pass goes on this stream, before a fork of its
        # own, rather than ahead of GatherRS on the side stream.
        slots.launch()
        slots, fork = None, None
    if fork is None:
        fork = streams.fork
        ops.record(fork)
    if lp.plan.reservation > 0:
        # The partition: GatherRS's C programs take their R(C) SMs before GEMM2 fills the
        # rest, so both grids are co-resident (P(C) + R(C) fit by construction).
        ops.wait(fork, side)
        with buf.all_or_broken():
            comm(stream=side)
            launch_gemm2()
    else:
        # The shared placement (R = 0): GatherRS's CTAs fit beside GEMM2's on every SM,
        # so the order decides no residency, and GEMM2 first starts the GPU one launch
        # earlier (GatherRS's launch runs on the host while GEMM2 computes split 0, which
        # GatherRS waits for anyway). It is also the order that cannot deadlock: GEMM2
        # waits on nothing. (If its launch fails, nothing has touched the flags.)
        launch_gemm2()
        ops.wait(fork, side)
        with buf.all_or_broken():
            if slots is not None:
                # the deferred second pass ahead of GatherRS on its stream, and an event
                # right after it: the tail helpers, queued on this stream behind GEMM2,
                # read its table too (an event after GatherRS would queue them behind
                # GatherRS's C programs, which leave them the last split's share)
                slots.launch(stream=side)
                ops.record(streams.slotted, side)
            comm(stream=side)
    if lp.helpers:  # queued behind GEMM2: they start on the SMs it leaves
        if slots is not None:  # (still set only where the side stream ran the pass)
            ops.wait(streams.slotted)
        with buf.all_or_broken():
            comm(launch_helpers=True)
    ops.record(streams.join, side)
    ops.wait(streams.join)


class _Comm:
    """GatherRS of one launch, as a callable the stream order above decides on, with the
    routing's deferred second pass (`Routing.slots`) that must precede it and the tail
    helpers, which the launch queues where its stream order needs it."""

    def __init__(self, buf, lp, y, routing, probs, out, width, fork):
        self.args = (buf, lp, y, routing, probs, out, width)
        self.fork = fork
        self.helpers = lp.helpers
        self.slots = routing.slots

    def __call__(self, **kw) -> None:
        _launch_comm(*self.args, helpers=self.helpers, **kw)


def launch(buf: OverlapBuffer, x, weight, routing: Routing, lp: LaunchPlan, probs, out,
           y=None, width: int | None = None, fork=None, scales=None) -> torch.Tensor:
    """GEMM2 and GatherRS overlapped, then the local sum over ranks into `out`; returns
    y (GEMM2's output). `width`: the split width sw (None: ceil(N/L)); a larger one
    narrows the last split to the N - (L-1) sw columns left (`gemm2.split_col_tiles`).
    `scales`: e4m3 x and weight with their `Fp8Scales` (the FP8 kernel; y bf16).

    `fork`: the event GatherRS's stream starts from. The op passes `routing.routed`,
    recorded right after this call's routing table (one event record less). None
    records one here, before GEMM2: what a routing launched more than once needs
    (benchmarks, calibration), since its own event is then older than work the caller
    queued since, such as another launch's flag reset, which GatherRS must follow."""
    buf.wait_bounds = (lp.wait_timeout_s, lp.max_spins)  # (for a time-out's message)
    hidden = weight.shape[1]
    width = width or gemm2.split_width(hidden, lp.splits)
    if y is None:
        y = torch.empty(x.shape[0], hidden, dtype=out.dtype, device=x.device)
    gemm_args = _gemm2_args(buf, lp, hidden, width, routing.places, scales)
    operands = (x, weight, y, routing.row_start, routing.tile_start, buf.ready)
    comm = _Comm(buf, lp, y, routing, probs, out, width, fork)
    if buf.backend == "interpret":
        # Programs of one launch run one after another here: GEMM2 must finish first.
        gemm2.launch_grouped_gemm2(*operands, **gemm_args)
        if comm.slots is not None:
            comm.slots.launch()
        with buf.all_or_broken():
            comm()
            if lp.helpers:
                comm(launch_helpers=True)
    else:
        # GEMM2 compiled and loaded before GatherRS starts spinning on its flags (a JIT
        # compile or a lazy module load after that would leave it spinning).
        _overlapped(buf, lp, gemm2.grouped_gemm2_launcher(*operands, **gemm_args), comm)
    buf.sum_partials(out)
    return y


def launch_gemm2_alone(buf: OverlapBuffer, x, weight, routing: Routing, lp: LaunchPlan,
                       y, width: int | None = None, scales=None) -> torch.Tensor:
    """GEMM2 by itself (calibration, benchmarks): the readiness flags cleared after it."""
    hidden = weight.shape[1]
    width = width or gemm2.split_width(hidden, lp.splits)
    gemm2.launch_grouped_gemm2(x, weight, y, routing.row_start, routing.tile_start, buf.ready,
                               **_gemm2_args(buf, lp, hidden, width, routing.places, scales))
    buf.ready.zero_()
    return y


def launch_comm_alone(buf: OverlapBuffer, y, routing: Routing, lp: LaunchPlan, probs, out,
                      width: int | None = None) -> None:
    """GatherRS by itself on a given y (calibration, benchmarks): every split's readiness
    flag preset, no tail helpers; then the local sum over ranks."""
    buf.wait_bounds = (lp.wait_timeout_s, lp.max_spins)
    width = width or gemm2.split_width(out.shape[1], lp.splits)
    buf.ready[:lp.splits].fill_(1 << 30)
    if routing.slots is not None:  # (a deferred second pass: the table GatherRS may read)
        routing.slots.launch()
    _launch_comm(buf, lp, y, routing, probs, out, width)
    buf.sum_partials(out)
