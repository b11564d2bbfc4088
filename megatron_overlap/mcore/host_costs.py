"""What a forward (or training step) costs the host per MoE layer call: its host syncs
and its host microseconds, so that the fused path can be held to the stock one's.

A sync is counted where the host waits for the GPU: every synchronizing CUDA call
torch's sync debug mode reports (`.cpu()`, `.tolist()`, `.item()` of a CUDA tensor,
a stream synchronize) plus the layers' waits for their expert counts
(`Deferred.tokens_per_expert`, an event synchronize the debug mode does not see). Each
sync is attributed to the MoE layer forward it happened in, or to the rest of the step
(the backward, the loss). Host microseconds per call: from entering an MoE layer's
forward to leaving it, on the host clock, with no synchronize around it; for a layer
that syncs this includes its wait for the GPU (the time the host cannot queue ahead).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
import warnings

import torch

from . import dispatch
from .convert import overlap_layers


@dataclasses.dataclass(frozen=True)
class HostCosts:
    """One step's host costs: `calls` MoE layer forwards, the syncs inside them per call,
    the step's syncs in all (MoE forwards and the rest), the median host us per call."""

    calls: int
    syncs_per_call: float
    step_syncs: int
    host_us_per_call: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Counter:
    """Sync and host-clock bookkeeping while a step runs (hooks on every MoE layer)."""

    def __init__(self):
        self.caught: list = []      # the sync debug mode's warnings, in order
        self.waits = 0              # Deferred.tokens_per_expert calls
        self.inside = 0             # syncs seen inside MoE layer forwards
        self.durations: list[float] = []
        self._entered = None

    def syncs(self) -> int:
        return sum("synchroniz" in str(w.message) for w in self.caught) + self.waits

    def enter(self, module, inputs) -> None:
        self._entered = (self.syncs(), time.perf_counter())

    def leave(self, module, inputs, output) -> None:
        if self._entered is None:  # (a hook registered mid-forward)
            return
        syncs, t0 = self._entered
        self.durations.append((time.perf_counter() - t0) * 1e6)
        self.inside += self.syncs() - syncs
        self._entered = None


@contextlib.contextmanager
def counting(counter: _Counter):
    """Every host sync inside the block lands in `counter` (see the module docstring)."""
    real = dispatch.Deferred.tokens_per_expert

    def counted_wait(deferred):
        counter.waits += 1
        return real(deferred)

    dispatch.Deferred.tokens_per_expert = counted_wait
    cuda = torch.cuda.is_available()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            counter.caught = caught
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield counter
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
    finally:
        dispatch.Deferred.tokens_per_expert = real


def host_syncs(fn):
    """(fn(), how many times the host synchronized with the GPU during it)."""
    counter = _Counter()
    with counting(counter):
        out = fn()
    return out, counter.syncs()


def measure_host_costs(model, step) -> HostCosts:
    """Run `step()` once and count its host syncs and the MoE layers' host time (the
    model's MoE layers must be OverlapMoELayers, fused or stock as the caller set them)."""
    layers = overlap_layers(model)
    if not layers:
        raise ValueError("measure_host_costs: the model has no OverlapMoELayer")
    counter = _Counter()
    hooks = [h for layer in layers for h in (layer.register_forward_pre_hook(counter.enter),
                                             layer.register_forward_hook(counter.leave))]
    try:
        with counting(counter):
            step()
    finally:
        for h in hooks:
            h.remove()
    calls = len(counter.durations)
    return HostCosts(calls=calls, syncs_per_call=counter.inside / calls if calls else 0.0,
                     step_syncs=counter.syncs(),
                     host_us_per_call=statistics.median(counter.durations) if calls else 0.0)
