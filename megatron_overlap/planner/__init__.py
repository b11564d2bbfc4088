"""The launch-time analytical resource manager (paper section III). Stdlib only."""

from .cache import PlanCache
from .fusion import FusionDecision, StepCosts, decide_fusion
from .model import (
    DEFAULT_COMM_CTAS,
    Calibration,
    DeviceSpec,
    KernelSpec,
    Plan,
    Workload,
    comm_tiles,
    compute_slots,
    compute_tiles,
    expert_row_tiles,
    makespan,
    plan,
    ranking_calibration,
    reservation,
    service_ratio,
    service_time,
    timed_plan,
)
from .occupancy import AMPERE_A100, HOPPER, Occupancy, SMLimits, co_resident, resident_ctas
from .presets import A100_PAPER, Preset, get_preset, load_preset_file, preset_for_device, preset_names

__all__ = [
    "A100_PAPER", "AMPERE_A100", "Calibration", "DEFAULT_COMM_CTAS", "DeviceSpec", "HOPPER",
    "FusionDecision", "KernelSpec", "Occupancy", "Plan", "PlanCache", "Preset", "SMLimits", "StepCosts", "Workload",
    "comm_tiles", "compute_slots", "decide_fusion", "compute_tiles", "expert_row_tiles", "get_preset", "load_preset_file",
    "makespan", "plan", "preset_for_device", "preset_names", "ranking_calibration", "reservation",
    "co_resident", "resident_ctas", "service_ratio", "service_time", "timed_plan",
]
