"""A ring of pinned slots for the host's expert counts, read by the GPU in place.

The op runs after Megatron's host sync while the GPU waits, so bringing the counts to
the device must cost the host as little as possible: no pinned allocation and no copy
per call. Each call writes its counts into the next slot (a `memmove` of E int32), and
the routing-table kernel reads that slot in place: pinned memory is mapped into the
device's address space on UVA systems (every 64-bit CUDA process). A slot is written
again only after the event recorded behind its reader has completed; the host waits on
it only when it runs a whole ring ahead of the GPU.
"""

from __future__ import annotations

import ctypes
from array import array

import torch

from .stream_ops import StreamOps

#: Slots in the ring: calls the host may run ahead of the GPU before it waits.
OFFSET_SLOTS = 16


class CountsRing:
    """Pinned int32 slots written round robin (plain host memory on CPU, no events)."""

    def __init__(self, device: torch.device, slots: int | None = None, stream_ops=None):
        self.device = device
        # the event records (the buffer's, shared; one of its own otherwise)
        self.stream_ops = stream_ops or (StreamOps(device) if device.type == "cuda" else None)
        self.slots = slots or OFFSET_SLOTS
        self._ring: torch.Tensor | None = None
        self._views: dict[tuple, torch.Tensor] = {}
        self._next = 0
        self._events = ([torch.cuda.Event() for _ in range(self.slots)]
                        if device.type == "cuda" else None)

    def write(self, counts) -> torch.Tensor:
        """The next slot's [E] view, holding `counts` (free to write: its last reader ran)."""
        experts = len(counts)
        if self._ring is None or self._ring.shape[1] < experts:
            if self._ring is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # kernels may still read the old ring
            self._ring = torch.empty((self.slots, -(-experts // 4) * 4), dtype=torch.int32,
                                     pin_memory=self.device.type == "cuda")
            self._views.clear()
        i = self._next = (self._next + 1) % self.slots
        if self._events is not None and not self._events[i].query():
            self._events[i].synchronize()  # the host is a whole ring ahead
        view = self._views.get((i, experts))
        if view is None:
            view = self._views[(i, experts)] = self._ring[i, :experts]
        host = array("i", counts)
        ctypes.memmove(view.data_ptr(), host.buffer_info()[0], 4 * experts)
        return view

    def record(self):
        """Record the latest slot's event on the current stream, behind its reader
        (None on CPU); `launcher.launch` also forks GatherRS's stream from it."""
        if self._events is None:
            return None
        event = self._events[self._next]
        self.stream_ops.record(event)
        return event
