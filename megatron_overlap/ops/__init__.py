"""The overlapped GEMM2 + GatherRS operator (planner + kernels + peer memory)."""

from .buffer import OverlapBuffer
from .errors import OverlapMismatchError, OverlapTimeoutError
from .config import OverlapConfig
from .expert_weights import BIAS_COLUMNS, ExpertWeightStack, with_bias_columns
from .grouped import accepts as grouped_mm_accepts
from .op import gemm2_gather_rs

__all__ = ["BIAS_COLUMNS", "ExpertWeightStack", "grouped_mm_accepts", "OverlapBuffer", "OverlapConfig", "OverlapMismatchError",
           "OverlapTimeoutError",
           "gemm2_gather_rs", "with_bias_columns"]
