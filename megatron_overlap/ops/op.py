"""`gemm2_gather_rs`: grouped GEMM2 + top-k combine + reduce-scatter, overlapped.

The pipeline of section III, one stage per module, typed values between them:
    check the call (`Call`) -> route (`routing.Routing`: offsets, combine table)
    -> plan (`planning.LaunchPlan`: C, L, tiles, pure and cached)
    -> launch (`launcher.launch` on the session's `OverlapBuffer`: peer memory and flags).

Every stage runs on an `OverlapSession` (session.py), which owns the state: the buffer,
the router's counts ring, the compiled kernel families and the planner's caches. These
functions take it as their first argument and keep nothing between calls; the plan
stage compiles nothing (`OverlapSession.warm_up` does, or `OverlapSession.plan` for a
shape it did not cover).

Glossary (as in the planner):
    T  rows of the expert-sorted activations (sum of tokens_per_expert)
    K  GEMM2 reduction dim on this rank;  N  hidden size
    E  local experts;  k  top-k (most rows per token)
    M  tokens of the whole group;  D  ranks;  Md = M / D tokens owned by each rank
    C  communication CTAs;  P  compute CTAs;  L  splits

    out[Md, N] = rows [rank*Md, (rank+1)*Md) of
                 sum over ranks of ( sum over the k rows j of token t: y[j] * probs[j] )
    where y[rows of e] = x[rows of e] @ weight[e]^T

On rank r the result equals what Megatron's allgather dispatcher computes with FC2,
`combine_preprocess` (unpermute) and `token_combine` (reduce-scatter over tp_ep_group).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from ..kernels.routing_table import combine_table
from ..planner import Workload, expert_row_tiles
from .groups import call_backend
from .config import OverlapConfig, TileConfig
from .buffer import OverlapBuffer
from .fp8 import OUT_DTYPE, Fp8Scales, check_call as check_fp8, check_sink, kind_of
from .planning import LaunchPlan, PlanRequest, launch_tiles
from .plans import family_keys
from .routing import Routing
from .nodes import Gemm2GatherRS, SinkGatherRS, forward
from .validation import (MAX_TOKENS, MAX_TOPK, capturing, check_int,
                         check_options, expert_count, host_counts, to_device, validate)

#: call tags live in bits 16-30 of the descriptor's kind word (`OverlapBuffer._descriptor`)
MAX_CALL_TAG = 1 << 15


def run(session, x: torch.Tensor, weight: torch.Tensor, tokens_per_expert,
        token_index: torch.Tensor, num_tokens: int, topk: int,
        probs: torch.Tensor | None = None, *, comm_ctas: int | None = None,
        splits: int | None = None, config: OverlapConfig | None = None,
        return_plan: bool = False, expected_rows: int | None = None, call_tag: int = 0,
        scales=None, grad_sink: torch.Tensor | None = None):
    """The op on `session`: prepare, then launch (`OverlapSession.__call__`, whose
    docstring `gemm2_gather_rs` carries, says what each argument is)."""
    check_sink(x, weight, scales, grad_sink)
    grads = needs_grads(x, weight, probs, expected_rows is not None, grad_sink)
    launch = prepare(session, x, weight, tokens_per_expert, token_index, num_tokens, topk,
                     probs, comm_ctas=comm_ctas, splits=splits, config=config,
                     expected_rows=expected_rows, defer_slots=None, call_tag=call_tag,
                     scales=scales)
    out = launched(session, launch, x, weight, probs, token_index, grads, grad_sink)
    return (out, launch.plan) if return_plan else out


def needs_grads(x, weight, probs, padded: bool, grad_sink=None) -> bool:
    """Does the call build an autograd node? Refuses one that could not run backward:
    padded rows (`expected_rows`) or a CUDA-graph capture."""
    grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, probs, grad_sink))
    if grads and padded:
        raise ValueError("expected_rows (padded rows) is for inference: the backward needs "
                         "x's rows to be the counts'")
    if grads and capturing(x):
        raise RuntimeError("gemm2_gather_rs cannot be captured in a CUDA graph with "
                           "gradients: its backward splits the rows by expert on the host "
                           "(capture the forward under torch.no_grad)")
    return grads


def launched(session, launch: "Launch", x, weight, probs, token_index, grads: bool,
             grad_sink=None):
    """The output of a prepared launch (`prepare`'s handle, on the same x, weight, probs
    and token_index): the kernels queued, an autograd node where `grads`, the error word's
    copy queued behind them, and an earlier call's error raised after they launched.
    FP8 operands' node, and any call's given a `grad_sink`, hands GEMM2's backward to
    `grad_sink` (`fp8.check_sink`)."""
    with _arrives_on_raise(session):
        if grads and (launch.call.scales is not None or grad_sink is not None):
            out = SinkGatherRS.apply(grad_sink, probs, x, weight, launch.counts_dev,
                                     token_index, launch.table, launch)
        elif grads:
            out = Gemm2GatherRS.apply(x, weight, probs, launch.counts_dev, token_index,
                                       launch.table, launch)
        else:  # inference and prefill: no autograd node to build
            out = forward(x, weight, probs, launch.counts_dev, launch.table, launch)[0]
    if launch.buffer is not None:
        launch.buffer.note_launch(launch.plan.w_comp if launch.counts is not None else None,
                                  sync=launch.config.sync_errors, captured=launch.captured)
        launch.buffer.raise_deferred()  # (an earlier call's error, found at this one's start)
    return out


@contextlib.contextmanager
def _arrives_on_raise(session):
    """A call that raises before its barrier still arrives there, marked failed, so
    that its peers raise for it at once (`OverlapBuffer.announce_raise`)."""
    try:
        yield
    except Exception as err:
        if session.world > 1:
            for buf in session.buffers():
                buf.announce_raise(err)
        raise


@dataclass(frozen=True)
class Call:
    """One call's checked inputs: the sizes, the group, the backend that will run it, and
    the counts (on the host, `counts`, or only on the device, `counts_dev`)."""

    config: OverlapConfig
    backend: str
    group: object
    world: int
    rank: int
    experts: int
    counts: list | None
    counts_dev: torch.Tensor | None
    token_index: torch.Tensor
    num_tokens: int
    topk: int
    splits: int | None  # explicit L
    comm_ctas: int | None  # explicit C
    padded: bool  # x's rows past the counts' sum are padding the device finds
    expected_rows: int | None
    captured: bool
    operands: tuple  # (x's shape, weight's shape, dtype): what a launch of it must be given
    scales: Fp8Scales | None = None  # of FP8 x and weight (None: bf16 operands)

    @property
    def out_dtype(self) -> torch.dtype:
        """y's, the partial sums' (unless the config sets them) and the output's dtype."""
        return OUT_DTYPE if self.scales is not None else self.operands[2]


@dataclass
class Launch:
    """A prepared call: its checked inputs and the three stages' values (routing, plan;
    None on the reference path), launched by `nodes.forward`."""

    call: Call
    counts_dev: torch.Tensor
    table: torch.Tensor  # [M, k] int32 rows of each token
    buffer: OverlapBuffer | None = None  # None on the reference path
    routing: Routing | None = None
    launch_plan: LaunchPlan | None = None

    @property
    def plan(self):
        """The planner's plan (C, P, R, L, predicted T); None on the reference path."""
        return None if self.launch_plan is None else self.launch_plan.plan

    config = property(lambda self: self.call.config)
    counts = property(lambda self: self.call.counts)
    group = property(lambda self: self.call.group)
    world = property(lambda self: self.call.world)
    captured = property(lambda self: self.call.captured)


def _checked_call(session, x, weight, tokens_per_expert, token_index, num_tokens, topk, probs,
                  comm_ctas, splits, config, expected_rows, scales) -> Call:
    """Validate the call and choose its backend (raises ValueError naming the argument)."""
    # (sizes as Python ints from here on: numpy's would reach the kernels and caches)
    config, comm_ctas, splits = check_options(session.config if config is None else config,
                                              comm_ctas, splits)
    if x.device != session.device:
        raise ValueError(f"x is on {x.device}, the session on {session.device}")
    num_tokens = check_int("num_tokens", num_tokens, 1, MAX_TOKENS)
    topk = check_int("topk", topk, 1, MAX_TOPK)
    group, world, rank = session.group, session.world, session.rank
    experts = expert_count(x, weight)
    counts, counts_dev = host_counts(tokens_per_expert, x.shape[0], experts, x.device)
    padded = expected_rows is not None
    if padded:
        expected_rows = check_int("expected_rows", expected_rows, None)
    if padded and not 0 <= expected_rows <= x.shape[0]:
        raise ValueError(f"expected_rows must lie in [0, {x.shape[0]}] (x's rows), got "
                         f"{expected_rows}")
    check_fp8(x, weight, scales, probs)
    validate(x, weight, counts, token_index, num_tokens, topk, probs, world, padded,
             fp8=scales is not None)
    num_splits = splits if splits is not None else config.splits
    if num_splits is not None and num_splits > weight.shape[1]:
        raise ValueError(f"splits ({num_splits}) must be <= hidden ({weight.shape[1]})")
    if padded and counts is not None:  # the host knows where the padding starts
        token_index = token_index[:sum(counts)]
        padded = False  # (the rows past the table's are in no expert's: GEMM2 skips them)
    captured = capturing(x)
    backend = call_backend(config, x, counts, session.peer_capable, session.backends, captured)
    if weight.shape[1] == 0:  # N = 0: nothing to combine; the reference's empty [M/D, 0]
        backend = "reference"
    return Call(config, backend, group, world, rank, experts, counts, counts_dev,
                token_index.contiguous(),  # (the kernels index it as a flat array)
                num_tokens, topk, num_splits,
                comm_ctas if comm_ctas is not None else config.comm_ctas, padded,
                expected_rows, captured, (tuple(x.shape), tuple(weight.shape), x.dtype),
                scales)


def _reference_launch(session, call: Call, hidden: int, dtype, call_tag: int) -> Launch:
    """The baseline's launch: its table built with torch alone (device counts: it splits
    the rows on the host anyway)."""
    counts, token_index = call.counts, call.token_index
    if call.padded:
        counts = call.counts_dev.tolist()
        token_index = token_index[:sum(counts)]
        call = dataclasses.replace(call, counts=counts, token_index=token_index, padded=False)
    table = combine_table(token_index.to(torch.int64), call.num_tokens, call.topk)
    counts_dev = (call.counts_dev if call.counts_dev is not None
                  else torch.tensor(counts, dtype=torch.int64))
    for buf in session.buffers() if call.world > 1 else ():
        # (a peer on peer memory would never join the reduce-scatter: agree first)
        buf.agree_reference(call.num_tokens, hidden, dtype, call_tag)
    return Launch(call, to_device(counts_dev, session.device), table)


def _plan_request(call: Call, tiles: TileConfig, routing: Routing, x, hidden: int,
                  rows: int) -> PlanRequest:
    """The planner's inputs. W_comp reads only row_tiles = sum_e ceil(M_e / TM) (with host
    counts it came with the routing); with the counts only on the device: section III-E,
    the rows spread evenly. local_topk: the rows per token this rank gathers (k under TP,
    about k / EP under EP), the bytes of a communication tile, in quarters."""
    row_tiles = routing.row_tiles
    if row_tiles is None:
        row_tiles = expert_row_tiles(Workload.from_total(
            tokens=call.num_tokens, hidden=hidden, ffn=x.shape[1], world=call.world,
            splits=1, total_assignments=rows, local_experts=call.experts).expert_counts,
            tiles.block_m)
    return PlanRequest(call.config, tiles, x.device, call.backend, row_tiles, call.experts,
                       call.num_tokens, hidden, x.shape[1], call.world, call.topk,
                       round(4 * rows / call.num_tokens) / 4, call.splits, call.comm_ctas,
                       kind_of(call.scales))


def prepare(session, x, weight, tokens_per_expert, token_index, num_tokens, topk, probs=None,
            *, comm_ctas=None, splits=None, config=None, expected_rows=None,
            defer_slots: bool | None = False, call_tag: int = 0, scales=None) -> Launch:
    """The op's pipeline up to the launch: check the call, route (offsets and combine
    table on the device), plan (C, L, tiles) and size the buffer's slots.
    `defer_slots`: the routing's second pass (the table) is left to the launch, which
    queues it on GatherRS's stream (`Routing.slots`), so that GEMM2 starts after the
    first pass; off, the table is complete when this returns (tools that read it before
    a launch); None (the op): deferred where GEMM2 does not read the table (row order).
    `scales`: FP8 x and weight (`fp8.py`), kept on the handle for its launch."""
    session.check_open()
    for buf in session.buffers():
        buf.begin_call()
    with _arrives_on_raise(session):
        return _prepare(session, x, weight, tokens_per_expert, token_index, num_tokens, topk,
                        probs, comm_ctas, splits, config, expected_rows, defer_slots,
                        check_int("call_tag", call_tag, 0, MAX_CALL_TAG - 1), scales)


def _prepare(session, x, weight, tokens_per_expert, token_index, num_tokens, topk, probs,
             comm_ctas, splits, config, expected_rows, defer_slots, call_tag,
             scales) -> Launch:
    call = _checked_call(session, x, weight, tokens_per_expert, token_index, num_tokens, topk,
                         probs, comm_ctas, splits, config, expected_rows, scales)
    num_tokens, topk, expected_rows = call.num_tokens, call.topk, call.expected_rows
    if call.backend == "reference":
        return _reference_launch(session, call, weight.shape[1],
                                 call.config.partial_dtype or call.out_dtype, call_tag)
    if x.shape[1] * x.element_size() % 16:
        raise ValueError(f"the {call.backend} backend needs 16-byte rows for its tensor "
                         f"descriptors: K * itemsize = {x.shape[1]} * {x.element_size()} "
                         f"is not a multiple of 16 (K % 8 == 0 for bf16)")
    buf = session.buffer(call.backend)
    if not call.captured:  # (a capture may not query events; the warm-up call checked)
        buf.take_stale(sync=False)
    # (the rows to plan for: the counted ones, or with the counts on the device and x
    # padded, the caller's expectation)
    rows = expected_rows if call.padded else call.token_index.shape[0]
    m, k = num_tokens, topk  # token-major y only where T = M k (TP) and fits int32
    tiles = launch_tiles(call.config, call.backend, x.device, x.dtype, token_major=(
        expected_rows is None and rows == m * k and m * k < 1 << 31), fp8=kind_of(call.scales))
    hidden = weight.shape[1]
    if call.captured:  # (before the routing queues anything into the capture)
        _refuse_uncompiled(session, call, tiles, hidden)
    # the receive slots first: growing them queues copies that GatherRS depends on, which
    # must come before the event it forks from, the routing's
    buf.ensure(num_tokens // call.world, hidden, call.config.partial_dtype or call.out_dtype,
               call.captured, call_tag)
    dest = (torch.empty(call.token_index.shape[0], dtype=torch.int32, device=x.device)
            if tiles.token_major else None)
    if defer_slots is None:  # deferred where GEMM2 does not read dest: row order
        defer_slots = dest is None
    counts = call.counts if call.counts is not None else to_device(call.counts_dev, x.device)
    routing = session.router.route(call.token_index, counts, buf.error, tiles.block_m,
                                   num_tokens, topk, dest, call.padded, defer_slots)
    launch_plan = session.plan(_plan_request(call, tiles, routing, x, hidden, rows))
    session.planner.log_decision(launch_plan, num_tokens, hidden, x.shape[1], call.world)
    return Launch(call, routing.counts_dev, routing.table, buf, routing, launch_plan)


def _refuse_uncompiled(session, call: Call, tiles: TileConfig, hidden: int) -> None:
    """A captured call plans with kernel families compiled before the capture (warm_up or
    an eager call of these shapes): a compile allocates and loads a module, which a
    capture must not record (RuntimeError, as the capture's other refusals)."""
    for key in family_keys(call.config, tiles, session.device, call.backend, hidden,
                           call.topk, call.splits, kind_of(call.scales)):
        if key not in session.families:
            raise RuntimeError(f"gemm2_gather_rs cannot be captured in a CUDA graph here: "
                               f"the kernel family {key} is not compiled; call "
                               f"OverlapSession.warm_up (or make one eager call of these "
                               f"shapes) before capturing")
