"""Memory every rank of a group can address: torch symmetric memory, or files on CPU.

`PeerMemory.allocate(nbytes, group)` is collective. It returns this rank's buffer as a
uint8 tensor and the address of every rank's buffer in this process's address space,
which the kernels cast to typed pointers.

* CUDA: `torch.distributed._symmetric_memory.empty` + `rendezvous`; NVLink multicast is
  never used (the environment keeps it off and we do not ask for it).
* CUDA, ranks that share a GPU (symmetric memory refuses them): CUDA IPC handles, the
  way torch.multiprocessing shares CUDA tensors between processes; exchanged over the
  group. Two processes on one GPU run their kernels in turns (time-sliced contexts),
  which the bounded waits tolerate: slow, but it runs the whole two-rank protocol on a
  machine of one GPU (`tests/test_op_gpu.py`).
* CPU (the Triton interpreter backend): each rank creates a file under /dev/shm, every
  rank maps every file with `torch.from_file(shared=True)`; the mappings outlive the
  unlinked files. Cross-process atomics on these pages are what the interpreter's
  flag protocol needs.
"""

from __future__ import annotations

import os
import pickle
import secrets
import tempfile
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class PeerMemory:
    """One allocation per rank, addressable by all ranks of `group`."""

    def __init__(self, local: torch.Tensor, peer_ptrs: list[int], keepalive: list):
        self.local = local  # uint8, this rank's buffer
        self.peer_ptrs = peer_ptrs  # address of rank r's buffer, as seen by this process
        self._keepalive = keepalive  # mappings / handles that must outlive the pointers

    @classmethod
    def allocate(cls, nbytes: int, device: torch.device, group, rank: int,
                 world: int) -> "PeerMemory":
        if world == 1:
            local = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            return cls(local, [local.data_ptr()], [])
        if device.type == "cuda":
            if _ranks_share_a_gpu(device, group, world):
                return cls._allocate_ipc(nbytes, device, group, rank, world)
            return cls._allocate_cuda(nbytes, device, group)
        return cls._allocate_files(nbytes, group, rank, world)

    @classmethod
    def _allocate_cuda(cls, nbytes: int, device: torch.device, group) -> "PeerMemory":
        import torch.distributed._symmetric_memory as symm_mem

        local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(local, group.group_name)
        local.zero_()
        torch.cuda.synchronize(device)
        handle.barrier()
        # The barrier is a kernel: wait for it, so that every rank's device has finished
        # with any previous allocation before the caller frees it (a peer's kernel may
        # still be writing into ours until then).
        torch.cuda.synchronize(device)
        return cls(local, [int(p) for p in handle.buffer_ptrs], [handle])

    @classmethod
    def _allocate_ipc(cls, nbytes: int, device: torch.device, group, rank: int,
                      world: int) -> "PeerMemory":
        import torch.multiprocessing  # noqa: F401 - registers the CUDA tensor reducers

        local = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)
        blobs = [None] * world
        dist.all_gather_object(blobs, bytes(ForkingPickler.dumps(local)), group=group)
        peers = [local if r == rank else pickle.loads(b) for r, b in enumerate(blobs)]
        dist.barrier(group=group)  # every rank mapped every buffer
        return cls(local, [t.data_ptr() for t in peers], peers)

    @classmethod
    def _allocate_files(cls, nbytes: int, group, rank: int, world: int) -> "PeerMemory":
        token = [secrets.token_hex(8) if rank == 0 else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
        paths = [os.path.join(_shm_dir(), f"megatron-overlap-{token[0]}-{r}") for r in range(world)]
        with open(paths[rank], "wb") as f:
            f.truncate(nbytes)  # zero-filled
        dist.barrier(group=group)
        maps = [torch.from_file(p, shared=True, size=nbytes, dtype=torch.uint8) for p in paths]
        dist.barrier(group=group)  # everyone mapped every file
        os.unlink(paths[rank])
        return cls(maps[rank], [m.data_ptr() for m in maps], maps)


def _ranks_share_a_gpu(device: torch.device, group, world: int) -> bool:
    """True when two ranks of the group run on one GPU (collective)."""
    mine = (os.uname().nodename, str(torch.cuda.get_device_properties(device).uuid))
    keys = [None] * world
    dist.all_gather_object(keys, mine, group=group)
    return len(set(keys)) < len(keys)
