"""Pinned staging slots for the op's one small host-to-device copy per call.

The expert offsets (`gemm2.offsets_array`, a few hundred bytes) go to the GPU after
Megatron's host sync, while the GPU waits for GEMM2. `tensor.pin_memory().to(device)`
allocates a pinned block per call from torch's caching host allocator and copies into
it: 67 us of the ~320 us before the GEMM2 launch on H200 (`tools/host_steps.py`,
docs/RESULTS.md). Here a few pinned slots are allocated once and reused in turn: the
host writes a slot with one memmove and queues one copy from it.

Reuse is safe: the copy engine reads a slot only when the copy runs on the stream, so an
event recorded behind each copy must have completed before the host writes that slot
again (it waits for it if not: with a host sync per layer, as in Megatron, it never has
to; a loop of calls without a sync can run at most `slots` copies ahead).
"""

from __future__ import annotations

import ctypes
from array import array

import torch


class PinnedStaging:
    """Round-robin pinned int32 slots with an event behind each slot's last copy."""

    def __init__(self, device: torch.device, slots: int = 4, capacity: int = 1024,
                 event_factory=None):
        if slots < 1 or capacity < 1:
            raise ValueError(f"PinnedStaging needs slots >= 1 and capacity >= 1, got "
                             f"{slots}, {capacity}")
        self.device = device
        self._capacity = capacity
        self._slots: list[torch.Tensor | None] = [None] * slots
        self._pin = device.type == "cuda"
        make = event_factory or torch.cuda.Event  # (tests pass a stand-in on CPU)
        self._events = [make() for _ in range(slots)]
        self._used = [False] * slots  # an event was recorded behind the slot's last copy
        self._next = 0

    def upload(self, values: array) -> torch.Tensor:
        """A new int32 device tensor holding `values`, queued on the current stream."""
        if values.typecode != "i" or values.itemsize != 4:
            raise ValueError(f"PinnedStaging uploads int32 arrays, got typecode "
                             f"{values.typecode!r}")
        n = len(values)
        i = self._next
        self._next = (i + 1) % len(self._slots)
        if self._used[i] and not self._events[i].query():
            self._events[i].synchronize()  # the copy out of this slot has not run yet
        slot = self._slots[i]
        if slot is None or slot.numel() < n:
            self._capacity = max(self._capacity, n)
            slot = self._slots[i] = torch.empty(self._capacity, dtype=torch.int32,
                                                pin_memory=self._pin)
        if n:
            ctypes.memmove(slot.data_ptr(), values.buffer_info()[0], 4 * n)
        out = torch.empty(n, dtype=torch.int32, device=self.device)
        out.copy_(slot[:n], non_blocking=True)
        self._events[i].record()
        self._used[i] = True
        return out
