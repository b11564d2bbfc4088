"""The CUDA driver library, through ctypes, for the few driver calls the package makes
itself: a kernel's shared-memory carveout (the kernels' launch cache) and event records,
stream waits and one copy on the op's launch path (`ops/stream_ops.py`), where torch's
own wrappers cost several microseconds of host time each.

A leaf module (stdlib only), so that the kernels and the op can both use the driver
without one importing the other. Without an NVIDIA driver (CPU, another backend)
`libcuda()` is None and every caller takes its torch or no-op path.
"""

from __future__ import annotations

import ctypes
import functools

#: CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT (cuda.h), in percent of the maximum
PREFERRED_SHARED_MEMORY_CARVEOUT = 9


@functools.lru_cache(maxsize=1)
def libcuda():
    """The CUDA driver library, loaded once (None without an NVIDIA driver)."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def set_function_attribute(function: int, attribute: int, value: int, name: str) -> bool:
    """`cuFuncSetAttribute(function, attribute, value)` for a loaded kernel's CUfunction
    handle; `name` (the attribute's, without its CU_FUNC_ATTRIBUTE_ prefix) goes into the
    error. False where there is no driver (nothing set), True once set; a driver error
    raises RuntimeError."""
    lib = libcuda()
    if lib is None:
        return False
    rc = lib.cuFuncSetAttribute(ctypes.c_void_p(function), attribute, value)
    if rc != 0:
        raise RuntimeError(f"cuFuncSetAttribute({name}) failed: {rc}")
    return True
