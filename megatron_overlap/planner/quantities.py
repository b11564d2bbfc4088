"""The model's named quantities (paper section III, eqs. 2-15; stdlib only).

Each is a function of the inputs alone (inputs.py, calibration.py):

    R(C)      reservation       SMs the communication CTAs take          (eq. 2)
    P(C)      compute_slots     GEMM2's resident CTA slots               (eq. 4)
    W_comp    compute_tiles     compute tiles per split                  (eq. 6)
    W_comm    comm_tiles        communication tiles per split and rank   (eq. 8)
    rho       service_ratio     communication wave over compute wave     (eq. 15)
    q(C)      service_time      service time of one split                (eq. 11)
    A_s, F_s  makespan          readiness and completion of split s      (eqs. 10-12)
    T(C)      makespan          F_{L-1}, in compute waves                (eq. 13)

`makespan` is the literal recurrence over the splits; curve.py computes T(C) for every
C at once in closed form and is tested against it. The glossary: `model.py`'s docstring.
"""

from __future__ import annotations

from .calibration import Calibration
from .inputs import DeviceSpec, KernelSpec, Sizes, Workload


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def reservation(c: int, kernel: KernelSpec) -> int:
    """R(C) = ceil(C / o_comm): SMs that C resident communication CTAs need (eq. 2);
    0 in the shared placement (they sit beside GEMM2's CTAs)."""
    return 0 if kernel.shared_sms else _ceil(c, kernel.o_comm)


def compute_slots(c: int, kernel: KernelSpec, device: DeviceSpec) -> int:
    """P(C) = o_comp * (G - R(C)) (eq. 4); <= 0 means C is not legal."""
    return kernel.o_comp * (device.available_sms - reservation(c, kernel))


def compute_tiles(w: Workload, kernel: KernelSpec) -> int:
    """W_comp = g * sum_e ceil(M_e / TM) * ceil(ceil(N/L) / TN) (eq. 6)."""
    return w.groups * expert_row_tiles(w.expert_counts, kernel.tile_m) * split_col_tiles(
        w, kernel)


def split_col_tiles(w: Workload | Sizes, kernel: KernelSpec) -> int:
    """ceil(ceil(N/L) / TN): the compute tiles across one split's columns."""
    width = -(-w.hidden // w.splits)  # ceil(N/L) (ceil(a / b) = -(-a // b))
    return -(-width // kernel.tile_n)


def expert_row_tiles(expert_counts, tile_m: int) -> int:
    """sum_e ceil(M_e / TM): the only thing the model reads of the routing."""
    tm1 = tile_m - 1
    return sum([(c + tm1) // tile_m for c in expert_counts])


def comm_tiles(w: Workload | Sizes, kernel: KernelSpec) -> int:
    """W_comm = ceil(ceil(M/D) / TMc) * ceil(ceil(N/L) / TNc) (eq. 8)."""
    return comm_row_tiles(w.tokens, w.world, kernel) * comm_col_tiles(w, kernel)


def comm_row_tiles(tokens: int, world: int, kernel: KernelSpec) -> int:
    """ceil(ceil(M/D) / TMc): W_comm's tiles down a split (of the sizes, M alone changes
    from one call of a layer to the next: `PlanCache` keeps the rest)."""
    rows = -(-tokens // world)  # ceil(M/D) (ceil(a / b) = -(-a // b))
    return -(-rows // kernel.comm_tile_m)


def comm_col_tiles(w: Workload | Sizes, kernel: KernelSpec) -> int:
    """ceil(ceil(N/L) / TNc): W_comm's tiles across a split."""
    width = -(-w.hidden // w.splits)  # ceil(N/L)
    return -(-width // kernel.comm_tile_n)


def service_ratio(w: Workload | Sizes, kernel: KernelSpec, calib: Calibration) -> float:
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
    reference that the closed forms of curve.py are tested against.

    `tail_ctas`: CTAs that serve the last split (C plus the tail helpers) after GEMM2, at
    rho; None = C. `overlap`: f on rho for the other splits (all of them without helpers).
    """
    q = service_time(w_comm, c, rho * (overlap or 1.0), c_sat)
    q_tail = q if tail_ctas is None else service_time(w_comm, tail_ctas, rho, c_sat)
    return recurrence(w_comp, p, splits, q, q_tail)


def recurrence(w_comp: int, p: int, splits: int, q: float, q_tail: float) -> float:
    """F_s = max(A_s, F_{s-1}) + q (eq. 12), F_{-1} = 0, the last split at q_tail."""
    f = 0.0
    for s in range(splits):
        a_s = -(-(s + 1) * w_comp // p)
        f = (a_s if a_s > f else f) + (q_tail if s == splits - 1 else q)
    return f


def tail_ctas(c: int, kernel: KernelSpec, device: DeviceSpec, c_max: int) -> int | None:
    """CTAs serving the last split: C + G - R(C) with tail helpers, else None (= C).

    Counted up to C_max only: past the saturation point of the calibration's sweep more
    communication CTAs move no more bytes (the tail would otherwise look nearly free, and
    one split, with no overlap at all, would look best)."""
    if not kernel.tail_helpers:
        return None
    return min(c + device.available_sms - reservation(c, kernel), max(c, c_max))
