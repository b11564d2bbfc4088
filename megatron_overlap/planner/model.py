"""The wave-quantized analytical model of the paper's section III (stdlib only).

Glossary (names as in the paper, so this file reads beside section III):

    M        global tokens before top-k (B*S over the reduce-scatter group)
    N        hidden size, the GEMM2 output width
    K        GEMM2 reduction dim on this rank (expert FFN / expert-TP)
    D        ranks in the reduce-scatter group (TP x EP)
    L        splits: split s covers hidden columns [s*ceil(N/L), (s+1)*ceil(N/L))
    g        input groups of grouped GEMM2
    M_e      token-expert assignments routed to local expert e
    TM, TN   compute tile;  TMc, TNc  communication tile
    o_comp   resident GEMM2 CTAs per SM;  o_comm  resident GatherRS CTAs per SM
    G        SMs available to the operator
    C        communication CTAs (the decision)
    R(C)     SMs reserved for them = ceil(C / o_comm)                      (eq. 2)
    P(C)     compute slots = o_comp * (G - R(C))                            (eq. 4)
    W_comp   compute tiles per split                                        (eq. 6)
    W_comm   communication tiles per split and rank                         (eq. 8)
    V_comp   compute waves per split = ceil(W_comp / P)                     (eq. 7)
    V_comm   communication waves per split = ceil(W_comm / C)               (eq. 9)
    rho      communication-wave time over compute-wave time                 (eq. 15)
    A_s      readiness of split s = ceil((s+1) W_comp / P)                  (eq. 10)
    q        service time of one split = rho * V_comm                       (eq. 11)
             with a calibrated C_sat (Hopper): rho * (V_comm + W_comm / C_sat)
    F_s      completion of split s = max(A_s, F_{s-1}) + q, F_{-1} = 0      (eq. 12)
    T(C)     F_{L-1}, in compute-wave units                                 (eq. 13)

C* = argmin T(C) over 1..C_max with P(C) > 0; ties (|dT| <= 1e-9 T) go to the smaller
Delta_comp = V_comp * P - W_comp (eq. 18), then to the smaller C.

Beyond the paper, the shared placement (KernelSpec.shared_sms): the communication CTAs
are small (4 warps) and sit beside GEMM2's CTAs on the SMs instead of taking SMs of
their own, in the registers and shared memory two GEMM2 CTAs leave. Then R(C) = 0 and
P = o_comp G for every C, and C runs up to G (one beside GEMM2 on each SM). GEMM2's
persistent tiles are dealt to its CTAs in a fixed order, so an SM that carries a
communication CTA is a straggler of every wave unless every SM carries one: ties go
to the larger C, and with P independent of C the model's T(C) never rises with C, so
C* = G (measured: C = G/2 was slower than G in all six cases, docs/RESULTS.md).

Beyond the paper: C_sat, the communication CTAs whose traffic saturates the memory
system and the peer links. Eq. 11 assumes every CTA moves data at the rate of one
alone; on H200 a wave slows as more CTAs share the bandwidth, and GatherRS alone fits
t(C) = t_wave * (V_comm + W_comm / C_sat) (a latency term and a bandwidth term, the
second independent of C). So q never falls below rho * W_comm / C_sat however many
CTAs communicate, while P(C) keeps falling. C_sat is measured once per device and
kernel family (tools/calibrate.py); without it (the paper's presets) the model is
exactly section III's.

Also beyond the paper, two terms of rho's scaling (eq. 15), each off unless calibrated:
  * K_epi: a compute wave costs t (K + K_epi), not t K: its prologue and epilogue (the
    TM x TN store and the readiness flag) do not shrink with K. On H200 K_epi is about
    600-970 (the shipped value is calibrate's two-point 971), so at K = 256 a wave
    takes about twice what K-proportional scaling says.
  * top-k: a communication tile gathers k rows per token and writes one, so its bytes
    scale with TMc * TNc * (k + 1), not with TMc * TNc alone; the reference is the
    calibration case's k (topk_ref). Under expert parallelism a rank holds only some of
    a token's k rows (masked loads of the absent ones move nothing): a workload's
    `local_topk` (rows per token routed to this rank's experts, k E_local / E on
    average) replaces k there when the caller gives it.

And the overlap factor f (Calibration.overlap_factor, off unless set): rho_ref is
contention-free, but the splits served while GEMM2 runs share the memory system with
it, and their waves take f times longer: q = f rho V_comm. With tail helpers the last
split is served after GEMM2 ends, by C + G - R(C) CTAs counted up to C_max, at rho;
without them f scales every split. tools/calibrate.py fits f from an overlapped C sweep of its one case; the
shipped H200 value (1.7) is fitted on the C sweeps of three runs over all three models
instead, which planned better than the one-case fit (two H200s: 1.6%-1.7% mean regret against
5.4% for a file made end to end by the tool; docs/RESULTS.md, 'Calibration').
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass
from typing import NamedTuple

#: The fixed communication-CTA count of the public COMET A100 path; what "disabled" returns.
DEFAULT_COMM_CTAS = 3
#: The largest C_max a calibration may name (C never exceeds the SMs of a device).
MAX_C = 4096
_TIE_RTOL = 1e-9


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _require_int(obj: object, name: str, minimum: int) -> None:
    value = getattr(obj, name)
    if type(value) is int and value >= minimum:  # (the common case first: every launch)
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{type(obj).__name__}.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{type(obj).__name__}.{name} must be >= {minimum}, got {value}")


def _require_real(obj: object, name: str, minimum: float, strict: bool = False,
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
        for name in ("tokens", "hidden", "ffn", "world", "splits", "groups"):
            _require_int(self, name, 1)
        if self.topk is not None:
            _require_int(self, "topk", 1)
        _require_real(self, "local_topk", 0)
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
    # The op's tail helpers (module doc): the last split served after GEMM2 by
    # C + G - R(C) CTAs, up to C_max. The op sets it when it launches them.
    tail_helpers: bool = False
    # The shared placement (module doc): communication CTAs beside GEMM2's, R(C) = 0.
    shared_sms: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name not in ("tail_helpers", "shared_sms"):
                _require_int(self, f.name, 1)
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
        _require_int(self, "sms", 1)
        if self.sms > MAX_C:  # (the planner's curve has one point per C up to G)
            raise ValueError(f"DeviceSpec.sms must be <= {MAX_C}, got {self.sms}")
        _require_int(self, "sm_margin", 0)
        if self.sm_margin >= self.sms:
            raise ValueError(
                f"DeviceSpec.sm_margin ({self.sm_margin}) must leave at least one of "
                f"{self.sms} SMs"
            )

    @property
    def available_sms(self) -> int:  # G
        return self.sms - self.sm_margin


@dataclass(frozen=True)
class Calibration:
    """The service-rate reference of section III-C and the legal range of C."""

    rho_ref: float
    k_ref: int
    tm_ref: int
    tn_ref: int
    d_ref: int
    c_max: int
    # Communication tile of the measurement. The paper's model has one comm tile shape;
    # with these set, rho also scales with the comm tile area TMc*TNc / (TMc_ref*TNc_ref)
    # (a wave of bigger tiles moves more bytes), so shapes whose top-k or split width
    # change the comm tile are compared fairly. None (the paper's preset): no scaling.
    tmc_ref: int | None = None
    tnc_ref: int | None = None
    # Saturation: q = rho * (ceil(W_comm / C) + W_comm / c_sat), so a split's service
    # never drops below rho * W_comm / c_sat. None (the paper's presets): eq. 11 alone.
    c_sat: float | None = None
    # A compute wave's cost is t (K + k_epi) (module doc); None: t K, the paper's eq. 15.
    k_epi: float | None = None
    # The calibration case's top-k; set, rho scales with (k + 1) / (topk_ref + 1).
    topk_ref: int | None = None
    # f: waves of the splits served while GEMM2 runs take f rho (module doc); None: rho.
    overlap_factor: float | None = None

    def __post_init__(self) -> None:
        _require_real(self, "c_sat", 0, strict=True)
        _require_real(self, "overlap_factor", 0, strict=True)
        _require_real(self, "k_epi", 0)
        _require_real(self, "rho_ref", 0, strict=True, optional=False)
        for name in ("k_ref", "tm_ref", "tn_ref", "d_ref", "c_max"):
            _require_int(self, name, 1)
        if self.c_max > MAX_C:
            raise ValueError(f"Calibration.c_max must be <= {MAX_C}, got {self.c_max}")
        for name in ("tmc_ref", "tnc_ref", "topk_ref"):
            if getattr(self, name) is not None:
                _require_int(self, name, 1)

    @staticmethod
    def rho_from_measurement(
        comm_us: float, comm_splits: int, comp_us: float, comp_waves: int
    ) -> float:
        """rho_ref (eq. 14): time of one communication wave over one compute wave."""
        if min(comm_us, comp_us) <= 0 or min(comm_splits, comp_waves) < 1:
            raise ValueError("measurements must be positive")
        return (comm_us / comm_splits) / (comp_us / comp_waves)


class _Curve:
    """(C, T(C)) for C = 1, 2, ..., built when first read: a launch reads only C* and
    T(C*), and in the shared placement C* needs no other T(C) (`_solve`).

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
        return self.points == (other.points if isinstance(other, _Curve) else other)

    def __hash__(self) -> int:
        return hash(self.points)

    def __repr__(self) -> str:
        return repr(self.points)


class _PlanFields(NamedTuple):
    comm_ctas: int  # C*
    reservation: int  # R(C*)
    compute_slots: int  # P(C*)
    splits: int  # L
    predicted: float  # T(C*)
    curve: _Curve  # (C, T(C)) for every legal C; read as Plan.curve, a tuple
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
        return held.points if isinstance(held, _Curve) else held

    def _asdict(self) -> dict:
        return {**super()._asdict(), "curve": self.curve}


def reservation(c: int, kernel: KernelSpec) -> int:
    """R(C) = ceil(C / o_comm): SMs that C resident communication CTAs need (eq. 2);
    0 in the shared placement (they sit beside GEMM2's CTAs)."""
    return 0 if kernel.shared_sms else _ceil(c, kernel.o_comm)


def compute_slots(c: int, kernel: KernelSpec, device: DeviceSpec) -> int:
    """P(C) = o_comp * (G - R(C)) (eq. 4); <= 0 means C is not legal."""
    return kernel.o_comp * (device.available_sms - reservation(c, kernel))


def compute_tiles(w: Workload, kernel: KernelSpec) -> int:
    """W_comp = g * sum_e ceil(M_e / TM) * ceil(ceil(N/L) / TN) (eq. 6)."""
    return w.groups * expert_row_tiles(w.expert_counts, kernel.tile_m) * _ceil(
        _ceil(w.hidden, w.splits), kernel.tile_n
    )


def expert_row_tiles(expert_counts, tile_m: int) -> int:
    """sum_e ceil(M_e / TM): the only thing the model reads of the routing."""
    tm1 = tile_m - 1
    return sum([(c + tm1) // tile_m for c in expert_counts])


def comm_tiles(w: Workload, kernel: KernelSpec) -> int:
    """W_comm = ceil(ceil(M/D) / TMc) * ceil(ceil(N/L) / TNc) (eq. 8)."""
    return _ceil(_ceil(w.tokens, w.world), kernel.comm_tile_m) * _ceil(
        _ceil(w.hidden, w.splits), kernel.comm_tile_n
    )


def service_ratio(w: Workload, kernel: KernelSpec, calib: Calibration) -> float:
    """rho = rho_ref (K_ref/K) (TM_ref TN_ref)/(TM TN) (D/D_ref) (eq. 15), times
    (TMc TNc)/(TMc_ref TNc_ref) when the calibration records its comm tile. Calibrated
    K_epi replaces K_ref/K by (K_ref + K_epi)/(K + K_epi); a calibrated topk_ref (and a
    workload top-k) multiplies by (k + 1)/(topk_ref + 1)."""
    k_ratio = (calib.k_ref / w.ffn if calib.k_epi is None
               else (calib.k_ref + calib.k_epi) / (w.ffn + calib.k_epi))
    rho = (
        calib.rho_ref
        * k_ratio
        * (calib.tm_ref * calib.tn_ref) / (kernel.tile_m * kernel.tile_n)
        * (w.world / calib.d_ref)
    )
    if calib.tmc_ref is not None and calib.tnc_ref is not None:
        rho *= (kernel.comm_tile_m * kernel.comm_tile_n) / (calib.tmc_ref * calib.tnc_ref)
    if calib.topk_ref is not None and w.topk is not None:
        k = w.topk if w.local_topk is None else w.local_topk
        rho *= (k + 1) / (calib.topk_ref + 1)
    return rho


def service_time(w_comm: int, c: int, rho: float, c_sat: float | None = None) -> float:
    """q(C) = rho * ceil(W_comm / C) (eq. 11), plus rho * W_comm / C_sat when calibrated."""
    waves = -(-w_comm // c)
    return rho * (waves + w_comm / c_sat) if c_sat is not None else rho * waves


def makespan(w_comp: int, w_comm: int, p: int, c: int, splits: int, rho: float,
             c_sat: float | None = None, tail_ctas: int | None = None,
             overlap: float | None = None) -> float:
    """T(C) = F_{L-1} of the split recurrence (eqs. 10-13), in compute waves: the
    reference that the closed form of `_curve` is tested against.

    `tail_ctas`: CTAs that serve the last split (C plus the tail helpers) after GEMM2, at
    rho; None = C. `overlap`: f on rho for the other splits (all of them without helpers).
    """
    q = service_time(w_comm, c, rho * (overlap or 1.0), c_sat)
    q_tail = q if tail_ctas is None else service_time(w_comm, tail_ctas, rho, c_sat)
    return _recurrence(w_comp, p, splits, q, q_tail)


def _recurrence(w_comp: int, p: int, splits: int, q: float, q_tail: float) -> float:
    """F_s = max(A_s, F_{s-1}) + q (eq. 12), F_{-1} = 0, the last split at q_tail."""
    f = 0.0
    for s in range(splits):
        a_s = -(-(s + 1) * w_comp // p)
        f = (a_s if a_s > f else f) + (q_tail if s == splits - 1 else q)
    return f


def ranking_calibration(calib: Calibration) -> Calibration:
    """The calibration the op ranks L with: f was fitted and checked at a fixed L, and
    ranking L with it (and the tail-helper term) picked one split, no overlap, almost
    everywhere (measured on two H200s: every such plan slower). Pair it with KernelSpec(tail_helpers=False)."""
    return dataclasses.replace(calib, overlap_factor=None)


def tail_ctas(c: int, kernel: KernelSpec, device: DeviceSpec, c_max: int) -> int | None:
    """CTAs serving the last split: C + G - R(C) with tail helpers, else None (= C).

    Counted up to C_max only: past the saturation point of the calibration's sweep more
    communication CTAs move no more bytes (the tail would otherwise look nearly free, and
    one split, with no overlap at all, would look best)."""
    if not kernel.tail_helpers:
        return None
    return min(c + device.available_sms - reservation(c, kernel), max(c, c_max))


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
                ts[i] = _recurrence(w_comp, p, splits, q, q if q_tails is None else q_tails[i])
    return ts


def _partition_ts(w_comp: int, w_comm: int, rho: float, splits: int, kernel: KernelSpec,
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


def _shared_ts(cs, w_comp: int, w_comm: int, rho: float, splits: int, kernel: KernelSpec,
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
           overlap: float | None = None) -> tuple[int, float, _Curve]:
    """Algorithm 1 on precomputed tile counts: C*, T(C*) and the T(C) curve."""
    g, o_comp, o_comm = device.available_sms, kernel.o_comp, kernel.o_comm
    args = (w_comp, w_comm, rho, splits, kernel, device)
    if kernel.shared_sms:
        # P = o_comp G for every C, and q(C), q_tail(C) never rise with C, nor then does
        # T(C) (max and + round monotonically): T(G) is the least, ties go to the larger
        # C, so C* = G. The other T(C) are computed only if the curve is read.
        t_best = _finite_min(_shared_ts((g,), *args, c_max, c_sat, overlap), rho)
        return g, t_best, _Curve(functools.partial(
            _shared_ts, range(1, g + 1), *args, c_max, c_sat, overlap))
    c_top = min(c_max, o_comm * (g - 1))  # the largest C with P(C) > 0
    if c_top < 1:
        raise ValueError(
            f"DeviceSpec.sms: no legal C in 1..{c_max}: P(C) = {o_comp} * "
            f"({g} - R(C)) <= 0 for every C (G={g}, o_comm={o_comm})"
        )
    ts, ps = _partition_ts(*args, c_top, c_max, c_sat, overlap)
    t_min = _finite_min(ts, rho)
    tol = _TIE_RTOL * t_min
    tied = [c for c, t in enumerate(ts, 1) if t - t_min <= tol]
    # ties: the least Delta_comp = V_comp P - W_comp = (-W_comp) mod P (eq. 18), then C
    best = tied[0] if len(tied) == 1 else min(tied, key=lambda c: (-w_comp % ps[c - 1], c))
    return best, ts[best - 1], _Curve(ts)


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
              device: DeviceSpec, calib: Calibration, curve: _Curve) -> float:
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
        return _shared_ts((c,), w_comp, w_comm, rho, splits, kernel, device, calib.c_max,
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
