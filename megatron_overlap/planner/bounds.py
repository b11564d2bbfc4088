"""Which C can be C* in the partition placement (stdlib only): Algorithm 1 computes T(C)
only where it can reach the least T, and once for each stretch of C with one T.

Runs of one q. V_comm = ceil(W_comm / C) is the same over C = ceil(W_comm / V)..C for
each V, and so is q(C) = rho (V_comm + W_comm / C_sat). Over such a run P(C) falls as C
rises, the A_s rise, and T(C) with them (max and + round monotonically) where q_tail is
one number (no tail helpers, or o_comm = 1; else every C of the run is computed): the
least T of a run is at its lowest C, and the C tied with it follow it. The scan takes the
runs from C_top down, and each run from its lowest C up, until T(C) clears the least T so
far: no C above it in that run can reach it.

A bound on the runs below. As C falls, q(C) and q_tail(C) never fall and P(C) never
falls, so A_s(C) >= A_s(1). With F_{L-1} >= A_0 + (L - 1) q + q_last and
F_{L-1} >= A_{L-1} + q_last (eq. 12; q_last = q_tail under tail helpers, q without):

    T(C) >= A_0(1) + n q(C) + t         T(C) >= A_{L-1}(1) + m q(C) + t
            (tail helpers: n = L - 1, m = 0, t = q_tail(C_top); without: n = L, m = 1, t = 0)

which never fall as C falls. Once one exceeds the least T so far, no C of this run or
any below can reach it: the scan stops.

One T, one C. C' next above C in a run with the same A_0 and A_{L-1} (and the closed
form, q_tail the same) has T(C') = T(C), bit for bit; of those the tie-break (the least
(-W_comp) mod P = A_0 P - W_comp, then the least C) takes the least P, so each such stretch
is computed once (`_same_t`).

A C is passed over only where T(C), or its bound, exceeds the least T so far by twice
the tie tolerance (|dT| <= 1e-9 T) and T's rounding: it can neither be the least T nor tie
with it. Every T(C) the scan computes is the whole curve's (`curve.t_at`), so C*, T(C*)
and the ties are the whole curve's (tested against it, tests/test_planner_fast.py).
"""

from __future__ import annotations

import math
import sys

from .curve import partition_ts, t_at
from .inputs import DeviceSpec, KernelSpec
from .quantities import service_time

#: ties: |T(C) - T_min| <= TIE_RTOL * T_min (Algorithm 1)
TIE_RTOL = 1e-9


def contenders(w_comp: int, w_comm: int, rho: float, splits: int, kernel: KernelSpec,
               device: DeviceSpec, c_top: int, c_max: int, c_sat: float | None,
               overlap: float | None) -> list[tuple[int, int, float]]:
    """(C, P(C), T(C)) for every C of 1..C_top that can be C*: those that can reach the
    least T or tie with it, less those a C of the same T wins the tie-break against."""
    rho_f = rho * (overlap or 1.0)
    sat = 0.0 if c_sat is None else w_comm / c_sat
    if not _finite(w_comp, w_comm, max(rho, rho_f), splits, sat):  # (T may overflow:
        cs = range(1, c_top + 1)  # the whole curve, which fails or not as it always did)
        ts, ps = partition_ts(w_comp, w_comm, rho, splits, kernel, device, cs, c_max, c_sat,
                              overlap)
        return list(zip(cs, ps, ts))
    g, o_comp, o_comm = device.available_sms, kernel.o_comp, kernel.o_comm
    q_tail, base, n, reach, m = _bounds(w_comp, w_comm, rho, splits, kernel, device, c_top,
                                        c_max, c_sat)
    varying_tail = kernel.tail_helpers and o_comm > 1  # (else q_tail is one number)
    # passed over only past twice the tie tolerance and T's rounding (L additions)
    slack = 1 + 2 * TIE_RTOL + 4 * (splits + 2) * sys.float_info.epsilon
    kept, bound, top = [], math.inf, c_top  # bound: the least T so far, times slack
    while top >= 1:  # runs of one q, from C_top down
        v = (w_comm + top - 1) // top
        q = rho_f * (v + sat)
        if base + n * q > bound or reach + m * q > bound:  # nor any C below
            break
        low = -(-w_comm // v) if v else 1  # ceil(W_comm / C) = V  <=>  C >= ceil(W_comm / V)
        c = low
        while c <= top:  # up the run, one T at a time
            p = o_comp * (g - -(-c // o_comm))
            if varying_tail:
                q_tail = _tail_q(c, w_comm, rho, kernel, device, c_max, c_sat)
            t = t_at(w_comp, splits, p, q, q_tail)
            if t > bound and not varying_tail:  # nor any C above it in this run
                break
            if t * slack < bound:
                bound = t * slack
            end = c if c == top or varying_tail else _same_t(w_comp, splits, kernel, device,
                                                              c, top, p, q)
            kept.append(_winner(c, end, t, w_comp, kernel, device))
            c = end + 1
        top = low - 1
    return kept


def _bounds(w_comp: int, w_comm: int, rho: float, splits: int, kernel: KernelSpec,
            device: DeviceSpec, c_top: int, c_max: int,
            c_sat: float | None) -> tuple[float | None, float, int, float, int]:
    """(q_tail(C_top), the least of any C, None without tail helpers; then the bounds'
    A_0(1) + t, n, A_{L-1}(1) + t, m: T(C) >= A_0(1) + n q(C) + t and
    T(C) >= A_{L-1}(1) + m q(C) + t at every C below a run of q(C))."""
    p_first = kernel.o_comp * (device.available_sms - 1)  # P(1)
    a_first, a_last = -(-w_comp // p_first), -(-splits * w_comp // p_first)
    if not kernel.tail_helpers:
        return None, a_first, splits, a_last, 1
    q_tail = _tail_q(c_top, w_comm, rho, kernel, device, c_max, c_sat)
    return q_tail, a_first + q_tail, splits - 1, a_last + q_tail, 0


def _tail_q(c: int, w_comm: int, rho: float, kernel: KernelSpec, device: DeviceSpec,
            c_max: int, c_sat: float | None) -> float:
    """q_tail(C): the last split served by min(C + G - R(C), C_max) CTAs at rho."""
    tail = min(c + device.available_sms - -(-c // kernel.o_comm), c_max)
    return service_time(w_comm, tail, rho, c_sat)


def _winner(c: int, end: int, t: float, w_comp: int, kernel: KernelSpec,
            device: DeviceSpec) -> tuple[int, int, float]:
    """(C, P(C), T) of C..end (one T) that the tie-break takes: the least (-W_comp) mod P,
    then the least C, so the least C with the least P (with W_comp = 0, 0 at every P: C)."""
    o_comm = kernel.o_comm
    win = c if w_comp == 0 else max(c, o_comm * (-(-end // o_comm) - 1) + 1)
    return win, kernel.o_comp * (device.available_sms - -(-win // o_comm)), t


def _same_t(w_comp: int, splits: int, kernel: KernelSpec, device: DeviceSpec, c: int,
            top: int, p: int, q: float) -> int:
    """The largest C' in C..top (one q) with T(C') = T(C) by the same arithmetic: the
    same A_0 and A_{L-1}, by the closed form (C itself where the recurrence may run)."""
    a_first = -(-w_comp // p)
    if splits > 2 and a_first - 1 < q < a_first:
        return c
    p_least = 0  # ceil(w / P') = A while P' >= ceil(w / A)
    for w in (w_comp, splits * w_comp):
        a = -(-w // p)
        if a and -(-w // a) > p_least:
            p_least = -(-w // a)
    # P(C') >= p_least  <=>  R(C') <= G - ceil(p_least / o_comp)
    return min(top, kernel.o_comm * (device.available_sms - -(-p_least // kernel.o_comp)))


def _finite(w_comp: int, w_comm: int, rho: float, splits: int, sat: float) -> bool:
    """Every T(C) finite with room to spare (then so is the bounds' arithmetic)."""
    try:
        return (splits + 1) * (rho * (w_comm + sat + 1.0) + w_comp + 1.0) < 1e300
    except OverflowError:
        return False
