"""Algorithm 1 of the paper's section III (stdlib only): C* = argmin T(C), its ties,
and the Plan a launch reads.

The partition placement: T(C) over C = 1..min(C_max, o_comm (G - 1)) (P(C) > 0); ties
(|dT| <= 1e-9 T) go to the smaller Delta_comp = V_comp P - W_comp (eq. 18), then to the
smaller C. The shared placement (KernelSpec.shared_sms): C* = G (`model.py`'s docstring),
and the rest of the curve is computed only if it is read.
"""

from __future__ import annotations

import math
import time
from math import isfinite
from typing import Callable, NamedTuple

from .calibration import Calibration
from .bounds import TIE_RTOL, contenders
from .curve import Curve, curve_ts, shared_q, shared_t, shared_ts, t_at
from .inputs import DeviceSpec, KernelSpec, Workload
from .quantities import (comm_row_tiles, comm_tiles, compute_slots, compute_tiles, makespan,
                         reservation, service_ratio, tail_ctas)

#: The fixed communication-CTA count of the public COMET A100 path; what "disabled" returns.
DEFAULT_COMM_CTAS = 3


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


def _finite(t_min: float, rho: float) -> float:
    """The least T(C); a ValueError where it is not finite (a calibration whose rho
    overflows: no C could be compared with another)."""
    if not math.isfinite(t_min):
        raise ValueError(f"the model's T(C) is not finite (rho = {rho!r}): the calibration's "
                         f"rho_ref, k_epi, c_sat or overlap_factor is out of range")
    return t_min


def _solve(w_comp: int, w_comm: int, rho: float, splits: int, kernel: KernelSpec,
           device: DeviceSpec, c_max: int, c_sat: float | None = None,
           overlap: float | None = None) -> tuple[int, float]:
    """Algorithm 1 on precomputed tile counts: C* and T(C*) (a launch reads nothing else
    of the curve; a Plan's curve is `curve.curve_ts`, computed when read)."""
    g, o_comp, o_comm = device.available_sms, kernel.o_comp, kernel.o_comm
    if kernel.shared_sms:
        # P = o_comp G for every C, and q(C), q_tail(C) never rise with C, nor then does
        # T(C) (max and + round monotonically): T(G) is the least, ties go to the larger
        # C, so C* = G. The other T(C) are computed only if the curve is read.
        return g, _finite(shared_t(g, w_comp, w_comm, rho, splits, kernel, device, c_max,
                                   c_sat, overlap), rho)
    c_top = min(c_max, o_comm * (g - 1))  # the largest C with P(C) > 0
    if c_top < 1:
        raise ValueError(
            f"DeviceSpec.sms: no legal C in 1..{c_max}: P(C) = {o_comp} * "
            f"({g} - R(C)) <= 0 for every C (G={g}, o_comm={o_comm})"
        )
    found = contenders(w_comp, w_comm, rho, splits, kernel, device, c_top, c_max, c_sat,
                       overlap)
    t_min = _finite(min([t for _, _, t in found]), rho)
    tol = TIE_RTOL * t_min
    # ties: the least Delta_comp = V_comp P - W_comp = (-W_comp) mod P (eq. 18), then C
    _, best, t_best = min((-w_comp % p, c, t) for c, p, t in found if t - t_min <= tol)
    return best, t_best


def solve(
    w_comp: int, w_comm: int, rho: float, splits: int,
    kernel: KernelSpec, device: DeviceSpec, c_max: int, c_sat: float | None = None,
    overlap: float | None = None,
) -> tuple[int, tuple[tuple[int, float], ...]]:
    """Algorithm 1 on precomputed tile counts: C* and the T(C) curve."""
    args = (w_comp, w_comm, rho, splits, kernel, device, c_max, c_sat, overlap)
    return _solve(*args)[0], Curve(curve_ts, args).points


def routing_t(per_row: int, comm_cols: int, world: int, rho: float, splits: int,
              kernel: KernelSpec, device: DeviceSpec,
              calib: Calibration) -> Callable[[int, int], float]:
    """T(C*) as a function of M and the routing's row tiles, (tokens, row_tiles) -> T, at
    sizes whose other quantities are these: W_comp = per_row x row tiles (per_row =
    g ceil(ceil(N/L) / TN)), W_comm = ceil(ceil(M/D) / TMc) x comm_cols (comm_cols =
    ceil(ceil(N/L) / TNc)) and rho. What ranking L reads for every launch: the routing
    changes with every call and M with the batch, the rest with neither, so one predictor
    serves every M of a launch shape. In the shared placement C* = G, and q(G), q_tail(G)
    read M alone: computed when M changes, kept for the calls at the same M (a step's
    layers, a routing new to them)."""
    if kernel.shared_sms:
        return _shared_routing_t(per_row, comm_cols, world, rho, splits, kernel, device,
                                 calib)

    def t(tokens: int, row_tiles: int) -> float:
        _check_row_tiles(row_tiles)
        _check_tokens(tokens)
        w_comm = comm_row_tiles(tokens, world, kernel) * comm_cols
        return _solve(per_row * row_tiles, w_comm, rho, splits, kernel, device, calib.c_max,
                      calib.c_sat, calib.overlap_factor)[1]
    return t


def _shared_routing_t(per_row: int, comm_cols: int, world: int, rho: float, splits: int,
                      kernel: KernelSpec, device: DeviceSpec,
                      calib: Calibration) -> Callable[[int, int], float]:
    """`routing_t` in the shared placement: T(G) by `t_at`, with q(G) and q_tail(G) of
    the last M held (one tuple, read and replaced whole: calls from two threads see
    one M's pair). The checks of M and the row tiles are inlined: this runs for every L
    of every launch."""
    g = device.available_sms
    p = kernel.o_comp * g
    c_max, c_sat, overlap = calib.c_max, calib.c_sat, calib.overlap_factor
    held = (None, 0.0, 0.0)  # (M, q(G), q_tail(G))

    def t(tokens: int, row_tiles: int) -> float:
        nonlocal held
        m, q, q_tail = held
        if tokens != m or type(tokens) is not int:  # (16384.0 == 16384: checked, raises)
            if type(tokens) is not int or tokens < 1:
                _check_tokens(tokens)
            w_comm = comm_row_tiles(tokens, world, kernel) * comm_cols
            q, q_tail = shared_q(g, w_comm, rho, kernel, device, c_max, c_sat, overlap)
            held = (tokens, q, q_tail)
        if type(row_tiles) is not int or row_tiles < 0:
            _check_row_tiles(row_tiles)
        t_g = t_at(per_row * row_tiles, splits, p, q, q_tail)  # T(G)
        return t_g if isfinite(t_g) else _finite(t_g, rho)
    return t


def routing_plan(per_row: int, comm_cols: int, world: int, rho: float, splits: int,
                 kernel: KernelSpec, device: DeviceSpec, calib: Calibration,
                 comm_ctas: int | None = None,
                 enabled: bool = True) -> Callable[[int, int], Plan]:
    """`plan_tiles` as a function of M and the routing's row tiles, (tokens, row_tiles) ->
    Plan, at sizes whose other quantities are these (as `routing_t`): what a launch plans
    at its L once ranked, with nothing kept (its caller keeps the decision)."""
    def planned(tokens: int, row_tiles: int) -> Plan:
        if type(row_tiles) is not int or row_tiles < 0:
            _check_row_tiles(row_tiles)
        if type(tokens) is not int or tokens < 1:
            _check_tokens(tokens)
        w_comm = comm_row_tiles(tokens, world, kernel) * comm_cols
        return plan_tiles(per_row * row_tiles, w_comm, rho, splits, kernel, device, calib,
                          comm_ctas, enabled)
    return planned


def _check_tokens(tokens: int) -> None:
    """M as Workload checks it: an int >= 1."""
    if type(tokens) is not int or tokens < 1:
        raise ValueError(f"Workload.tokens must be an int >= 1, got {tokens!r}")


def _check_row_tiles(row_tiles: int) -> None:
    if type(row_tiles) is not int or row_tiles < 0:
        raise ValueError(f"row_tiles must be an int >= 0, got {row_tiles!r}")


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
    return plan_tiles(compute_tiles(workload, kernel), comm_tiles(workload, kernel),
                      service_ratio(workload, kernel, calib), workload.splits, kernel, device,
                      calib, comm_ctas, enabled, default_comm_ctas)


def plan_tiles(w_comp: int, w_comm: int, rho: float, splits: int, kernel: KernelSpec,
               device: DeviceSpec, calib: Calibration, comm_ctas: int | None = None,
               enabled: bool = True, default_comm_ctas: int = DEFAULT_COMM_CTAS) -> Plan:
    """`plan` on W_comp, W_comm and rho already computed (`PlanCache` keeps the last two
    per workload size: they do not depend on the routing)."""
    args = (w_comp, w_comm, rho, splits, kernel, device, calib.c_max, calib.c_sat,
            calib.overlap_factor)
    best, predicted = _solve(*args)
    curve = Curve(curve_ts, args)  # (computed when read)
    source = "model"
    if comm_ctas is not None or not enabled:
        source = "user" if comm_ctas is not None else "disabled"
        best = comm_ctas if comm_ctas is not None else default_comm_ctas
        predicted = _chosen_t(best, w_comp, w_comm, rho, splits, kernel, device, calib,
                              curve)
    return Plan(best, reservation(best, kernel), compute_slots(best, kernel, device),
                splits, predicted, curve, w_comp, w_comm, rho, source)


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
