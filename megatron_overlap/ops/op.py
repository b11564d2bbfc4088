"""`gemm2_gather_rs`: grouped GEMM2 + top-k combine + reduce-scatter, overlapped.

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

import dataclasses
import functools
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..kernels import gemm2
from ..kernels.routing_table import combine_table
from ..planner import Workload, expert_row_tiles
from .buffer import OverlapBuffer, note_call
from .config import OverlapConfig, TileConfig, resolve_backend, with_register_caps
from .planning import log_decision, planned, row_order
from .grouped import grouped_mm, grouped_wgrad
from .reference import all_gather, reference_forward
from .validation import (aligned, capture_refusal, capturing, check_int, check_options,
                         expert_count, host_counts, to_device, validate)

_group_sizes: dict[int, tuple] = {}


def _group_size_rank(group) -> tuple[int, int]:
    """(size, rank) of the group; remembered (two torch.distributed queries per call
    are host time on the launch path). The entry holds the group, so its id stays its."""
    if group is None or not dist.is_initialized():
        return 1, 0
    hit = _group_sizes.get(id(group))
    if hit is None or hit[0] is not group:
        hit = _group_sizes[id(group)] = (group, dist.get_world_size(group),
                                         dist.get_rank(group))
    return hit[1], hit[2]


def _forward(x, weight, probs, counts_dev, table, launch):
    """(out, y) of a prepared launch: the overlapped kernels or the reference path."""
    counts, group, world = launch.counts, launch.group, launch.world
    if launch.buffer is None:  # (the rows past the counts' sum are padding)
        return reference_forward(x[:sum(counts)], weight, counts_dev, counts, table, probs,
                                 group, world)
    out = torch.empty(table.shape[0] // world, weight.shape[1], dtype=x.dtype, device=x.device)
    y = launch.buffer.launch(aligned(x), aligned(weight), counts_dev, table, probs, out,
                             plan=launch.plan, fork=launch.routed, **launch.kwargs)
    return out, y


class _Gemm2GatherRS(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, probs, counts_dev, token_index, table, launch):
        counts, group, world = launch.counts, launch.group, launch.world
        out, y = _forward(x, weight, probs, counts_dev, table, launch)
        ctx.meta = (counts, group, world)
        keep_y = probs is not None and probs.requires_grad
        dest = launch.kwargs.get("dest")
        if keep_y and dest is not None:  # token-major y: back to GEMM2's row order
            y = y[dest.long()]
        ctx.save_for_backward(x, weight, probs, counts_dev, token_index, y if keep_y else None)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, probs, counts_dev, token_index, y = ctx.saved_tensors
        counts, group, world = ctx.meta
        grad_rows = _gathered_rows(grad_out, token_index, group, world)  # [T, N]
        grad_probs = None
        if probs is not None:
            if ctx.needs_input_grad[2]:
                grad_probs = (grad_rows.float() * y.float()).sum(1).to(probs.dtype)
            grad_rows = grad_rows * probs.to(grad_rows.dtype)[:, None]
        grad_x = grad_w = None
        # (grouped.py pads operands whose rows are not 16-byte multiples: any N, K)
        if ctx.needs_input_grad[0]:  # dx[rows of e] = dy W[e]: [T, N] @ [N, K]
            grad_x = grouped_mm(grad_rows, weight, counts_dev, counts)
        if ctx.needs_input_grad[1]:  # dW[e] = dy_e^T x_e, every expert in one grouped GEMM
            grad_w = grouped_wgrad(grad_rows, x, counts_dev, counts)
        return grad_x, grad_w, grad_probs, None, None, None, None


def _gathered_rows(grad_out, token_index, group, world: int) -> torch.Tensor:
    """[T, N] the output gradient of each row's token: the gradient of a reduce-scatter is
    an all-gather, then each row reads its token's."""
    grad_out = grad_out.contiguous()
    full = grad_out
    if world > 1:
        full = grad_out.new_empty(grad_out.shape[0] * world, grad_out.shape[1])
        all_gather(full, grad_out, group=group)
    return full[token_index.long()]


_fallback_warned = False
_peer_capable_cache: dict[int, bool] = {}


def _peer_capable(group, world: int) -> bool:
    """True when every rank of the group is on this host (peer memory can work).

    Collective on the first call for a group (every rank calls the op together), then
    cached: the launch path must not add a host round trip.
    """
    if world == 1:
        return True
    known = _peer_capable_cache.get(id(group))
    if known is None:
        import socket

        hosts = [None] * world
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        known = _peer_capable_cache[id(group)] = len(set(hosts)) == 1
    return known


def gemm2_gather_rs(
    x: torch.Tensor,
    weight: torch.Tensor,
    tokens_per_expert,
    token_index: torch.Tensor,
    num_tokens: int,
    topk: int,
    probs: torch.Tensor | None = None,
    group=None,
    *,
    comm_ctas: int | None = None,
    splits: int | None = None,
    config: OverlapConfig | None = None,
    return_plan: bool = False,
    expected_rows: int | None = None,
):
    """Overlapped GEMM2 + top-k combine + reduce-scatter; returns this rank's [M/D, N].

    Args:
        x: [T, K] expert-sorted activations (bf16, fp16 or fp32), rows of expert 0 first.
        weight: [E, N, K] FC2 weights of the local experts (nn.Linear layout), x's dtype.
        tokens_per_expert: [E] rows per local expert: a host list / CPU tensor (exact
            planning) or an int32 / int64 CUDA tensor (the planner's normalized-load
            estimate; the host never waits for the counts). Device counts are read in
            place by the routing-table kernel, which checks their sum against T and
            raises (ValueError) as for token_index below.
        token_index: [T] int, the global token (0..M-1) of each row (Megatron's
            `reversed_local_input_permutation_mapping`), in Megatron's permutation
            order: strictly ascending inside each expert's rows. Checked on CPU at the
            call; on CUDA by the routing-table kernel, raised (ValueError) at the next
            call or `OverlapBuffer.check()` (at once with `sync_errors=True`).
        num_tokens: M, tokens of the whole group; must be divisible by the group size.
        topk: most rows a token can have on this rank (the router's top-k).
        probs: optional [T] weight of each row, applied before the combine (Megatron
            applies routing probabilities before FC2 and passes None).
        group: the reduce-scatter group (Megatron's tp_ep_group); None = one rank.
        comm_ctas, splits: explicit C and L (override the planner / default).
        config: OverlapConfig (backend, planner switch, sm_margin, preset, ...).
        return_plan: also return the planner's decision (None on the reference path).
        expected_rows: x's rows are a bound: the counts may sum to fewer, and the rows
            past their sum are padding, computed and combined by nobody (the layer's
            padded permutation under EP in inference). The value is the rows the
            planner expects where the counts stay on the device (e.g. M x top-k x local
            / all experts under uniform routing). Not with gradients.

    CUDA graphs: a call captured under torch.no_grad with tokens_per_expert a CUDA
    tensor and a Triton backend replays correctly for whatever the captured x, counts
    and token_index hold at replay time (the planner's decision is the capture's: it
    read only the shapes); on a group of several ranks every rank replays its graph as
    it would call the op. Run one call of the same shapes before capturing (it compiles
    the kernels and sets up the group's peer memory). A replay's errors (bad counts, a
    time-out) stay in the buffer's error word: `OverlapBuffer.note_replays()` after a
    replay reads them at the next call, as an eager call's. Other calls raise
    RuntimeError when captured.
    """
    grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                         or (probs is not None and probs.requires_grad))
    if grads and expected_rows is not None:
        raise ValueError("expected_rows (padded rows) is for inference: the backward needs "
                         "x's rows to be the counts'")
    if grads and capturing(x):
        raise RuntimeError("gemm2_gather_rs cannot be captured in a CUDA graph with "
                           "gradients: its backward splits the rows by expert on the host "
                           "(capture the forward under torch.no_grad)")
    launch = prepare(x, weight, tokens_per_expert, token_index, num_tokens, topk, probs,
                     group, comm_ctas=comm_ctas, splits=splits, config=config,
                     expected_rows=expected_rows)
    if grads:
        out = _Gemm2GatherRS.apply(x, weight, probs, launch.counts_dev, token_index,
                                   launch.table, launch)
    else:  # inference and prefill: no autograd node to build
        out = _forward(x, weight, probs, launch.counts_dev, launch.table, launch)[0]
    if launch.buffer is not None:
        launch.buffer.note_launch(launch.plan.w_comp if launch.counts is not None else None,
                                  sync=launch.config.sync_errors, captured=launch.captured)
    return (out, launch.plan) if return_plan else out


def _unprepared(group, world: int, device: torch.device, backend: str) -> str | None:
    """What a capture would have to set up on the host (None: an eager call of this group
    did it): the ranks' hosts, gathered by a collective, and the buffer (its peer memory
    is a collective allocation)."""
    if (world > 1 and id(group) not in _peer_capable_cache) or not OverlapBuffer.exists(
            group, device, backend):
        return ("this group's first call sets up peer memory with collectives; make one "
                "eager call (of the largest shapes) before capturing")
    return None


@dataclass
class Launch:
    """Everything decided before the kernels run: a named handle, not a bare tuple."""

    config: OverlapConfig
    backend: str
    group: object
    world: int
    rank: int
    counts: list | None  # host counts, None when they live only on the device
    counts_dev: torch.Tensor
    table: torch.Tensor  # [M, k] int32 rows of each token
    buffer: OverlapBuffer | None  # None on the reference path
    plan: object  # planner.Plan, None on the reference path
    kwargs: dict  # for OverlapBuffer.launch
    # the event GatherRS's stream forks from (`OverlapBuffer.route`'s), for this call's
    # launch only: a tool that relaunches `kwargs` later leaves it out
    routed: object = None
    captured: bool = False  # queued into a CUDA graph being captured (`note_launch`)


@functools.lru_cache(maxsize=64)
def _resolved(tiles: TileConfig, device: torch.device, dtype: torch.dtype) -> TileConfig:
    """tiles with gemm_impl "auto" replaced by the kernel `gemm2.resolve_impl` picks for
    this device, dtype and y layout (and, in the shared placement, that kernel's register
    caps), so the planner's residency and the launch come from the same binary."""
    if tiles.gemm_impl == "auto":
        tiles = dataclasses.replace(tiles, gemm_impl=gemm2.resolve_impl(
            "auto", device, dtype, tiles.block_m, tiles.block_n, tiles.gemm_warps,
            tiles.token_major))
    # the shared placement's register caps, for the kernel just chosen (compiled only)
    return with_register_caps(tiles) if device.type == "cuda" else tiles


def prepare(x, weight, tokens_per_expert, token_index, num_tokens, topk, probs=None,
            group=None, *, comm_ctas=None, splits=None, config=None,
            expected_rows=None) -> Launch:
    """Validate, choose the backend, plan C and L, and size the workspace (no launch)."""
    note_call(group)  # (first: a call that raises below still counts, `buffer.note_call`)
    config = check_options(config, comm_ctas, splits)
    world, rank = _group_size_rank(group)
    experts = expert_count(x, weight)
    counts, counts_dev = host_counts(tokens_per_expert, x.shape[0], experts)
    padded = expected_rows is not None
    if padded and not 0 <= check_int("expected_rows", expected_rows, None) <= x.shape[0]:
        raise ValueError(f"expected_rows must lie in [0, {x.shape[0]}] (x's rows), got "
                         f"{expected_rows}")
    validate(x, weight, counts, token_index, num_tokens, topk, probs, world, padded)
    backend = resolve_backend(config.backend, x.device)
    if padded and counts is not None:  # the host knows where the padding starts
        token_index = token_index[:sum(counts)]
        padded = False  # (the rows past the table's are in no expert's: GEMM2 skips them)
    token_index = token_index.contiguous()  # the kernels index it as a flat array
    captured = capturing(x)
    if captured:
        why = capture_refusal(backend, counts) or _unprepared(group, world, x.device, backend)
        if why is not None:
            raise RuntimeError(f"gemm2_gather_rs cannot be captured in a CUDA graph here: {why}")
    if backend != "reference" and not _peer_capable(group, world):
        global _fallback_warned
        if not _fallback_warned:
            _fallback_warned = True
            warnings.warn("megatron-overlap: the group spans several hosts; peer memory "
                          "cannot reach every rank, using the reference path")
        backend = "reference"
    hidden = weight.shape[1]
    num_splits = splits if splits is not None else config.splits
    if num_splits is not None and num_splits > hidden:
        raise ValueError(f"splits ({num_splits}) must be <= hidden ({hidden})")
    if backend == "reference":  # the baseline builds its table with torch alone
        if padded:  # (device counts: it splits the rows on the host anyway)
            counts = counts_dev.tolist()
            token_index = token_index[:sum(counts)]
        table = combine_table(token_index.to(torch.int64), num_tokens, topk)
        if counts_dev is None:
            counts_dev = torch.tensor(counts, dtype=torch.int64)
        return Launch(config, backend, group, world, rank, counts,
                      to_device(counts_dev, x.device), table, None, None, {})
    if x.shape[1] * x.element_size() % 16:
        raise ValueError(f"the {backend} backend needs 16-byte rows for its tensor "
                         f"descriptors: K * itemsize = {x.shape[1]} * {x.element_size()} "
                         f"is not a multiple of 16 (K % 8 == 0 for bf16)")
    buf = OverlapBuffer.get(group, x.device, backend)
    if not captured:  # (a capture may not query events; the warm-up call checked)
        buf.check(sync=False)
    tiles = config.tiles or buf.default_tiles(config.placement)
    if tiles.gemm_impl not in ("triton", "auto") and (backend != "triton"
                                                      or x.dtype != torch.bfloat16):
        raise ValueError(f"TileConfig.gemm_impl={tiles.gemm_impl!r} is a Gluon kernel for "
                         f"bf16 on CUDA; got the {backend} backend and {x.dtype} "
                         f"(gemm_impl='triton' or 'auto' runs everywhere)")
    # token-major y where every token has its k rows here (T = M k: TP; no token has more
    # than k rows) and y's row numbers fit int32; else GEMM2's row order
    # (the rows to plan for: the counted ones, or with the counts on the device and x
    # padded, the caller's expectation)
    rows = expected_rows if padded else token_index.shape[0]
    if tiles.token_major and (expected_rows is not None or rows != num_tokens * topk
                              or num_tokens * topk >= 1 << 31):
        tiles = row_order(tiles)
    tiles = _resolved(tiles, x.device, x.dtype)
    dest = (torch.empty(token_index.shape[0], dtype=torch.int32, device=x.device)
            if tiles.token_major else None)
    # expert row / tile offsets and the combine table, in one kernel that also checks the
    # row order (with host counts it also brings the offsets to the device)
    # (the receive slots first: growing them queues copies that GatherRS depends on, which
    # must come before the event it forks from, `route`'s)
    buf.ensure(num_tokens // world, hidden, config.partial_dtype or x.dtype, captured)
    # (device counts the same way, read in place: no host sync, no torch ops)
    table, offsets, counts_dev, row_tiles, routed = buf.route(
        token_index, counts if counts is not None else to_device(counts_dev, x.device),
        tiles.block_m, num_tokens, topk, dest, padded)
    launch = Launch(config, backend, group, world, rank, counts, counts_dev, table, buf, None, {},
                    routed, captured)
    # W_comp reads only row_tiles = sum_e ceil(M_e / TM) (with host counts it came with
    # the offsets); with counts only on the device: section III-E, the T rows spread evenly.
    if counts is None:
        row_tiles = expert_row_tiles(Workload.from_total(
            tokens=num_tokens, hidden=hidden, ffn=x.shape[1], world=world, splits=1,
            total_assignments=rows, local_experts=experts).expert_counts, tiles.block_m)
    sizes = (num_tokens, hidden, x.shape[1], world)
    # rows per token this rank gathers (k under TP; about k / EP under EP, where a token's
    # other rows live on other ranks): the bytes of a communication tile. Quarters, so
    # the decisions stay cacheable.
    local_topk = round(4 * rows / num_tokens) / 4
    best = planned(buf, config, tiles, row_tiles, experts, sizes, topk, local_topk,
                   num_splits, comm_ctas if comm_ctas is not None else config.comm_ctas)
    launch.plan = best[0]
    launch.kwargs = dict(best[1], offsets=offsets, dest=dest)
    log_decision(launch, num_tokens, hidden, x.shape[1])
    return launch
