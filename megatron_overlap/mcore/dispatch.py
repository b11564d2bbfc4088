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

Where every expert is on the rank (EP = 1) and no token is dropped, the rows number
M x top-k, known without the counts: `deferred_postprocess` then permutes without
waiting, the counts travel to the host by an asynchronous copy, FC1 runs on device
offsets, and the host waits for that copy only when the fused op needs the counts,
with FC1 and the activation already queued: the sync no longer leaves the GPU idle.
"""

from __future__ import annotations

import torch


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


def _select(disp, hidden_states, local_probs, pairs, num_tokens: int) -> torch.Tensor:
    """The rows and probabilities of the (expert, token) `pairs`, into the dispatcher's
    state as Megatron's `permute` leaves it; returns the permuted hidden states."""
    token_index = pairs[:, 1].contiguous()  # Megatron's sorted_indices are contiguous
    flat = pairs[:, 0] * num_tokens + token_index
    disp.local_probs = local_probs.T.contiguous().view(-1).index_select(0, flat)
    disp.reversed_local_input_permutation_mapping = token_index
    disp.routing_map = None
    return hidden_states.index_select(0, token_index)


class Deferred:
    """A postprocess whose host counts are still on their way (`deferred_postprocess`)."""

    def __init__(self, permuted, probs, counts_dev, routing_map):
        self.permuted, self.probs, self.counts_dev = permuted, probs, counts_dev
        self.routing_map = routing_map  # kept for a redo: the dispatcher drops its own
        if counts_dev.is_cuda:
            self._host = torch.empty(counts_dev.shape, dtype=torch.int64, pin_memory=True)
            self._host.copy_(counts_dev, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = counts_dev.clone(), None

    def tokens_per_expert(self) -> torch.Tensor:
        """The counts on the host (CPU int64 [E]): waits for their copy only."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host


def deferred_postprocess(disp, hidden_states: torch.Tensor, probs: torch.Tensor,
                         topk: int) -> Deferred | None:
    """`single_sync_postprocess` without waiting for the host at all, where the number of
    routed rows is known without the counts: every expert is on this rank (EP = 1) and
    the router drops no tokens, so each of the M tokens has exactly `topk` rows. The
    counts go to the host by an asynchronous copy; whoever needs them on the host waits
    for that copy alone (`Deferred.tokens_per_expert`), after queuing the work that does
    not (FC1 with device offsets, the activation). None where the size is not known."""
    lo, hi = disp.local_expert_indices[0], disp.local_expert_indices[-1] + 1
    if hi - lo != disp.routing_map.shape[1] or disp.config.moe_expert_capacity_factor:
        return None
    disp.hidden_shape_before_permute = hidden_states.shape
    routing_map = disp.routing_map
    disp.local_map = routing_map.contiguous()
    num_tokens = disp.local_map.shape[0]
    counts_dev = disp.local_map.sum(dim=0)
    # (fill 0: were a token routed to fewer experts, the padding must still index a row;
    # the caller sees the counts disagree and redoes this with them)
    pairs = torch.nonzero_static(disp.local_map.T.contiguous(), size=num_tokens * topk,
                                 fill_value=0)
    permuted = _select(disp, hidden_states, probs, pairs, num_tokens)
    return Deferred(permuted, disp.local_probs, counts_dev, routing_map)
