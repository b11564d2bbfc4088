"""The overlapped GEMM2 + GatherRS operator (planner + kernels + peer memory)."""

from .buffer import OverlapBuffer
from .capture import CapturedCall
from .errors import OverlapMismatchError, OverlapPeerError, OverlapTimeoutError
from .config import GPU_TILES, INTERPRET_TILES, PARTITION_TILES, OverlapConfig, TileConfig
from .fusion import fusion_decision
from .expert_weights import BIAS_COLUMNS, ExpertWeightStack, with_bias_columns
from .grouped import accepts as grouped_mm_accepts, grouped_mm, grouped_wgrad
from .helpers import add_gated_shared_, capturing, gather_rows, interpreting, weighted_swiglu
from .helpers import permute_rows as permute_rows  # (a re-export: __all__ is shared)
from .session import OverlapSession, default_session, gemm2_gather_rs, note_replays

__all__ = ["BIAS_COLUMNS", "ExpertWeightStack", "grouped_mm_accepts", "OverlapBuffer", "OverlapConfig", "OverlapMismatchError",
           "OverlapPeerError",
           "OverlapTimeoutError", "fusion_decision",
           "gemm2_gather_rs", "with_bias_columns",
           # tiles a user or the tuner sets, and the backward's grouped GEMMs
           "GPU_TILES", "INTERPRET_TILES", "PARTITION_TILES", "TileConfig", "grouped_mm",
           "grouped_wgrad",
           # the op's state and lifecycle (ops/session.py)
           "OverlapSession", "default_session", "note_replays",
           # the layer's helpers (ops/helpers.py) and CUDA-graph capture (ops/capture.py)
           "CapturedCall", "add_gated_shared_", "capturing", "gather_rows", "interpreting",
           "weighted_swiglu"]
