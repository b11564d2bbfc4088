"""The allgather dispatcher's postprocess with one host sync instead of three, or none
before FC1 is queued: the layer work around the fused op that left the GPU idle.

Megatron-Core 0.19's `MoEAllGatherTokenDispatcher.dispatch_postprocess` synchronizes
the host three times per layer: `tokens_per_expert.cpu()`, then a `masked_select` in
`permute` and another for the permuted probabilities, each of which must learn its
output size from the GPU. After each, the GPU idles until the host has run the Python
that launches the next kernel (`tools/profile_layer.py`: 1.0-1.3 ms of idle GPU per
layer at S = 4096-16384 on one H200). The counts come to the host anyway (the experts
and the op need them), and they give both selections their size: `nonzero_static` with
that size needs no sync. Same rows, same order, same bits as Megatron's (`permute`
selects from the [experts, tokens] transposed map in row-major order: expert-major,
token-ascending).

Where the number of rows is known without the counts, or (in inference) bounded without
them, `deferred_postprocess` permutes without waiting: every expert on the rank (EP = 1) and
no token dropped gives M x top-k rows; under EP the rows are at most M x min(top-k,
local experts), and in inference (no backward to keep the padding out of) the
permutation is sized by that bound, the real rows copied by `gather_rows` (the device
knows their count), the rest left as padding. The counts travel to the host by an
asynchronous copy, FC1 runs on device offsets, and the host waits for that copy only
when the fused op needs the counts, with FC1 and the activation already queued: the
sync no longer leaves the GPU idle. The caller trims the padding (`Deferred.trim`).
Where every expert is local the fused op takes the counts on the device
(`OverlapConfig.host_counts`): no copy, no wait, no host sync in the layer at all.
"""

from __future__ import annotations

import math

import torch

from ..ops import gather_rows, interpreting

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


def single_sync_postprocess(disp, hidden_states: torch.Tensor, probs: torch.Tensor):
    """`dispatch_postprocess` of an allgather dispatcher (non-fused permute) with one host
    sync: (permuted hidden [T, H], tokens_per_expert (CPU int64 [E]), permuted probs [T]),
    and the dispatcher's state (`local_map`, `local_probs`, the permutation) as Megatron
    leaves it."""
    disp.hidden_shape_before_permute = hidden_states.shape
    lo, hi = disp.local_expert_indices[0], disp.local_expert_indices[-1] + 1
    disp.local_map = disp.routing_map[:, lo:hi].contiguous()
    local_probs = probs[:, lo:hi]
    tokens_per_expert = disp.local_map.sum(dim=0).long().cpu()  # the one sync
    rows = int(tokens_per_expert.sum())
    num_tokens = disp.local_map.shape[0]
    # (expert, token) of every routed row, expert-major and token-ascending
    pairs = torch.nonzero_static(disp.local_map.T.contiguous(), size=rows)
    permuted = _select(disp, hidden_states, local_probs, pairs, num_tokens)
    return permuted, tokens_per_expert, disp.local_probs


def _select(disp, hidden_states, local_probs, pairs, num_tokens: int,
            valid: torch.Tensor | None = None) -> torch.Tensor:
    """The rows and probabilities of the (expert, token) `pairs`, into the dispatcher's
    state as Megatron's `permute` leaves it; returns the permuted hidden states. `valid`
    (the real rows' count, on the device): only those rows are copied (no gradient)."""
    token_index = pairs[:, 1].contiguous()  # Megatron's sorted_indices are contiguous
    flat = pairs[:, 0] * num_tokens + token_index
    disp.local_probs = local_probs.T.contiguous().view(-1).index_select(0, flat)
    disp.reversed_local_input_permutation_mapping = token_index
    disp.routing_map = None
    if valid is not None and (hidden_states.is_cuda or interpreting()):
        return gather_rows(hidden_states, token_index, valid)
    return hidden_states.index_select(0, token_index)


class Deferred:
    """A postprocess whose host counts are still on their way (`deferred_postprocess`).

    permuted [R, H], probs [R]: R = the bound of the rows; the first `sum(counts)` are the
    real ones (all R unless a token has fewer rows than the bound allows). counts_dev:
    [E] on the device. padded: may the caller trim rows past the real ones (no gradient
    flows through them)? valid_rows: the counts' sum on the device where the bound
    exceeds the rows by design (EP), so that the work on the padding can be skipped."""

    def __init__(self, permuted, probs, counts_dev, routing_map, padded=False,
                 valid_rows=None, host_copy=True):
        self.permuted, self.probs, self.counts_dev = permuted, probs, counts_dev
        self.padded, self.valid_rows = padded, valid_rows
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
        now where the caller asked for none up front)."""
        if self._host is None:
            self._copy()
        if self._ready is not None:
            self._ready.synchronize()
        return self._host

    def trim(self, disp, rows: int) -> None:
        """Keep the first `rows` rows (the real ones) in the dispatcher's state too."""
        self.permuted, self.probs = self.permuted[:rows], self.probs[:rows]
        disp.local_probs = self.probs
        disp.reversed_local_input_permutation_mapping = (
            disp.reversed_local_input_permutation_mapping[:rows])


def deferred_postprocess(disp, hidden_states: torch.Tensor, probs: torch.Tensor,
                         topk: int, pad: bool = False, host_copy: bool = True
                         ) -> Deferred | None:
    """`single_sync_postprocess` without waiting for the host at all, where the number of
    routed rows is known without the counts (every expert on this rank, EP = 1: each of
    the M tokens has `topk` rows unless the router drops some) or, with `pad` (inference:
    no gradient flows through the padding), bounded by M x min(topk, local experts) and
    that bound at most `MAX_PADDING` times the rows a uniform routing gives. The counts go
    to the host by an asynchronous copy; whoever needs them on the host waits for that
    copy alone (`Deferred.tokens_per_expert`), after queuing the work that does not (FC1
    with device offsets, the activation). None where neither holds, or with a capacity
    factor (Megatron then pads and drops by its own rules). `host_copy` False: the caller
    means to keep the counts on the device, so no copy to the host is queued up front."""
    lo, hi = disp.local_expert_indices[0], disp.local_expert_indices[-1] + 1
    local, experts = hi - lo, disp.routing_map.shape[1]
    if disp.config.moe_expert_capacity_factor or not (local == experts or pad):
        return None
    num_tokens = disp.routing_map.shape[0]
    bound = rows_bound(num_tokens, topk, local, experts)
    if bound is None:
        return None
    disp.hidden_shape_before_permute = hidden_states.shape
    routing_map = disp.routing_map
    disp.local_map = routing_map[:, lo:hi].contiguous()
    counts_dev = disp.local_map.sum(dim=0)
    # where every expert is local the bound is the rows (but for a dropped token): no skip
    valid = counts_dev.sum().reshape(1) if pad and local < experts else None
    # (fill 0: the padding, or rows a token routed to fewer experts leaves, must still
    # index a row; the caller trims them, or redoes this with the counts)
    pairs = torch.nonzero_static(disp.local_map.T.contiguous(), size=bound, fill_value=0)
    permuted = _select(disp, hidden_states, probs[:, lo:hi], pairs, num_tokens, valid)
    return Deferred(permuted, disp.local_probs, counts_dev, routing_map, pad, valid,
                    host_copy)
