"""The overlapped GEMM2 + GatherRS operator (planner + kernels + peer memory)."""

from .buffer import OverlapBuffer
from .errors import OverlapTimeoutError
from .config import OverlapConfig
from .op import gemm2_gather_rs

__all__ = ["OverlapBuffer", "OverlapConfig", "OverlapTimeoutError", "gemm2_gather_rs"]
