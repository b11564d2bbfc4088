"""`fusion_decision`: would the fused op beat the stock steps it replaces, at this size?

The MoE layer asks before it routes a call of a new size down either path (the paths
differ from FC1 on). The fused side is priced with the plan the op would launch (the
same tiles, kernel family, calibration and L), the stock side with GEMM2 alone, the
unpermute (Megatron's, or TE's fused one where the stock layer runs under
`moe_permute_fusion`) and the reduce-scatter (`planner.fusion`). Only sizes go in (uniform
routing), so every rank of a group decides alike; the decision is cached per size.
"""

from __future__ import annotations

import math

import torch

from ..planner import Workload, expert_row_tiles
from ..planner.fusion import FusionDecision, decide_fusion
from .config import OverlapConfig, preset_of, resolve_backend
from .fp8 import OPERAND_DTYPE, check_kind
from .planning import PlanRequest, launch_tiles
from .validation import check_int

#: the answer where the device has no step costs or the backend has no plan (the
#: reference path): fuse, with no predicted times
NO_MODEL = FusionDecision(True, math.nan, math.nan, None)


def fusion_decision(*, num_tokens: int, hidden: int, ffn: int, topk: int,
                    local_experts: int, experts: int, dtype: torch.dtype,
                    device: torch.device, group=None, config: OverlapConfig | None = None,
                    stock_launches: int = 0, padded: bool = False,
                    stock_permute_fused: bool = False, session=None,
                    fp8: str | None = None) -> FusionDecision:
    """The model's answer for one MoE layer call of `num_tokens` gathered tokens.

    Args: the call's sizes (`ffn` = GEMM2's K on this rank, `local_experts` of `experts`
    on this rank, top-k), the activations' dtype and device, the layer's reduce-scatter
    group and config; `stock_launches`: kernel launches the stock experts make beyond
    the fused path's (`planner.fusion`); `padded`: the rows reach the op padded to a
    bound (inference under EP), which puts GEMM2's output in row order;
    `stock_permute_fused`: the stock path unpermutes with TE's fused kernel (the layer's
    `config.moe_permute_fusion`); `session`: the `OverlapSession` whose planner plans
    the call (None: the group's default session, `gemm2_gather_rs`'s); `fp8`: GEMM2
    runs on FP8 operands of this scaling kind ("tensor" / "block", `ops.Fp8Scales`; None:
    on `dtype`): both sides are priced with that kernel family's calibration (the bf16
    family's where the device has none for it), the output and its combine in `dtype`.

    Returns NO_MODEL (fuse) on the reference backend and where neither the config's
    preset nor the device's shipped calibration has `step_costs`.
    """
    config = config or OverlapConfig()
    for name, value in (("num_tokens", num_tokens), ("hidden", hidden), ("ffn", ffn),
                        ("topk", topk), ("local_experts", local_experts),
                        ("experts", experts)):
        check_int(name, value, 1)
    check_kind(fp8)
    if local_experts > experts:
        raise ValueError(f"local_experts ({local_experts}) must be <= experts ({experts})")
    backend = resolve_backend(config.backend, device)
    if backend == "reference":
        return NO_MODEL
    if session is None:
        from .session import default_session  # (session imports the op, which this serves)
        session = default_session(group, device)
    world = session.world
    rows = num_tokens * topk * local_experts // experts
    operand_dtype = OPERAND_DTYPE if fp8 is not None else dtype
    tiles = launch_tiles(config, backend, device, operand_dtype, token_major=(  # as `op.prepare`
        not padded and rows == num_tokens * topk and num_tokens * topk < 1 << 31), fp8=fp8)
    counts = Workload.from_total(tokens=num_tokens, hidden=hidden, ffn=ffn, world=world,
                                 splits=1, total_assignments=rows,
                                 local_experts=local_experts).expert_counts
    local_topk = round(4 * rows / num_tokens) / 4
    launch_plan = session.plan(PlanRequest(
        config, tiles, device, backend, expert_row_tiles(counts, tiles.block_m),
        local_experts, num_tokens, hidden, ffn, world, topk, local_topk, config.splits,
        config.comm_ctas, fp8))
    plan, cache = launch_plan.plan, launch_plan.cache
    preset = preset_of(config, cache.device)
    step_costs = None if preset is None else preset.for_operands(fp8)[1]
    if step_costs is None:
        return NO_MODEL
    workload = Workload(num_tokens, hidden, ffn, world, plan.splits, counts, topk=topk,
                        local_topk=local_topk)
    return decide_fusion(workload, plan, cache.kernel, cache.device, cache.calib,
                         step_costs, element_bytes=dtype.itemsize,
                         stock_launches=stock_launches,
                         stock_permute_fused=stock_permute_fused)
