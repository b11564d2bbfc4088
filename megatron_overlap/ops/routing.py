"""The op's first stage: from the expert counts and each row's token, the routing the
kernels read (`Routing`): the expert row / tile offsets, the combine table (the rows of
each token) and, where y is token-major, each row's place in it.

Two passes over the rows (`kernels/routing_table.py`: each row marks its expert in its
token's mask, then counts the marks below it for its slot) build all of it and check the
row order as they run. By default both run before GEMM2, which reads each row's place
from the second's dest (`Routing.places`). With `TileConfig.gemm_places_from_marks`
GEMM2 counts a row's slot from the first pass's marks itself, and the op leaves the
second (the table) to the launch, on GatherRS's stream (`Routing.slots`): measured
slower on one H200, where the count's two dependent loads per tile cost GEMM2 more than
the pass it takes off its path (docs/RESULTS.md, "Where GEMM2 finds its rows").

Host counts go into the next pinned slot of a ring (`counts_ring`), which the first pass
reads in place (mapped): it sums them and writes the offsets into a fresh device tensor.
No pinned allocation, copy or prefix sum of their own on the launch path, which runs
after Megatron's sync while the GPU waits. Where the GPU cannot read pinned memory in
place the offsets are built on the host and copied (`Router.mapped_offsets`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..kernels import gemm2
from ..kernels.gemm2_layout import TokenPlaces
from ..kernels.routing_table import RoutingPasses, SlotsPass, route_rows
from ..planner import expert_row_tiles
from .counts_ring import CountsRing
from .stream_ops import StreamOps


@dataclass(frozen=True)
class Routing:
    """What the kernels read of one call's routing.

    table: [M, k] int32, the rows of each token (-1: none).
    row_start, tile_start: [E + 1] int32 device offsets of each expert's rows and tiles.
    counts_dev: [E] int32 device counts.
    row_tiles: sum_e ceil(M_e / TM), W_comp's one input (None: counts only on the device).
    dest: [T] int32, row j of GEMM2 at y[dest[j]] (token-major y), or None (row order).
    routed: an event recorded right after the routing-table kernel (None on CPU, on the
        copy path and with device counts): GatherRS's stream forks from it (valid while
        nothing GatherRS depends on is queued between the two; the op queues nothing).
    places: where GEMM2 stores each row of a token-major y: read from dest, or with
        `slots` deferred counted from the first pass's marks (None: row order).
    slots: the second pass (table, dest), not launched yet (`Router.route`'s
        `defer_slots`): the launcher queues it on GatherRS's stream, so GEMM2 starts
        after the first pass; None where `route` queued it itself.
    """

    table: torch.Tensor
    row_start: torch.Tensor
    tile_start: torch.Tensor
    counts_dev: torch.Tensor
    row_tiles: int | None
    dest: torch.Tensor | None = None
    routed: object = None
    places: TokenPlaces | None = None
    slots: SlotsPass | None = None


class Router:
    """Builds `Routing`s on one device: owns the pinned ring the host counts go through
    (one per session: `session.OverlapSession.router`)."""

    #: host offsets read in place from the ring; False copies them. An instance turns it
    #: off where the GPU cannot read pinned memory in place; the class attribute is for
    #: A/B tools and tests.
    mapped_offsets = True

    def __init__(self, device: torch.device):
        self.device = device
        self.counts_ring = CountsRing(
            device, stream_ops=StreamOps(device) if device.type == "cuda" else None)

    def route(self, token_index, counts, error, block_m: int, num_tokens: int, topk: int,
              dest=None, padded: bool = False, defer_slots: bool = False) -> Routing:
        """The routing of one call. `counts`: host counts (a list), or an int tensor on
        this device the host never saw (the kernel reads it in place the same way;
        row_tiles is then None, for the caller to estimate; with `padded` they may sum to
        fewer than the rows, the rest being padding). `error`: the buffer's error word,
        where the kernel records bad counts or an unsorted token_index. `defer_slots`:
        leave the second pass to the launcher (`Routing.slots`)."""
        on_device = isinstance(counts, torch.Tensor)
        if on_device or self.mapped_offsets:
            found = self._route_in_place(token_index, counts, error, block_m, num_tokens,
                                         topk, dest, padded and on_device, defer_slots)
            if found is not None:
                return found
        dev, row_tiles = gemm2.packed_offsets_host(counts, block_m, self.device)
        row_start, tile_start, counts_dev = gemm2.unpack_offsets(dev, len(counts))
        passes = route_rows(token_index, row_start, num_tokens, topk, error, dest,
                            defer_slots=defer_slots)
        return _routing(passes, row_start, tile_start, counts_dev, row_tiles, token_index,
                        topk, dest, None)

    def _route_in_place(self, token_index, counts, error, block_m, num_tokens, topk, dest,
                        padded, defer_slots) -> Routing | None:
        """The routing with the counts read in place (None: the GPU cannot read pinned
        memory in place here, and `mapped_offsets` is now off)."""
        experts = len(counts)
        on_device = isinstance(counts, torch.Tensor)
        src = counts if on_device else self.counts_ring.write(counts)
        dev = torch.empty(3 * experts + 2, dtype=torch.int32, device=self.device)
        try:
            passes = route_rows(token_index, src, num_tokens, topk, error, dest,
                                from_counts=(dev, block_m), padded=padded,
                                defer_slots=defer_slots)
        except ValueError as err:  # raised by the launcher before anything is queued
            if on_device or "cannot be accessed" not in str(err):
                raise
            self.mapped_offsets = False
            warnings.warn(f"megatron-overlap: the GPU cannot read pinned host memory in "
                          f"place here ({err}); the expert offsets are copied instead",
                          RuntimeWarning, stacklevel=4)
            return None
        row_start, tile_start, counts_dev = gemm2.unpack_offsets(dev, experts)
        return _routing(passes, row_start, tile_start, counts_dev,
                        None if on_device else expert_row_tiles(counts, block_m), token_index,
                        topk, dest, None if on_device else self.counts_ring.record())


def _routing(passes: RoutingPasses, row_start, tile_start, counts_dev, row_tiles,
             token_index, topk: int, dest, routed) -> Routing:
    # GEMM2 reads each row's place from dest where the second pass runs before it, and
    # counts it from the marks where that pass is deferred (`TokenPlaces`)
    places = (None if dest is None
              else TokenPlaces(token_index, passes.marks, passes.words, topk,
                               dest if passes.slots is None else None))
    return Routing(passes.table, row_start, tile_start, counts_dev, row_tiles, dest, routed,
                   places, passes.slots)
