"""megatron-overlap: overlapped GEMM2 + top-k combine + reduce-scatter for Megatron-Core MoE.

The public surface, imported lazily so `python -m megatron_overlap plan` stays light:

    gemm2_gather_rs, OverlapConfig, OverlapTimeoutError   the operator   (megatron_overlap.ops)
    plan, Workload                                        the planner    (megatron_overlap.planner)
    OverlapMoELayer, with_overlap_moe, add_moe_overlap_args  Megatron-Core (megatron_overlap.mcore)
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "gemm2_gather_rs": "megatron_overlap.ops",
    "OverlapConfig": "megatron_overlap.ops",
    "OverlapTimeoutError": "megatron_overlap.ops",
    "plan": "megatron_overlap.planner",
    "Workload": "megatron_overlap.planner",
    "OverlapMoELayer": "megatron_overlap.mcore",
    "with_overlap_moe": "megatron_overlap.mcore",
    "add_moe_overlap_args": "megatron_overlap.mcore",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'megatron_overlap' has no attribute {name!r}")
