"""Launch a Triton kernel through the binary of an earlier launch with the same specialization.

Triton's `kernel[grid](*args)` binds and specializes every argument on every call: 17 us
of host time for a five-argument kernel on the H200 machines, against 10 us through the
compiled kernel (measured on the H200 machines' host), and more for the 27 arguments of
GatherRS. The op makes four launches per call right after Megatron's host sync, while
the GPU waits for them, so that time is latency.

`LaunchCache(kernel)` keeps the compiled kernel of every specialization it has seen,
keyed by a superset of what Triton specializes on: each tensor's dtype and 16-byte
alignment, the exact value of every specialized integer, the i32 / i64 range of the
others, and for tensor descriptors their dtype, block shape, strides, alignment and
shapes' divisibility by 16, plus every constexpr and launch option. A miss compiles
through Triton (`kernel.warmup`, so a first launch never waits inside a launch for the
JIT) and then launches the binary it got; under `TRITON_INTERPRET=1`, or with
`LaunchCache.fast = False` (tests comparing the two paths' bits), every launch goes
through `kernel[grid]` unchanged.
"""

from __future__ import annotations

import torch
import triton
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import cuda_driver

try:  # Gluon's descriptor also carries its shared-memory layout, part of the key
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
except ImportError:  # a Triton without Gluon
    GluonDescriptor = ()


def _int_class(v: int) -> str:
    """The type Triton gives an unspecialized integer argument."""
    if -(1 << 31) <= v < (1 << 31):
        return "i32"
    return "i64" if -(1 << 63) <= v < (1 << 63) else "u64"


#: Triton versions whose launcher takes the argument order `_raw_launch` passes.
RAW_LAUNCH_VERSIONS = ("3.6.",)


def _raw_launch(binary):
    """`f(grid3, stream, args, constexprs)` calling the binary's C launcher directly, or
    None where that is not known to be what `binary[grid](...)` does.

    `binary[grid](*args)` builds a closure, asks for the current device and stream,
    builds launch metadata for hooks and allocates scratch (none for our kernels) before
    it reaches the C launcher, host time on the launch path that buys nothing here. The
    launcher's argument order is Triton-internal, so this binds only for the versions in
    RAW_LAUNCH_VERSIONS, kernels without scratch, and the CUDA launcher class; anything
    else (a profiler's launch hook included, checked per launch) takes `binary[grid]`."""
    if not triton.__version__.startswith(RAW_LAUNCH_VERSIONS):
        return None
    run = getattr(binary, "run", None)
    if type(run).__name__ != "CudaLauncher" or not hasattr(run, "launch"):
        return None
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    launch, function, packed = run.launch, binary.function, binary.packed_metadata
    coop, pdl = run.launch_cooperative_grid, run.launch_pdl

    def raw(grid, stream, args, constexprs):
        # (grid, stream, function, cooperative, pdl, global and profile scratch,
        #  packed metadata, launch metadata, enter and exit hooks, kernel arguments)
        launch(grid[0], grid[1], grid[2], stream, function, coop, pdl, None, None, packed,
               None, None, None, *args, *constexprs)

    return raw


_TEMPLATES: dict = {}


def descriptor(cls, t: torch.Tensor, block_shape, *layout):
    """`cls.from_tensor(t, block_shape, *layout)` (a Triton or Gluon TensorDescriptor) for
    the launch path: its `__post_init__` checks (~10 us a descriptor, twice per GEMM2
    launch, after Megatron's sync) run once per dtype / shape / strides / block / layout;
    later calls copy that validated template and set t as the base (whose alignment is
    the one check that depends on it). The copy also carries its `LaunchCache` key part
    for either alignment of the base (`_launch_keys`), computed once with the template."""
    key = (cls, t.dtype, t.shape, t.stride(), tuple(block_shape), *layout)
    tmpl = _TEMPLATES.get(key)
    if tmpl is None:
        if len(_TEMPLATES) >= 512:  # shapes vary with the routing (EP): bounded
            _TEMPLATES.clear()
        tmpl = cls.from_tensor(t, list(block_shape), *layout)
        tmpl._launch_keys = tuple(_descriptor_key(tmpl, aligned) for aligned in (False, True))
        tmpl.base = None  # (the template must not keep a tensor alive)
        _TEMPLATES[key] = tmpl
    if t.data_ptr() % 16:
        raise ValueError("a tensor descriptor's base must be 16-byte aligned")
    d = object.__new__(cls)
    d.__dict__.update(tmpl.__dict__)
    d.base = t
    return d


def _descriptor_key(a, aligned: bool) -> tuple:
    return (a.base.dtype, tuple(a.block_shape), aligned, tuple(a.strides),
            tuple(s % 16 == 0 for s in a.shape), a.padding, getattr(a, "layout", None))


def _no_launch_hooks() -> bool:
    """No launch hook is registered (a profiler such as proton adds them)."""
    rt = knobs.runtime
    return all(h is None or not getattr(h, "calls", True)
               for h in (rt.launch_enter_hook, rt.launch_exit_hook))


def prefer_max_shared(binary) -> None:
    """Ask the driver to configure an SM running this kernel with the largest shared-memory
    carveout. An SM runs CTAs of several kernels only under one L1/shared split: without
    this the driver gives a kernel that needs little shared memory (GatherRS: 4 KB) a small
    carveout, and no GEMM2 CTA (~100 KB each) can join an SM one of its CTAs runs on until
    it exits, which for a CTA waiting on GEMM2's flags is never (a time-out)."""
    # (sets nothing without an NVIDIA driver: another backend)
    cuda_driver.set_function_attribute(binary.function,
                                       cuda_driver.PREFERRED_SHARED_MEMORY_CARVEOUT, 100,
                                       "PREFERRED_SHARED_MEMORY_CARVEOUT")


class LaunchCache:
    """Compiled-kernel launches of one `@triton.jit` kernel whose constexprs come last.

    `max_shared`: set the largest shared-memory carveout on every binary it loads
    (`prefer_max_shared`), for kernels whose CTAs must share SMs with GEMM2's."""

    #: launch through the cached binary (False: every launch through `kernel[grid]`;
    #: one switch for all kernels, read per launch). Under TRITON_INTERPRET=1 the
    #: kernels have no params and no cache is active either way.
    fast = True

    def __init__(self, kernel, max_shared: bool = False):
        self.kernel = kernel
        self.max_shared = max_shared
        self._compiled: dict = {}
        params = getattr(kernel, "params", None)  # the interpreter's functions have none
        self.active = params is not None
        if not self.active:
            return
        runtime = [p for p in params if not p.is_constexpr]
        if any(p.is_constexpr for p in params[:len(runtime)]):
            raise TypeError(f"{kernel.__name__}: constexpr parameters must come last")
        self.num_runtime = len(runtime)
        self.no_spec = tuple(p.do_not_specialize for p in runtime)
        self.constexprs = tuple(p.name for p in params if p.is_constexpr)

    def _key(self, args, meta: dict):
        parts = []
        for a, no_spec in zip(args, self.no_spec):
            # plain ints first (most arguments), by exact type: bool is an int subclass
            # and Triton specializes it as a bool
            if type(a) is int:
                parts.append(_int_class(a) if no_spec else a)
            elif isinstance(a, torch.Tensor):
                parts.append((a.dtype, a.data_ptr() % 16 == 0))
            elif isinstance(a, bool) or a is None:
                parts.append(a)
            elif isinstance(a, int):
                parts.append(_int_class(a) if no_spec else a)
            elif isinstance(a, (TensorDescriptor, GluonDescriptor)):
                known = a.__dict__.get("_launch_keys")  # a `descriptor` copy's
                aligned = a.base.data_ptr() % 16 == 0
                parts.append(known[aligned] if known else _descriptor_key(a, aligned))
            else:  # a kind we do not know how Triton specializes: no fast path
                return None
        return tuple(parts), tuple(meta.items())

    def compiled(self, args, meta: dict):
        """The compiled kernel for these arguments (compiled and loaded now on a miss);
        None under the interpreter or for arguments of an unknown kind."""
        if not self.active:
            return None
        if len(args) != self.num_runtime:
            raise TypeError(f"{self.kernel.__name__}: {len(args)} positional arguments, "
                            f"expected the {self.num_runtime} non-constexpr ones")
        key = self._key(args, meta)
        if key is None:
            return None
        hit = self._compiled.get(key)
        if hit is None:
            binary = self.kernel.warmup(*args, grid=(1,), **meta)
            # CUDA loads modules lazily, and loading may wait for running kernels (a
            # spinning GatherRS among them): load it now.
            binary._init_handles()
            if self.max_shared:
                prefer_max_shared(binary)
            hit = self._compiled[key] = (binary, tuple(meta[n] for n in self.constexprs),
                                         _raw_launch(binary))
        return hit

    def launch(self, grid, args, meta: dict, compiled=None, stream=None):
        """`kernel[grid](*args, **meta)`, through the cached binary when there is one.

        `stream`: a torch.cuda.Stream to launch on instead of the current one (handed to
        the binary directly: entering `torch.cuda.stream` costs more than the launch)."""
        hit = compiled or self.compiled(args, meta)
        if hit is None or not self.fast:
            if stream is None:
                return self.kernel[grid](*args, **meta)
            with torch.cuda.stream(stream):
                return self.kernel[grid](*args, **meta)
        binary, constexpr_values, raw = hit
        g = tuple(grid) + (1,) * (3 - len(grid))
        if raw is not None and _no_launch_hooks():
            handle = (stream.cuda_stream if stream is not None else
                      torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice()))
            raw(g, handle, args, constexpr_values)
        elif stream is None:
            binary[g](*args, *constexpr_values)
        else:
            binary[g](*args, *constexpr_values, stream=stream.cuda_stream)
        return binary


def row_tile(width: int, widest: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_W) of the one-pass row kernels (`swiglu`, `gated_add`,
    `gather_rows`): the widest power-of-two column block up to `widest` that divides
    `width` (no masked columns where one does; 16 at the least), 4096 elements a program."""
    block = widest
    while block > 16 and width % block:
        block //= 2
    return 4096 // block, block
