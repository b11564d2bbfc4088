"""Test-only redirection of the CUDA-only call sites Megatron-Core hits on CPU/gloo.

Never imported by the package (docs/DESIGN.md "Testing on CPU"). `install()` is idempotent and
must run in each worker process before a Megatron model is built:
- `torch.cuda.current_device()` (router gating, global memory buffer, all-gather outputs)
  returns "cpu", which every one of those call sites passes as a device;
- the CUDA RNG tracker keeps CPU generator states instead (its `add` / `fork`), so
  Megatron's model-parallel seeding and dropout forks run on the CPU generator;
- the default causal mask of local attention (built with device="cuda") is built on CPU;
- `torch.cuda.Stream` / `Event` become inert stand-ins (the alltoall dispatcher and shared
  expert overlap create them; the allgather path does not need them).
The all_to_all split-size shim docs/DESIGN.md mentions is for the alltoall dispatcher, which
these tests do not run.

The prefill launcher takes it with `--preload tests/mcore_shims.py` for CPU demos.
"""

from __future__ import annotations

import contextlib
import functools

import torch

_installed = False


class _InertStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args):
        pass

    def wait_event(self, *args):
        pass

    def record_event(self, *args):
        return _InertEvent()

    def synchronize(self):
        pass


class _InertEvent(_InertStream):
    def record(self, *args):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def install() -> None:
    """Redirect the CUDA-only call sites (no-op when CUDA is available or already done)."""
    global _installed
    if _installed or torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.Stream = _InertStream
    torch.cuda.Event = _InertEvent
    torch.cuda.current_stream = lambda *a, **k: _InertStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()

    def add(self, name, seed):
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

    mrandom.CudaRNGStatesTracker.add = add
    mrandom.CudaRNGStatesTracker.fork = fork

    from megatron.core.fusions import fused_softmax

    @functools.lru_cache(maxsize=32)
    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    fused_softmax.get_default_causal_mask = causal_mask  # bound by name at its import
    _installed = True


def install_megatron_training() -> None:
    """Let `megatron.training` (Megatron-LM's argument parser and builders, shipped in the
    megatron-core 0.19 wheel) import on Python 3.11 and validate its arguments on CPU.

    - `typing.override` (new in 3.12; megatron.training.models imports it) becomes
      `typing_extensions.override` where it is missing. Why a shim and not a 3.12 venv: the
      wheel declares Python >= 3.12 and users and the device run 3.12, but this CI's CPU
      torch on disk is cp311 only and a 3.12 venv downloads the multi-GB CUDA build of
      torch on every fresh CI machine; `override` is a decorator that only marks a method
      (it returns it unchanged, in 3.12 too), so 3.11 runs the same code.
    - Without CUDA, what validate_args asks of the GPU answers as an H200 would:
      `torch.cuda.get_device_capability` (for `--moe-grouped-gemm`) (9, 0), its
      `get_device_arch_version` (for TP > 1) 9.
    Nothing else megatron.training imports fails on CPU/3.11 (checked: arguments,
    argument_utils, models.gpt, global_vars, training).
    """
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override
    if not torch.cuda.is_available():
        from megatron.training import arguments

        torch.cuda.get_device_capability = lambda device=None: (9, 0)
        arguments.get_device_arch_version = lambda: 9  # (bound by name at its import)
