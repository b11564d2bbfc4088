"""Fuse or not: the overlapped launch against the unfused steps it replaces (stdlib only).

The paper's model (model.py) ranks the operator's own choices (C, L) in compute waves.
Whether to run the operator at all is a comparison with a different program, the stock
MoE path (GEMM2, then Megatron's unpermute, then NCCL's reduce-scatter), so both are
priced in microseconds from the same device calibration:

    t_w          one compute wave of GEMM2 at K:
                 t_w = t_ref (K + K_epi) / (K_ref + K_epi) (TM TN) / (TM_ref TN_ref)
    T_fused      T(C*) t_w + H_op + [D > 1] H_group      the planned makespan (eq. 13)
                                                        plus the op's host work (and
                                                        its group's: peer barrier, counts)
    T_unfused    V t_w + B_comb / BW + T_rs + n H_launch
      V          ceil(W_comp(L = 1) / (o_comp G)): GEMM2 alone on every SM
      B_comb     (T + M) N b: the unpermute reads this rank's T routed rows and writes
                 M combined ones (b bytes per element)
      BW         BW_comb, Megatron's unpermute (a zeroed output, then a scatter-add of
                 the rows: its calibrated rate is the bytes above over its time); under
                 `moe_permute_fusion` (`stock_permute_fused`) BW_te, TE's fused unpermute,
                 which moves those bytes in one pass
      T_rs       0 on one rank, else M N b (D - 1) / D / BW_rs + t_rs
      n          kernel launches the stock experts make beyond the fused path's
                 (TE's GroupedLinear: one GEMM per local expert in FC1 and in FC2;
                 a grouped GEMM: none), H_launch the host time of one

fuse = T_unfused > T_fused. Host time is counted in full on both sides: below a size
the eager layer is bound by its host (the GPU waits for each launch), and where the
GPU is the bound both paths' host work hides behind it and the device terms decide.
The inputs are sizes only (uniform routing, section III-E), so every rank of a group
reaches the same decision without exchanging anything. The router (fused by
`moe_router_fusion` or not) and the permute before FC1 are not priced: the fused path
runs the same router, and its own permute whatever the flags say (mcore/layer.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

from .calibration import Calibration
from .inputs import DeviceSpec, KernelSpec, Workload
from .quantities import compute_tiles
from .search import Plan


@dataclass(frozen=True)
class StepCosts:
    """The absolute time scales of one device (microseconds, bytes per microsecond)."""

    wave_us: float  # t_ref: one GEMM2 compute wave at the calibration's K_ref and tile
    combine_bytes_per_us: float  # BW_comb: Megatron's unpermute (gather, scale, sum)
    rs_bytes_per_us: float  # BW_rs: NCCL's reduce-scatter, bytes each rank sends
    rs_latency_us: float  # t_rs: its fixed cost
    op_host_us: float  # H_op: the fused call's host work beyond the stock path's
    launch_us: float  # H_launch: the host time of one stock kernel launch
    group_host_us: float = 0.0  # H_group: H_op's addition where the group has D > 1 ranks
    # BW_te: TE's fused unpermute (`moe_permute_fusion`), one pass over the same bytes as
    # BW_comb's; None (not calibrated): priced at BW_comb
    fused_combine_bytes_per_us: float | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "fused_combine_bytes_per_us":
                continue
            positive = f.name.endswith("per_us") or f.name == "wave_us"
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value < 0 or (positive and value == 0)):
                raise ValueError(f"StepCosts.{f.name} must be a finite number "
                                 f"{'> 0' if positive else '>= 0'}, got {value!r}")


class FusionDecision(NamedTuple):
    """Fuse this call? The model's two predictions behind the answer (microseconds)."""

    fuse: bool
    fused_us: float  # T_fused
    unfused_us: float  # T_unfused
    plan: Plan | None  # the launch the fused time was priced with

    @property
    def predicted_gain(self) -> float:
        """T_unfused / T_fused: above 1 the fused call is predicted faster."""
        return self.unfused_us / self.fused_us


def wave_time_us(ffn: int, kernel: KernelSpec, calib: Calibration, costs: StepCosts) -> float:
    """t_w: one compute wave at K = `ffn`, scaled from the calibration's (as eq. 15 scales
    rho, inverted: a wave's time grows with K + K_epi and with the tile's area)."""
    k_epi = calib.k_epi or 0.0
    return (costs.wave_us * (ffn + k_epi) / (calib.k_ref + k_epi)
            * (kernel.tile_m * kernel.tile_n) / (calib.tm_ref * calib.tn_ref))


def unpermute_time_us(w: Workload, costs: StepCosts, element_bytes: int,
                      stock_permute_fused: bool) -> float:
    """B_comb / BW: the stock unpermute, Megatron's or (`stock_permute_fused`) TE's."""
    rate = costs.combine_bytes_per_us
    if stock_permute_fused and costs.fused_combine_bytes_per_us is not None:
        rate = costs.fused_combine_bytes_per_us
    return (sum(w.expert_counts) + w.tokens) * w.hidden * element_bytes / rate


def unfused_time_us(w: Workload, kernel: KernelSpec, device: DeviceSpec, calib: Calibration,
                    costs: StepCosts, element_bytes: int, stock_launches: int,
                    stock_permute_fused: bool = False) -> float:
    """T_unfused: GEMM2 alone on every SM, the unpermute (TE's where
    `stock_permute_fused`), the reduce-scatter, the stock experts' extra launches
    (module doc)."""
    one_split = dataclasses.replace(w, splits=1)
    waves = -(-compute_tiles(one_split, kernel) // (kernel.o_comp * device.available_sms))
    gemm2 = waves * wave_time_us(w.ffn, kernel, calib, costs)
    combine = unpermute_time_us(w, costs, element_bytes, stock_permute_fused)
    rs = 0.0
    if w.world > 1:
        sent = w.tokens * w.hidden * element_bytes * (w.world - 1) / w.world
        rs = sent / costs.rs_bytes_per_us + costs.rs_latency_us
    return gemm2 + combine + rs + stock_launches * costs.launch_us


def fused_time_us(plan: Plan, w: Workload, kernel: KernelSpec, calib: Calibration,
                  costs: StepCosts) -> float:
    """T_fused: the plan's makespan T(C*) in compute waves at K, plus H_op (+ H_group)."""
    host = costs.op_host_us + (costs.group_host_us if w.world > 1 else 0.0)
    return plan.predicted * wave_time_us(w.ffn, kernel, calib, costs) + host


def decide_fusion(w: Workload, plan: Plan, kernel: KernelSpec, device: DeviceSpec,
                  calib: Calibration, costs: StepCosts, *, element_bytes: int,
                  stock_launches: int = 0, stock_permute_fused: bool = False
                  ) -> FusionDecision:
    """Fuse iff the unfused steps are predicted slower than the planned launch `plan`
    (made for `w` with `kernel`, `device`, `calib`, as the op would launch it);
    `stock_permute_fused`: the stock path runs TE's fused permute and unpermute
    (Megatron's `moe_permute_fusion`)."""
    if isinstance(element_bytes, bool) or not isinstance(element_bytes, int) \
            or element_bytes < 1:
        raise ValueError(f"element_bytes must be a positive int, got {element_bytes!r}")
    if isinstance(stock_launches, bool) or not isinstance(stock_launches, int) \
            or stock_launches < 0:
        raise ValueError(f"stock_launches must be an int >= 0, got {stock_launches!r}")
    if not isinstance(stock_permute_fused, bool):
        raise ValueError(f"stock_permute_fused must be a bool, got {stock_permute_fused!r}")
    fused = fused_time_us(plan, w, kernel, calib, costs)
    unfused = unfused_time_us(w, kernel, device, calib, costs, element_bytes, stock_launches,
                              stock_permute_fused)
    return FusionDecision(unfused > fused, fused, unfused, plan)
