"""The overlapped GEMM2 + GatherRS operator (planner + kernels + peer memory).

Everything outside ops (mcore, tools/) reaches it through the names below: the op and its
session, its config and tiles, its FP8 operands' scales (with the tuned-tiles reader and the shared placement's
register caps), how it chooses L, the backward's grouped GEMMs, the layer's helpers.
"""

from .buffer import OverlapBuffer
from .capture import CapturedCall
from .errors import OverlapMismatchError, OverlapPeerError, OverlapTimeoutError
from .config import (GPU_TILES, INTERPRET_TILES, PARTITION_TILES, SHARED_COMM_MAXNREG,
                     SHARED_GEMM_MAXNREG, OverlapConfig, TileConfig, load_tiles)
from .fp8 import Fp8Scales, quantize_operands as quantize_fp8_operands
from .block_train import block_expert_linear
from .fp8_groups import (DelayedScales, block_dequantized, block_dequantized_columns,
                         block_dequantized_weights, fp8_grouped_linear,
                         quantize_fp8_groups, quantize_fp8_stack, scaled_grouped_mm_refusal)
from .fp8_train import Fp8Rows, Fp8Stack, GradFp8, fp8_expert_linear, with_transposed
from .fusion import fusion_decision
from .expert_weights import BIAS_COLUMNS, ExpertWeightStack, stacked, with_bias_columns
from .grouped import accepts as grouped_mm_accepts, expert_of_rows_by_ends, grouped_mm, grouped_wgrad
from .helpers import (add_gated_shared_, capturing, gather_rows, interpreting, permute_rows,
                      weighted_swiglu)
from .planning import ROOFLINE_CANDIDATES, PlanRequest, rank_splits, split_candidates
from .plans import Planner
from .session import OverlapSession, default_session, gemm2_gather_rs, note_replays

__all__ = ["BIAS_COLUMNS", "ExpertWeightStack", "stacked", "grouped_mm_accepts", "OverlapBuffer", "OverlapConfig", "OverlapMismatchError",
           "OverlapPeerError",
           "OverlapTimeoutError", "fusion_decision",
           "gemm2_gather_rs", "with_bias_columns",
           # FP8 operands of the op: TE's scales (kernels/gemm2_fp8.py), and operands
           # quantized as TE's recipes do (benchmarks, checks)
           "Fp8Scales", "quantize_fp8_operands",
           # expert-grouped FP8 under current scaling, or delayed scaling's given scales
           # (the layer's own FP8 experts path)
           "fp8_grouped_linear", "quantize_fp8_groups", "quantize_fp8_stack", "DelayedScales",
           "scaled_grouped_mm_refusal",
           # and trained through it (FP8 dgrad and wgrad: ops/fp8_train.py)
           "Fp8Rows", "Fp8Stack", "GradFp8", "fp8_expert_linear", "with_transposed",
           # blockwise through exact dequantization onto the bf16 grouped kernels
           "block_dequantized", "block_dequantized_weights",
           # and trained through it (the recipe's dgrad and wgrad operands: ops/block_train.py)
           "block_expert_linear", "block_dequantized_columns",
           # tiles a user or the tuner sets (load_tiles: tools/tune_tiles.py's JSON; the
           # shared placement's register caps, TileConfig's gemm_ / comm_maxnreg defaults),
           # and the backward's grouped GEMMs
           "GPU_TILES", "INTERPRET_TILES", "PARTITION_TILES", "SHARED_COMM_MAXNREG",
           "SHARED_GEMM_MAXNREG", "TileConfig", "grouped_mm", "grouped_wgrad", "load_tiles",
           "expert_of_rows_by_ends",
           # how the op chooses L where none is given: the candidates for a hidden size and
           # their ranking (tools replay and plot it)
           "rank_splits", "split_candidates",
           # the op's planner offline: its requests, answered for a GPU this host lacks
           # (Planner(for_device=...): tools/bench_planner.py, tools/split_sweep.py)
           "Planner", "PlanRequest", "ROOFLINE_CANDIDATES",
           # the op's state and lifecycle (ops/session.py)
           "OverlapSession", "default_session", "note_replays",
           # the layer's helpers (ops/helpers.py) and CUDA-graph capture (ops/capture.py)
           "CapturedCall", "add_gated_shared_", "capturing", "gather_rows", "interpreting",
           "permute_rows", "weighted_swiglu"]
