"""Algorithm 1 of the paper's section III (stdlib only): C* = argmin T(C), its ties,
and the Plan a launch reads.

The partition placement: T(C) over C = 1..min(C_max, o_comm (G - 1)) (P(C) > 0); ties
(|dT| <= 1e-9 T) go to the smaller Delta_comp = V_comp P - W_comp (eq. 18), then to the
smaller C. The shared placement (KernelSpec.shared_sms): C* = G (`model.py`'s docstring),
and the rest of the curve is computed only if it is read.
"""

from __future__ import annotations

import functools
import math
import time
from typing import NamedTuple

from .calibration import Calibration
from .curve import Curve, partition_ts, shared_ts
from .inputs import DeviceSpec, KernelSpec, Workload
from .quantities import (comm_tiles, compute_slots, compute_tiles, makespan, reservation,
                         service_ratio, tail_ctas)

#: The fixed communication-CTA count of the public COMET A100 path; what "disabled" returns.
DEFAULT_COMM_CTAS = 3
_TIE_RTOL = 1e-9


class _PlanFields(NamedTuple):
    comm_ctas: int  # C*
    reservation: int  # R(C*)
    compute_slots: int  # P(C*)
    splits: int  # L
    predicted: float  # T(C*)
    curve: Curve  # (C, T(C)) for every legal C; read as Plan.curve, a tuple
    w_comp: int
    w_comm: int
    rho: float
    source: str  # "model", "user" or "disabled"


class Plan(_PlanFields):
    """The launch decision and the model's view of it (times in compute waves).

    A NamedTuple rather than a frozen dataclass: it is built before every launch that
    misses the cache, and a tuple builds several times faster. `curve`, the tuple of
    (C, T(C)) for every legal C, is computed when it is first read (a launch never does).
    """

    __slots__ = ()

    @property
    def curve(self) -> tuple[tuple[int, float], ...]:
        held = self[5]  # the field behind the name this property shadows
        return held.points if isinstance(held, Curve) else held

    def _asdict(self) -> dict:
        return {**super()._asdict(), "curve": self.curve}


def _finite_min(ts: list[float], rho: float) -> float:
    """min T(C); a ValueError where it is not finite (a calibration whose rho overflows:
    no C could be compared with another)."""
    t_min = min(ts)
    if not math.isfinite(t_min):
        raise ValueError(f"the model's T(C) is not finite (rho = {rho!r}): the calibration's "
                         f"rho_ref, k_epi, c_sat or overlap_factor is out of range")
    return t_min


def _solve(w_comp: int, w_comm: int, rho: float, splits: int, kernel: KernelSpec,
           device: DeviceSpec, c_max: int, c_sat: float | None = None,
           overlap: float | None = None) -> tuple[int, float, Curve]:
    """Algorithm 1 on precomputed tile counts: C*, T(C*) and the T(C) curve."""
    g, o_comp, o_comm = device.available_sms, kernel.o_comp, kernel.o_comm
    args = (w_comp, w_comm, rho, splits, kernel, device)
    if kernel.shared_sms:
        # P = o_comp G for every C, and q(C), q_tail(C) never rise with C, nor then does
        # T(C) (max and + round monotonically): T(G) is the least, ties go to the larger
        # C, so C* = G. The other T(C) are computed only if the curve is read.
        t_best = _finite_min(shared_ts((g,), *args, c_max, c_sat, overlap), rho)
        return g, t_best, Curve(functools.partial(
            shared_ts, range(1, g + 1), *args, c_max, c_sat, overlap))
    c_top = min(c_max, o_comm * (g - 1))  # the largest C with P(C) > 0
    if c_top < 1:
        raise ValueError(
            f"DeviceSpec.sms: no legal C in 1..{c_max}: P(C) = {o_comp} * "
            f"({g} - R(C)) <= 0 for every C (G={g}, o_comm={o_comm})"
        )
    ts, ps = partition_ts(*args, c_top, c_max, c_sat, overlap)
    t_min = _finite_min(ts, rho)
    tol = _TIE_RTOL * t_min
    tied = [c for c, t in enumerate(ts, 1) if t - t_min <= tol]
    # ties: the least Delta_comp = V_comp P - W_comp = (-W_comp) mod P (eq. 18), then C
    best = tied[0] if len(tied) == 1 else min(tied, key=lambda c: (-w_comp % ps[c - 1], c))
    return best, ts[best - 1], Curve(ts)


def solve(
    w_comp: int, w_comm: int, rho: float, splits: int,
    kernel: KernelSpec, device: DeviceSpec, c_max: int, c_sat: float | None = None,
    overlap: float | None = None,
) -> tuple[int, tuple[tuple[int, float], ...]]:
    """Algorithm 1 on precomputed tile counts: C* and the T(C) curve."""
    best, _, curve = _solve(w_comp, w_comm, rho, splits, kernel, device, c_max, c_sat,
                            overlap)
    return best, curve.points


def plan(
    workload: Workload,
    kernel: KernelSpec,
    device: DeviceSpec,
    calib: Calibration,
    *,
    comm_ctas: int | None = None,
    enabled: bool = True,
    default_comm_ctas: int = DEFAULT_COMM_CTAS,
) -> Plan:
    """Choose C for one launch.

    An explicit `comm_ctas` has priority; `enabled=False` returns `default_comm_ctas`
    (the upstream fixed configuration). Both still report the model's T(C) curve.
    """
    w_comp = compute_tiles(workload, kernel)
    w_comm = comm_tiles(workload, kernel)
    rho = service_ratio(workload, kernel, calib)
    best, predicted, curve = _solve(w_comp, w_comm, rho, workload.splits, kernel, device,
                                    calib.c_max, calib.c_sat, calib.overlap_factor)
    source = "model"
    if comm_ctas is not None or not enabled:
        source = "user" if comm_ctas is not None else "disabled"
        best = comm_ctas if comm_ctas is not None else default_comm_ctas
        predicted = _chosen_t(best, w_comp, w_comm, rho, workload.splits, kernel, device,
                              calib, curve)
    return Plan(best, reservation(best, kernel), compute_slots(best, kernel, device),
                workload.splits, predicted, curve, w_comp, w_comm, rho, source)


def _chosen_t(c: int, w_comp: int, w_comm: int, rho: float, splits: int, kernel: KernelSpec,
              device: DeviceSpec, calib: Calibration, curve: Curve) -> float:
    """T(C) of an explicit C, checked: legal (P(C) > 0; at most G when shared)."""
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
        raise ValueError(f"comm_ctas must be a positive int, got {c!r}")
    g = device.available_sms
    if compute_slots(c, kernel, device) <= 0:
        raise ValueError(f"comm_ctas={c} leaves no compute slots on {g} SMs")
    if kernel.shared_sms:
        if c > g:
            raise ValueError(f"comm_ctas={c}: the shared placement fits one communication "
                             f"CTA beside GEMM2's per SM, at most {g}")
        return shared_ts((c,), w_comp, w_comm, rho, splits, kernel, device, calib.c_max,
                         calib.c_sat, calib.overlap_factor)[0]
    if c <= len(curve.points):
        return curve.points[c - 1][1]
    return makespan(w_comp, w_comm,  # (above C_max)
                    compute_slots(c, kernel, device), c, splits, rho,
                    calib.c_sat, tail_ctas(c, kernel, device, calib.c_max),
                    calib.overlap_factor)


def timed_plan(*args, **kwargs) -> tuple[Plan, float]:
    """`plan` and its wall time in microseconds (for the CLI's `solver_us`)."""
    t0 = time.perf_counter()
    result = plan(*args, **kwargs)
    return result, (time.perf_counter() - t0) * 1e6
