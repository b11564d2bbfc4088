"""The fused path's allgather dispatcher: Megatron's, with a postprocess that syncs the
host once instead of three times, or not before FC1 is queued.

Megatron-Core 0.19's `MoEAllGatherTokenDispatcher.dispatch_postprocess` synchronizes
the host three times per layer: `tokens_per_expert.cpu()`, then a `masked_select` in
`permute` and another for the permuted probabilities, each of which must learn its
output size from the GPU. After each, the GPU idles until the host has run the Python
that launches the next kernel (a torch.profiler trace of the layer: 1.0-1.3 ms of idle
GPU per layer at S = 4096-16384 on one H200). The counts come to the host anyway (the experts
and the op need them), and they give both selections their size: `nonzero_static` with
that size needs no sync (`single_sync_postprocess`). Same rows, same order, same bits
as Megatron's (`permute` selects from the [experts, tokens] transposed map in row-major
order: expert-major, token-ascending).

Where the number of rows is known without the counts, or (in inference) bounded without
them, `deferred_postprocess` permutes without waiting: every expert on the rank (EP = 1)
and no token dropped gives M x top-k rows; under EP the rows are at most M x min(top-k,
local experts), and in inference (no backward to keep the padding out of) the
permutation is sized by that bound, the real rows copied by `gather_rows` (the device
knows their count), the rest left as padding. The counts travel to the host by an
asynchronous copy (`Deferred`), FC1 runs on device offsets, and the host waits for that
copy only when the fused op needs the counts (`settle`, which trims the padding), with
FC1 and the activation already queued. Where every expert is local, or the rows are
padded, the op may take the counts on the device instead (`permuted_on_device`): no
copy, no wait, no host sync in the layer at all.

Why OverlapMoELayer installs this class and no spec does: megatron-core 0.19.2's
`MoESubmodules` has builders for the experts, the shared experts and the router only;
`MoELayer.__init__` builds the dispatcher itself from `config.moe_token_dispatcher_type`
and offers no hook for another class. This class adds methods and no state, so
OverlapMoELayer, after Megatron's __init__ built the dispatcher (with the process groups
Megatron handed the layer, `pg_collection`), gives that same object this class, where it
is exactly `MoEAllGatherTokenDispatcher` (not the inference dispatchers that subclass it)
and the fused path is supported: elsewhere the dispatcher stays Megatron's own. This class
overrides none of Megatron's methods, so the stock
path (overlap off, a size the planner leaves stock) runs Megatron's `dispatch_postprocess`
and combine unchanged; only the fused path calls the methods below, and each leaves the
dispatcher's state as Megatron's postprocess leaves it. What the op reads of a dispatch
comes back as one `Permuted`; the layer writes no attribute of the dispatcher.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from ..ops import gather_rows, interpreting, permute_rows

#: Pad the permutation to a bound only while the bound is at most this many times the
#: rows a uniform routing gives (EP x min(top-k, local experts) / top-k): beyond it the
#: padding's memory outweighs one host sync (the single-sync postprocess runs instead).
MAX_PADDING = 4


def rows_bound(num_tokens: int, topk: int, local: int, experts: int) -> int | None:
    """The rows `deferred_postprocess` pads the permutation to under EP (M x min(top-k,
    local experts)), or None where that exceeds MAX_PADDING x a uniform routing's."""
    bound = num_tokens * min(topk, local)
    if bound > MAX_PADDING * math.ceil(num_tokens * topk * local / experts):
        return None
    return bound


@dataclass
class Permuted:
    """One dispatch's rows as the fused op reads them (`gemm2_gather_rs`).

    rows [R, H], probs [R]: expert-major, token-ascending (Megatron's permute order);
    rows None where they were never gathered (the grouped FP8 path gathers while it
    quantizes: `Deferred.source`).
    counts [E]: rows per local expert, CPU int64 or on the device; on the device R may
    exceed their sum (padding, which the op skips). num_tokens: M, the gathered tokens.
    group: the TP x EP group the op reduce-scatters over. expected_rows: with padded
    device counts, a uniform routing's rows (for the op's plan); else None.
    """

    rows: torch.Tensor | None
    counts: torch.Tensor
    probs: torch.Tensor
    num_tokens: int
    group: object
    expected_rows: int | None = None
    _token_index: torch.Tensor | None = field(default=None, repr=False)
    _local_map: torch.Tensor | None = field(default=None, repr=False)

    @property
    def token_index(self) -> torch.Tensor:
        """[R] int64: the gathered token of each row."""
        if self._token_index is None:
            # TE's fused permute keeps a row-id map, not the token of each row: rebuild the
            # expert-major, token-ascending order it permuted in (a host sync: read late,
            # once FC1 is queued)
            self._token_index = self._local_map.T.nonzero()[:, 1]
        return self._token_index


class Deferred:
    """A postprocess whose host counts are still on their way (`deferred_postprocess`).

    permuted [R, H], probs [R]: R = the bound of the rows; the first `sum(counts)` are the
    real ones (all R unless a token has fewer rows than the bound allows). counts_dev:
    [E] on the device. padded: may rows past the real ones be trimmed (no gradient
    flows through them)? valid_rows: the counts' sum on the device where the bound
    exceeds the rows by design (EP), so that the work on the padding can be skipped.
    host_copy: is a copy of the counts to the host queued (False: they are meant to stay
    on the device)? token_index [R]: each row's token. permuted is None where the rows
    were not gathered (`gather=False`: the grouped FP8 path quantizes while gathering,
    from `source`, the tokens before the permutation); then the counts stay on the
    device and nothing is trimmed."""

    def __init__(self, permuted, probs, counts_dev, routing_map, padded=False,
                 valid_rows=None, host_copy=True, token_index=None, source=None):
        self.permuted, self.probs, self.counts_dev = permuted, probs, counts_dev
        self.token_index, self.source = token_index, source
        self.bound = token_index.shape[0] if permuted is None else permuted.shape[0]
        self.padded, self.valid_rows, self.host_copy = padded, valid_rows, host_copy
        self.routing_map = routing_map  # kept for a redo: the dispatcher drops its own
        self._host = self._ready = None
        if host_copy:
            self._copy()

    def _copy(self) -> None:
        if self.counts_dev.is_cuda:
            self._host = torch.empty(self.counts_dev.shape, dtype=torch.int64, pin_memory=True)
            self._host.copy_(self.counts_dev, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = self.counts_dev.clone()

    def tokens_per_expert(self) -> torch.Tensor:
        """The counts on the host (CPU int64 [E]): waits for their copy only (queued
        now where none was queued up front)."""
        if self._host is None:
            self._copy()
        if self._ready is not None:
            self._ready.synchronize()
        return self._host


class OverlapAllGatherDispatcher(MoEAllGatherTokenDispatcher):
    """Megatron's allgather dispatcher plus the fused path's postprocesses (module doc).

    Megatron's allgather dispatcher object, its class swapped by OverlapMoELayer; Megatron's
    methods are inherited untouched, and no state is added (module doc)."""

    def single_sync_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """`dispatch_postprocess` (non-fused permute) with one host sync: the same
        (permuted hidden [T, H], tokens_per_expert (CPU int64 [E]), permuted probs [T])
        and the same state (`local_map`, `local_probs`, the permutation)."""
        self.hidden_shape_before_permute = hidden_states.shape
        lo, hi = self._local_range()
        self.local_map = self.routing_map[:, lo:hi].contiguous()
        tokens_per_expert = self.local_map.sum(dim=0).long().cpu()  # the one sync
        rows = int(tokens_per_expert.sum())
        # (expert, token) of every routed row, expert-major and token-ascending
        pairs = torch.nonzero_static(self.local_map.T.contiguous(), size=rows)
        permuted = self._select(hidden_states, probs[:, lo:hi], pairs)
        return permuted, tokens_per_expert, self.local_probs

    def deferred_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor,
                             topk: int, pad: bool = False, host_copy: bool = True,
                             gather: bool = True) -> Deferred | None:
        """`single_sync_postprocess` without waiting for the host at all, where the number
        of routed rows is known without the counts (every expert on this rank, EP = 1:
        each of the M tokens has `topk` rows unless the router drops some) or, with `pad`
        (inference: no gradient flows through the padding), bounded by M x min(topk,
        local experts) and that bound at most `MAX_PADDING` times the rows a uniform
        routing gives. The counts go to the host by an asynchronous copy, unless
        `host_copy` is False (the caller means to keep them on the device); with
        `gather` False as well the rows are not gathered (the caller reads them by the
        token index from `Deferred.source`). None where neither holds, or with a
        capacity factor (Megatron then pads and drops by its own rules)."""
        lo, hi = self._local_range()
        local, experts = hi - lo, self.routing_map.shape[1]
        if self.config.moe_expert_capacity_factor or not (local == experts or pad):
            return None
        num_tokens = self.routing_map.shape[0]
        bound = rows_bound(num_tokens, topk, local, experts)
        if bound is None:
            return None
        self.hidden_shape_before_permute = hidden_states.shape
        routing_map = self.routing_map
        self.local_map = routing_map[:, lo:hi].contiguous()
        counts_dev = self.local_map.sum(dim=0)
        # where every expert is local the bound is the rows (but for a dropped token): no skip
        valid = counts_dev.sum().reshape(1) if pad and local < experts else None
        # (fill 0: the padding, or rows a token routed to fewer experts leaves, must still
        # index a row; `settle` trims them, or asks for a redo with the counts)
        pairs = torch.nonzero_static(self.local_map.T.contiguous(), size=bound, fill_value=0)
        permuted = self._select(hidden_states, probs[:, lo:hi], pairs, valid,
                                gather or host_copy)
        return Deferred(permuted, self.local_probs, counts_dev, routing_map, pad, valid,
                        host_copy, self.reversed_local_input_permutation_mapping,
                        None if permuted is not None else hidden_states)

    def permuted(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor,
                 probs: torch.Tensor, *, te_row_map: bool) -> Permuted:
        """The op's view of the postprocess just run, whose outputs are the arguments:
        `te_row_map` says which one it was, Megatron's `dispatch_postprocess` with TE's
        fused permute (its permutation mapping is TE's row-id map, not the token of each
        row) or one recording the token of each row (ours, or Megatron's unfused). Named
        by the caller, not read from `config.moe_permute_fusion`: the fused path runs its
        own postprocesses whatever that flag says."""
        return Permuted(rows, tokens_per_expert, probs, self.hidden_shape_before_permute[0],
                        self.tp_ep_group, _local_map=self.local_map if te_row_map else None,
                        _token_index=None if te_row_map else
                        self.reversed_local_input_permutation_mapping)

    def settle(self, deferred: Deferred) -> Permuted | None:
        """A deferred postprocess with its counts on the host (waits for their copy): its
        real rows, the padding trimmed here too; or None where the counts do not fit the
        bound (a router that gave some token fewer than top-k experts, where rows may
        not be padded, or more rows than the bound): the routing map is back for a redo
        by `single_sync_postprocess`."""
        if deferred.permuted is None:
            raise RuntimeError("a deferred permutation left ungathered (its rows read by "
                               "the grouped FP8 quantization) has no rows to trim")
        counts = deferred.tokens_per_expert()
        rows, bound = int(counts.sum()), deferred.permuted.shape[0]
        if not (rows == bound or (deferred.padded and rows < bound)):
            self.routing_map = deferred.routing_map
            return None
        self.local_probs = deferred.probs[:rows]
        self.reversed_local_input_permutation_mapping = (
            self.reversed_local_input_permutation_mapping[:rows])
        return self.permuted(deferred.permuted[:rows], counts, self.local_probs,
                             te_row_map=False)

    def permuted_on_device(self, deferred: Deferred) -> Permuted:
        """A deferred postprocess as the op takes it with the counts on the device: every
        row of the bound, and under EP the rows a uniform routing gives (its plan)."""
        num_tokens, bound = self.hidden_shape_before_permute[0], deferred.bound
        local, experts = len(self.local_expert_indices), self.config.num_moe_experts
        expected = None
        if local != experts:
            expected = min(bound, num_tokens * self.router_topk * local // experts)
        return Permuted(deferred.permuted, deferred.counts_dev, deferred.probs, num_tokens,
                        self.tp_ep_group, expected,
                        _token_index=self.reversed_local_input_permutation_mapping)

    def _local_range(self) -> tuple[int, int]:
        return self.local_expert_indices[0], self.local_expert_indices[-1] + 1

    def _select(self, hidden_states, local_probs, pairs,
                valid: torch.Tensor | None = None, gather: bool = True) -> torch.Tensor | None:
        """The rows and probabilities of the (expert, token) `pairs`, into this state as
        Megatron's `permute` leaves it; returns the permuted hidden states (index_select's
        bits), or None without `gather` (the token of each row recorded only). `valid` (the real rows' count, on the device): only those rows are copied
        (no gradient). Without it the gradient is each token's rows summed without atomics
        (`permute_rows`): index_select's backward, `index_add_`, adds by bf16 atomics,
        19 ms of a 266 ms Granite training step at S = 16384 on an H100."""
        token_index = pairs[:, 1].contiguous()  # Megatron's sorted_indices are contiguous
        flat = pairs[:, 0] * self.local_map.shape[0] + token_index
        self.local_probs = local_probs.T.contiguous().view(-1).index_select(0, flat)
        self.reversed_local_input_permutation_mapping = token_index
        self.routing_map = None
        if not gather:
            return None
        if valid is not None and (hidden_states.is_cuda or interpreting()):
            return gather_rows(hidden_states, token_index, valid)
        return permute_rows(hidden_states, token_index)
