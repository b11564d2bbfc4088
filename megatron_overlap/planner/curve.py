"""T(C) for every C of a placement at once (stdlib only): the closed forms of the
recurrence (eqs. 10-13), equal to quantities.makespan for each C (tested), and the
lazily built curve a Plan holds.
"""

from __future__ import annotations

from .inputs import DeviceSpec, KernelSpec
from .quantities import recurrence, service_time


class Curve:
    """(C, T(C)) for C = 1, 2, ..., built when first read: a launch reads only C* and
    T(C*), and in the shared placement C* needs no other T(C) (search._solve).

    `ts` is the list of T(C), or a function that returns it (a functools.partial of a
    module function, so that a Plan still pickles)."""

    __slots__ = ("_ts", "_points")

    def __init__(self, ts):
        self._ts, self._points = ts, None

    @property
    def points(self) -> tuple[tuple[int, float], ...]:
        if self._points is None:
            ts = self._ts if isinstance(self._ts, list) else self._ts()
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


def _curve(w_comp: int, w_comm: int, splits: int, cs, ps, rho: float, c_sat: float | None,
           q_tails: list[float] | None = None) -> list[float]:
    """T(C) for each C of `cs`, with P(C) from `ps`, q(C) = `service_time` at `rho` and
    q_tail(C), the last split's, from `q_tails` (None: q): equal to `makespan` for each C
    (tested), without its loop over the splits.

    Unrolled, F_{L-1} = max_s (A_s + (L-1-s) q) + q_tail, and A_s - A_{s-1} is
    floor(W_comp/P) or ceil(W_comp/P): so the max sits at s = L-1 when q <= floor(W_comp/P),
    at s = 0 when q >= ceil(W_comp/P), and L <= 2 has no other term. Only q strictly
    between the two, with L >= 3, needs the recurrence. This runs before every launch:
    one loop, q inline (lists per quantity cost more at tens of C).
    """
    lw, ts = splits * w_comp, []
    sat = 0.0 if c_sat is None else w_comm / c_sat  # (0.0: exactly rho * waves, as eq. 11)
    if q_tails is None:  # A_{L-1} + q against A_0 + L q (the partition's form since eq. 13)
        for c, p in zip(cs, ps):
            q = rho * ((w_comm + c - 1) // c + sat)
            a, b = (lw + p - 1) // p + q, (w_comp + p - 1) // p + splits * q
            ts.append(a if a > b else b)
    else:  # max(A_{L-1}, A_0 + (L-1) q) + q_tail: for L <= 2 the recurrence's own sums
        for c, p, q_tail in zip(cs, ps, q_tails):
            q = rho * ((w_comm + c - 1) // c + sat)
            a, b = (lw + p - 1) // p, (w_comp + p - 1) // p + (splits - 1) * q
            ts.append((a if a > b else b) + q_tail)
    if splits > 2:
        for i, (c, p) in enumerate(zip(cs, ps)):
            q = rho * ((w_comm + c - 1) // c + sat)
            if w_comp // p < q < (w_comp + p - 1) // p:  # q strictly inside
                ts[i] = recurrence(w_comp, p, splits, q, q if q_tails is None else q_tails[i])
    return ts


def partition_ts(w_comp: int, w_comm: int, rho: float, splits: int, kernel: KernelSpec,
                 device: DeviceSpec, c_top: int, c_max: int, c_sat: float | None,
                 overlap: float | None) -> tuple[list[float], range | list[int]]:
    """T(C) and P(C) for C = 1..c_top in the partition placement."""
    g, o_comp, o_comm = device.available_sms, kernel.o_comp, kernel.o_comm
    cs = range(1, c_top + 1)
    if o_comm == 1:  # P(C) = o_comp (G - C)
        ps = range(o_comp * (g - 1), o_comp * (g - c_top) - 1, -o_comp)
    else:
        ps = [o_comp * (g - (c + o_comm - 1) // o_comm) for c in cs]
    q_tails = None  # without tail helpers f scales every split alike
    if kernel.tail_helpers:  # the last split: min(C + G - R(C), C_max) CTAs at rho (C <= C_max)
        if o_comm == 1:  # C + G - R(C) = G for every C
            q_tails = [service_time(w_comm, min(g, c_max), rho, c_sat)] * c_top
        else:
            tails = [min(c + g - (c + o_comm - 1) // o_comm, c_max) for c in cs]
            q_tails = _service_times(w_comm, tails, rho, c_sat)
    return _curve(w_comp, w_comm, splits, cs, ps, rho * (overlap or 1.0), c_sat, q_tails), ps


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
