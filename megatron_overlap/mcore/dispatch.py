"""The allgather dispatcher's postprocess with one host sync instead of three, and the
shared experts on a side stream: the layer work around the fused op that leaves the GPU
idle.

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

Shared experts (Qwen, DeepSeek) run first in `MoELayer.forward`, on the same stream as
the router, so each of those syncs also waits for them. On a side stream (forked after
the layer's input is ready, joined before the fused op and before their output is
added) they run through the syncs and the host work after them instead.
"""

from __future__ import annotations

import torch

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


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
    token_index = pairs[:, 1].contiguous()  # Megatron's sorted_indices are contiguous
    permuted = hidden_states.index_select(0, token_index)
    flat = pairs[:, 0] * num_tokens + token_index
    disp.local_probs = local_probs.T.contiguous().view(-1).index_select(0, flat)
    disp.reversed_local_input_permutation_mapping = token_index
    disp.routing_map = None
    return permuted, tokens_per_expert, disp.local_probs


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for the shared experts (created on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def on_side_stream(fn, hidden_states: torch.Tensor):
    """(fn(hidden_states) queued on the side stream, the event its output is ready at).
    The side stream first waits for what the current stream has queued (the input)."""
    main = torch.cuda.current_stream(hidden_states.device)
    side = side_stream(hidden_states.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out = fn(hidden_states)
        ready = torch.cuda.Event()
        ready.record(side)
    # the caching allocator must not hand these blocks to the other stream too early
    hidden_states.record_stream(side)
    if out is not None:
        out.record_stream(main)
    return out, ready
