"""T(C) in closed form (stdlib only): the closed forms of the recurrence (eqs. 10-13) at
one C (`t_at`) or every C of a placement, equal to quantities.makespan for each C
(tested), and the lazily built curve a Plan holds.
"""

from __future__ import annotations

import itertools

from .inputs import DeviceSpec, KernelSpec
from .quantities import recurrence, service_time


class Curve:
    """(C, T(C)) for C = 1, 2, ..., built when first read: a launch reads only C* and
    T(C*), and in the shared placement C* needs no other T(C) (search._solve).

    `ts` is the list of T(C), or a module function (so that a Plan still pickles) that
    returns it from `args`."""

    __slots__ = ("_ts", "_args", "_points")

    def __init__(self, ts, args: tuple = ()):
        self._ts, self._args, self._points = ts, args, None

    @property
    def points(self) -> tuple[tuple[int, float], ...]:
        if self._points is None:
            ts = self._ts if isinstance(self._ts, list) else self._ts(*self._args)
            self._points = tuple(zip(range(1, len(ts) + 1), ts))
        return self._points

    # (so that Plans compare, hash and print as they did when they held the tuple)
    def __eq__(self, other) -> bool:
        return self.points == (other.points if isinstance(other, Curve) else other)

    def __hash__(self) -> int:
        return hash(self.points)

    def __repr__(self) -> str:
        return repr(self.points)


def _service_times(w_comm: int, cs, rho: float, c_sat: float | None) -> list[float]:
    """`service_time` for each C of `cs` (the same arithmetic), as one list."""
    if c_sat is None:
        return [rho * ((w_comm + c - 1) // c) for c in cs]
    sat = w_comm / c_sat
    return [rho * ((w_comm + c - 1) // c + sat) for c in cs]


def t_at(w_comp: int, splits: int, p: int, q: float, q_tail: float | None = None) -> float:
    """T(C) from P(C), q(C) and q_tail(C), the last split's (None: q, the partition's form
    without tail helpers): equal to `makespan` (tested), without its loop over the splits.

    Unrolled, F_{L-1} = max_s (A_s + (L-1-s) q) + q_tail, and A_s - A_{s-1} is
    floor(W_comp/P) or ceil(W_comp/P): so the max sits at s = L-1 when q <= floor(W_comp/P),
    at s = 0 when q >= ceil(W_comp/P), and L <= 2 has no other term. Only q strictly
    between the two, with L >= 3, needs the recurrence.
    """
    if splits > 2 and w_comp // p < q < (w_comp + p - 1) // p:  # q strictly inside
        return recurrence(w_comp, p, splits, q, q if q_tail is None else q_tail)
    a_first, a_last = (w_comp + p - 1) // p, (splits * w_comp + p - 1) // p  # A_0, A_{L-1}
    if q_tail is None:  # A_{L-1} + q against A_0 + L q (the partition's form since eq. 13)
        a, b = a_last + q, a_first + splits * q
        return a if a > b else b
    # max(A_{L-1}, A_0 + (L-1) q) + q_tail: for L <= 2 (no q term at L = 1: where q
    # overflowed to inf, 0 * inf would make T NaN, which no C compares with)
    b = a_first + (splits - 1) * q if splits > 1 else a_first
    return (a_last if a_last > b else b) + q_tail  # the recurrence's own sums


def _curve(w_comp: int, w_comm: int, splits: int, cs, ps, rho: float, c_sat: float | None,
           q_tails: list[float] | None = None) -> list[float]:
    """T(C) for each C of `cs`, with P(C) from `ps`, q(C) = `service_time` at `rho` and
    q_tail(C) from `q_tails` (None: q), by `t_at`."""
    sat = 0.0 if c_sat is None else w_comm / c_sat  # (0.0: exactly rho * waves, as eq. 11)
    return [t_at(w_comp, splits, p, rho * ((w_comm + c - 1) // c + sat), q_tail)
            for c, p, q_tail in zip(cs, ps, q_tails or itertools.repeat(None))]


def partition_slots(cs, kernel: KernelSpec, device: DeviceSpec) -> range | list[int]:
    """P(C) = o_comp (G - R(C)) for each C of the range `cs` (a range where o_comm = 1)."""
    g, o_comp, o_comm = device.available_sms, kernel.o_comp, kernel.o_comm
    if o_comm == 1:  # P(C) = o_comp (G - C)
        return range(o_comp * (g - cs.start), o_comp * (g - cs.stop), -o_comp * cs.step)
    return [o_comp * (g - (c + o_comm - 1) // o_comm) for c in cs]


def partition_tails(cs, w_comm: int, rho: float, kernel: KernelSpec, device: DeviceSpec,
                    c_max: int, c_sat: float | None) -> list[float] | None:
    """q_tail(C) for each C of `cs`: the last split served by min(C + G - R(C), C_max)
    CTAs at rho (C <= C_max) with tail helpers; None without them (f scales every split
    alike, the last split's q is q)."""
    if not kernel.tail_helpers:
        return None
    g, o_comm = device.available_sms, kernel.o_comm
    if o_comm == 1:  # C + G - R(C) = G for every C
        return [service_time(w_comm, min(g, c_max), rho, c_sat)] * len(cs)
    tails = [min(c + g - (c + o_comm - 1) // o_comm, c_max) for c in cs]
    return _service_times(w_comm, tails, rho, c_sat)


def partition_ts(w_comp: int, w_comm: int, rho: float, splits: int, kernel: KernelSpec,
                 device: DeviceSpec, cs: range, c_max: int, c_sat: float | None,
                 overlap: float | None) -> tuple[list[float], range | list[int]]:
    """T(C) and P(C) for each C of the range `cs` in the partition placement."""
    ps = partition_slots(cs, kernel, device)
    q_tails = partition_tails(cs, w_comm, rho, kernel, device, c_max, c_sat)
    return _curve(w_comp, w_comm, splits, cs, ps, rho * (overlap or 1.0), c_sat, q_tails), ps


def curve_ts(w_comp: int, w_comm: int, rho: float, splits: int, kernel: KernelSpec,
             device: DeviceSpec, c_max: int, c_sat: float | None,
             overlap: float | None) -> list[float]:
    """T(C) at every legal C of the kernel's placement (C = 1..G when shared, 1..C_top
    with P(C) > 0 in the partition)."""
    args = (w_comp, w_comm, rho, splits, kernel, device)
    g = device.available_sms
    if kernel.shared_sms:
        return shared_ts(range(1, g + 1), *args, c_max, c_sat, overlap)
    c_top = min(c_max, kernel.o_comm * (g - 1))
    return partition_ts(*args, range(1, c_top + 1), c_max, c_sat, overlap)[0]


def shared_ts(cs, w_comp: int, w_comm: int, rho: float, splits: int, kernel: KernelSpec,
              device: DeviceSpec, c_max: int, c_sat: float | None,
              overlap: float | None) -> list[float]:
    """T(C) for each C of `cs` in the shared placement (P = o_comp G for every C)."""
    g, rho_f = device.available_sms, rho * (overlap or 1.0)
    if kernel.tail_helpers:  # the last split: tail_ctas = min(C + G, max(C_max, G)), at rho
        top = max(c_max, g)
        q_tails = _service_times(w_comm, [min(c + g, top) for c in cs], rho, c_sat)
    else:  # (q itself: the recurrence's own sums for L <= 2, as `makespan` adds them)
        q_tails = _service_times(w_comm, cs, rho_f, c_sat)
    return _curve(w_comp, w_comm, splits, cs, [kernel.o_comp * g] * len(cs), rho_f, c_sat,
                  q_tails)


def shared_t(c: int, w_comp: int, w_comm: int, rho: float, splits: int, kernel: KernelSpec,
             device: DeviceSpec, c_max: int, c_sat: float | None,
             overlap: float | None) -> float:
    """T(C) at one C of the shared placement, `shared_ts`'s arithmetic without its lists
    (C* = G reads no other)."""
    q, q_tail = shared_q(c, w_comm, rho, kernel, device, c_max, c_sat, overlap)
    return t_at(w_comp, splits, kernel.o_comp * device.available_sms, q, q_tail)


def shared_q(c: int, w_comm: int, rho: float, kernel: KernelSpec, device: DeviceSpec,
             c_max: int, c_sat: float | None, overlap: float | None) -> tuple[float, float]:
    """q(C) and q_tail(C) in the shared placement, as `shared_ts` computes them: neither
    reads the routing."""
    g = device.available_sms
    q = service_time(w_comm, c, rho * (overlap or 1.0), c_sat)
    if kernel.tail_helpers:  # the last split: min(C + G, max(C_max, G)) CTAs, at rho
        return q, service_time(w_comm, min(c + g, max(c_max, g)), rho, c_sat)
    return q, q
