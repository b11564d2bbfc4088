"""The model's inputs (paper section III; stdlib only): one invocation, the compiled
kernels, the device. Frozen dataclasses, validated once where they are built; the model
reads nothing else (no hidden state). The glossary is `model.py`'s docstring; the fourth
input, the calibration, is calibration.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

#: The largest C_max a calibration may name (C never exceeds the SMs of a device).
MAX_C = 4096
_INT = {int}


def require_int(obj: object, name: str, minimum: int) -> None:
    """An int (not a bool) >= minimum, else a ValueError naming the field."""
    value = getattr(obj, name)
    if type(value) is int and value >= minimum:  # (the common case first: every launch)
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{type(obj).__name__}.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{type(obj).__name__}.{name} must be >= {minimum}, got {value}")


def require_real(obj: object, name: str, minimum: float, strict: bool = False,
                 optional: bool = True) -> None:
    """An optional finite number (None passes) >= minimum, or > minimum when `strict`
    (inf and NaN, which JSON's Infinity and 1e400 give, would make T(C) meaningless)."""
    value = getattr(obj, name)
    if value is None and optional:
        return
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or not (value > minimum if strict else value >= minimum)):
        raise ValueError(f"{type(obj).__name__}.{name} must be a finite number "
                         f"{'>' if strict else '>='} {minimum:g}"
                         f"{' or None' if optional else ''}, got {value!r}")


class Sizes(NamedTuple):
    """A Workload's sizes without its routing: all that W_comm and rho read (a Workload
    reads as these too: quantities.comm_tiles, service_ratio take either)."""

    tokens: int  # M
    hidden: int  # N
    ffn: int  # K
    world: int  # D
    splits: int  # L
    groups: int = 1  # g
    topk: int | None = None  # k
    local_topk: float | None = None


def plainly_valid(sizes: tuple, counts: tuple) -> bool:
    """Sizes (in the order of `Sizes`) and counts as Workload wants them, by a few
    C-speed passes (False: let Workload's own checks say what is wrong, or pass what
    this is too strict for)."""
    ints, topk, local_topk = sizes[:6], sizes[6], sizes[7]
    return (set(map(type, ints)) == _INT and min(ints) >= 1 and sizes[4] <= sizes[1]
            and (topk is None or (type(topk) is int and topk >= 1))
            and (local_topk is None
                 or (type(local_topk) is float and 0 <= local_topk < math.inf))
            and bool(counts) and set(map(type, counts)) == _INT and min(counts) >= 0)


@dataclass(frozen=True)
class Workload:
    """One GEMM2+GatherRS invocation, as the planner sees it."""

    tokens: int  # M
    hidden: int  # N
    ffn: int  # K
    world: int  # D
    splits: int  # L
    expert_counts: tuple[int, ...]  # M_e for each local expert
    groups: int = 1  # g
    topk: int | None = None  # k, rows gathered per token (read only with Calibration.topk_ref)
    # rows per token held by this rank's experts (k under pure TP, ~k/EP under EP); None = k
    local_topk: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "expert_counts", tuple(self.expert_counts))
        sizes = (self.tokens, self.hidden, self.ffn, self.world, self.splits, self.groups,
                 self.topk, self.local_topk)
        if not plainly_valid(sizes, self.expert_counts):  # (the common case first)
            self._check()

    def _check(self) -> None:
        """Each field's check, raising a ValueError that names the field."""
        for name in ("tokens", "hidden", "ffn", "world", "splits", "groups"):
            require_int(self, name, 1)
        if self.topk is not None:
            require_int(self, "topk", 1)
        require_real(self, "local_topk", 0)
        if self.splits > self.hidden:
            raise ValueError(
                f"Workload.splits must be <= hidden ({self.hidden}), got {self.splits}"
            )
        counts = self.expert_counts
        if not counts:
            raise ValueError("Workload.expert_counts must name at least one local expert")
        # One C-speed pass each instead of a Python loop: this runs on every launch.
        if set(map(type, counts)) != {int} or min(counts) < 0:
            e, bad = next((e, c) for e, c in enumerate(counts)
                          if type(c) is not int or c < 0)
            raise ValueError(
                f"Workload.expert_counts[{e}] must be a non-negative int, got {bad!r}"
            )

    @classmethod
    def from_total(
        cls, *, tokens: int, hidden: int, ffn: int, world: int, splits: int,
        total_assignments: int, local_experts: int, groups: int = 1,
    ) -> "Workload":
        """The normalized-load estimate of section III-E: the assignments spread evenly.

        For counts that live only on the device: the host knows the total (tokens * top-k
        * local experts / experts) without a device-to-host copy.
        """
        if local_experts < 1:
            raise ValueError(f"local_experts must be >= 1, got {local_experts}")
        if total_assignments < 0:
            raise ValueError(f"total_assignments must be >= 0, got {total_assignments}")
        base, extra = divmod(total_assignments, local_experts)
        counts = tuple(base + (1 if e < extra else 0) for e in range(local_experts))
        return cls(tokens, hidden, ffn, world, splits, counts, groups)


@dataclass(frozen=True)
class KernelSpec:
    """Tile shapes and residency of the compiled GEMM2 and GatherRS kernels."""

    tile_m: int  # TM
    tile_n: int  # TN
    comm_tile_m: int  # TMc
    comm_tile_n: int  # TNc
    o_comp: int  # resident GEMM2 CTAs per SM
    o_comm: int  # resident GatherRS CTAs per SM
    # The op's tail helpers (model.py): the last split served after GEMM2 by
    # C + G - R(C) CTAs, up to C_max. The op sets it when it launches them.
    tail_helpers: bool = False
    # The shared placement (model.py): communication CTAs beside GEMM2's, R(C) = 0.
    shared_sms: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name not in ("tail_helpers", "shared_sms"):
                require_int(self, f.name, 1)
        for name in ("tail_helpers", "shared_sms"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"KernelSpec.{name} must be a bool, got "
                                 f"{getattr(self, name)!r}")


@dataclass(frozen=True)
class DeviceSpec:
    """The GPU as the planner sees it: SMs left to the operator after `sm_margin`."""

    name: str
    sms: int  # SMs on the device
    sm_margin: int = 0  # SMs left to other concurrent kernels

    def __post_init__(self) -> None:
        require_int(self, "sms", 1)
        if self.sms > MAX_C:  # (the planner's curve has one point per C up to G)
            raise ValueError(f"DeviceSpec.sms must be <= {MAX_C}, got {self.sms}")
        require_int(self, "sm_margin", 0)
        if self.sm_margin >= self.sms:
            raise ValueError(
                f"DeviceSpec.sm_margin ({self.sm_margin}) must leave at least one of "
                f"{self.sms} SMs"
            )

    @property
    def available_sms(self) -> int:  # G
        return self.sms - self.sm_margin
