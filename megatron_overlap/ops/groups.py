"""The reduce-scatter group as the op sees it: its size and this rank's place (remembered:
two torch.distributed queries per call are host time on the launch path), whether peer
memory can reach every rank, and so which backend runs a call."""

from __future__ import annotations

import socket
import warnings

import torch
import torch.distributed as dist

from .buffer import OverlapBuffer
from .config import OverlapConfig, resolve_backend
from .validation import capture_refusal

_group_sizes: dict[int, tuple] = {}


def group_size_rank(group) -> tuple[int, int]:
    """(size, rank) of the group; remembered (two torch.distributed queries per call
    are host time on the launch path). The entry holds the group, so its id stays its."""
    if group is None or not dist.is_initialized():
        return 1, 0
    hit = _group_sizes.get(id(group))
    if hit is None or hit[0] is not group:
        hit = _group_sizes[id(group)] = (group, dist.get_world_size(group),
                                         dist.get_rank(group))
    return hit[1], hit[2]


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
        hosts = [None] * world
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        known = _peer_capable_cache[id(group)] = len(set(hosts)) == 1
    return known


def _unprepared(group, world: int, device: torch.device, backend: str) -> str | None:
    """What a capture would have to set up on the host (None: an eager call of this group
    did it): the ranks' hosts, gathered by a collective, and the buffer (its peer memory
    is a collective allocation)."""
    if (world > 1 and id(group) not in _peer_capable_cache) or not OverlapBuffer.exists(
            group, device, backend):
        return ("this group's first call sets up peer memory with collectives; make one "
                "eager call (of the largest shapes) before capturing")
    return None


def call_backend(config: OverlapConfig, x, counts, group, world: int, captured: bool) -> str:
    """The backend that runs the call: the config's, resolved for x's device; the
    reference where peer memory cannot reach every rank. Refuses a capture (`captured`:
    x is being captured into a CUDA graph) that could not replay (RuntimeError)."""
    backend = resolve_backend(config.backend, x.device)
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
    return backend
