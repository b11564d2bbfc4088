"""The reduce-scatter group as the op sees it: its size and this rank's place, whether
peer memory can reach every rank, and so which backend runs a call. The session asks
the group once, at its setup (`session.OverlapSession`): a query per call would be host
time on the launch path, and the hosts' check is a collective."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from .config import OverlapConfig, resolve_backend
from .validation import capture_refusal


def group_size_rank(group) -> tuple[int, int]:
    """(size, rank) of the group; (1, 0) for None or without torch.distributed."""
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def hosts_agree(group, world: int) -> bool:
    """True when every rank of the group is on this host (peer memory can work).
    Collective where world > 1: every rank of the group calls it together."""
    if world == 1:
        return True
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return len(set(hosts)) == 1


def call_backend(config: OverlapConfig, x, counts, peer_capable: bool, prepared,
                 captured: bool) -> str:
    """The backend that runs the call: the config's, resolved for x's device; the
    reference where peer memory cannot reach every rank (`peer_capable`). Refuses a
    capture (`captured`: x is being captured into a CUDA graph) that could not replay
    (RuntimeError); `prepared`: the backends whose buffer an eager call of the session
    set up (peer memory is a collective allocation, which a capture cannot make)."""
    backend = resolve_backend(config.backend, x.device)
    if captured:
        why = capture_refusal(backend, counts) or (
            None if backend in prepared else
            "this group's first call sets up peer memory with collectives; make one eager "
            "call (of the largest shapes) before capturing")
        if why is not None:
            raise RuntimeError(f"gemm2_gather_rs cannot be captured in a CUDA graph here: {why}")
    return backend if peer_capable else "reference"


def check_device(device=None) -> torch.device:
    """`device` as a torch.device with its index (the current CUDA device for "cuda");
    None: the current CUDA device, else the CPU."""
    device = torch.device(device if device is not None else
                          "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
