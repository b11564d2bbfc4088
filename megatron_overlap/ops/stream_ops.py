"""Event records, stream waits and the error word's copy, through the CUDA driver.

Per call the op records three events, makes two streams wait on them and copies its
int32 error word to pinned host memory, all on the host's launch path after Megatron's
sync (one record comes before GEMM2's launch). torch's `Event.record()` and
`Event.wait()` first build a Python `Stream` object for the current stream, and
`Tensor.copy_` dispatches through the operator machinery: several microseconds of host
time each, for what is one driver call. `StreamOps` makes that call itself (ctypes:
`cuEventRecord`, `cuStreamWaitEvent`, `cuMemcpyDtoHAsync`) on the same handles torch
holds (runtime events and streams are driver ones), so the order it builds on the GPU
is the same. torch's own path serves where the driver library is not there, on CPU, and
with `StreamOps.driver = False` (or an instance's `raw = False`).
"""

from __future__ import annotations

import ctypes

import torch

from ..cuda_driver import libcuda


class StreamOps:
    """Record, wait and copy on one CUDA device (`raw`: through the driver)."""

    #: through the driver where it is there (False: torch's calls, for A/B runs and
    #: tests; read when a StreamOps is made)
    driver = True

    def __init__(self, device: torch.device):
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        lib = libcuda() if device.type == "cuda" else None
        self.raw = lib is not None and self.driver
        if lib is not None:
            self._record = lib.cuEventRecord
            self._record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            self._wait = lib.cuStreamWaitEvent
            self._wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
            self._copy = lib.cuMemcpyDtoHAsync_v2
            self._copy.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t,
                                   ctypes.c_void_p]

    def _stream(self, stream) -> int:
        return (stream.cuda_stream if stream is not None
                else torch._C._cuda_getCurrentRawStream(self.index))

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: CUresult {rc}")

    def record(self, event: torch.cuda.Event, stream=None) -> None:
        """`event.record(stream or the current stream)`."""
        handle = event.cuda_event
        if not self.raw or not handle:  # (torch creates an event at its first record)
            event.record(stream)
            return
        self._check(self._record(handle, self._stream(stream)), "cuEventRecord")

    def wait(self, event: torch.cuda.Event, stream=None) -> None:
        """`(stream or the current stream).wait_event(event)`, for a recorded event."""
        if not self.raw or not event.cuda_event:
            (stream or torch.cuda.current_stream(self.index)).wait_event(event)
            return
        self._check(self._wait(self._stream(stream), event.cuda_event, 0), "cuStreamWaitEvent")

    def copy_to_host(self, pinned: torch.Tensor, src: torch.Tensor) -> None:
        """`pinned.copy_(src, non_blocking=True)` on the current stream: a contiguous
        device tensor into a pinned host tensor of the same size and dtype."""
        if not self.raw:
            pinned.copy_(src, non_blocking=True)
            return
        self._check(self._copy(pinned.data_ptr(), src.data_ptr(),
                               src.numel() * src.element_size(), self._stream(None)),
                    "cuMemcpyDtoHAsync")
