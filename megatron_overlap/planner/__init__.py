"""The launch-time analytical resource manager (paper section III). Stdlib only.

What it decides: in the partition placement (the paper's scheme, KernelSpec.shared_sms
False) C, the communication CTAs, by the model's argmin over 1..C_max, each taking SMs
from GEMM2. In the shared placement, Hopper's default, every SM hosts both GEMM2's
CTAs and one communication CTA, so C* = G always (the SMs left after sm_margin): there
the per-call choice is L, which the op ranks with this model (`ops/planning.py`), and
with L the communication tile; the kernel tiles are chosen offline (TileConfig,
tools/tune_tiles.py). Whether to fuse at all, per call size: `fusion.py`.

The model, in the order of section III (its glossary: `model.py`'s docstring): the
inputs (`inputs.py`, `calibration.py`), the named quantities (`quantities.py`), T(C) for
every C (`curve.py`), the C that can be C* (`bounds.py`), Algorithm 1 and the Plan
(`search.py`); `cache.py` memoizes it.
"""

from . import model as model  # (the glossary; the names it held before the split stay there)
from .cache import PlanCache
from .calibration import Calibration, Fp8Family, ranking_calibration
from .fusion import FusionDecision, StepCosts, decide_fusion
from .inputs import MAX_C, DeviceSpec, KernelSpec, Workload
from .occupancy import AMPERE_A100, HOPPER, Occupancy, SMLimits, co_resident, resident_ctas
from .presets import A100_PAPER, Preset, get_preset, load_preset_file, preset_for_device, preset_names
from .quantities import (comm_tiles, compute_slots, compute_tiles, expert_row_tiles, makespan,
                         reservation, service_ratio, service_time, tail_ctas)
from .search import DEFAULT_COMM_CTAS, Plan, plan, solve, timed_plan

__all__ = [
    "A100_PAPER", "AMPERE_A100", "Calibration", "Fp8Family", "DEFAULT_COMM_CTAS", "DeviceSpec", "HOPPER",
    "FusionDecision", "KernelSpec", "Occupancy", "Plan", "PlanCache", "Preset", "SMLimits", "StepCosts", "Workload",
    "comm_tiles", "compute_slots", "decide_fusion", "compute_tiles", "expert_row_tiles", "get_preset", "load_preset_file",
    "makespan", "plan", "preset_for_device", "preset_names", "ranking_calibration", "reservation",
    "co_resident", "resident_ctas", "service_ratio", "service_time", "timed_plan",
    "MAX_C", "solve", "tail_ctas",
]
