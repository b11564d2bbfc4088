"""The planner's decision the straightforward way, kept as the reference its fast paths
are tested against (tests/test_planner_fast.py): T(C) at every legal C by the closed
forms of eqs. 10-13 (each C on its own, no bounds, no lists shared), C* by Algorithm 1's
ties, and the op's L by ranking every candidate from a fresh Workload. This is the code
the planner ran before its bounds and caches, kept verbatim in what it computes."""

from __future__ import annotations

from megatron_overlap.planner import (Calibration, DeviceSpec, KernelSpec, Workload,
                                      comm_tiles, compute_tiles, service_ratio)
from megatron_overlap.planner.quantities import recurrence

TIE_RTOL = 1e-9


def _q(w_comm: int, c: int, rho: float, sat: float) -> float:
    return rho * ((w_comm + c - 1) // c + sat)


def _t(w_comp, splits, p, q, q_tail) -> float:
    """T(C) from P, q, q_tail; q_tail None: the partition's form without tail helpers."""
    lw = splits * w_comp
    if q_tail is None:
        a, b = (lw + p - 1) // p + q, (w_comp + p - 1) // p + splits * q
        t = a if a > b else b
    else:
        # (no q term at L = 1, also where q overflowed to inf: 0 * inf is NaN)
        a, b = (lw + p - 1) // p, (w_comp + p - 1) // p + ((splits - 1) * q if splits > 1 else 0)
        t = (a if a > b else b) + q_tail
    if splits > 2 and w_comp // p < q < (w_comp + p - 1) // p:
        t = recurrence(w_comp, p, splits, q, q if q_tail is None else q_tail)
    return t


def reference_curve(w_comp, w_comm, rho, splits, kernel: KernelSpec, device: DeviceSpec,
                    calib: Calibration) -> tuple[list[int], list[float], list[int]]:
    """(C, T(C), P(C)) for every legal C of the kernel's placement."""
    g, o_comp, o_comm = device.available_sms, kernel.o_comp, kernel.o_comm
    c_max, c_sat = calib.c_max, calib.c_sat
    rho_f = rho * (calib.overlap_factor or 1.0)
    sat = 0.0 if c_sat is None else w_comm / c_sat
    if kernel.shared_sms:
        cs = list(range(1, g + 1))
        ps = [o_comp * g] * g
        top = max(c_max, g)
        q_tails = ([_q(w_comm, min(c + g, top), rho, sat) for c in cs] if kernel.tail_helpers
                   else [_q(w_comm, c, rho_f, sat) for c in cs])
    else:
        c_top = min(c_max, o_comm * (g - 1))
        if c_top < 1:
            raise ValueError("no legal C")
        cs = list(range(1, c_top + 1))
        ps = [o_comp * (g - (c + o_comm - 1) // o_comm) for c in cs]
        q_tails = ([_q(w_comm, min(c + g - (c + o_comm - 1) // o_comm, c_max), rho, sat)
                    for c in cs] if kernel.tail_helpers else [None] * len(cs))
    ts = [_t(w_comp, splits, p, _q(w_comm, c, rho_f, sat), qt)
          for c, p, qt in zip(cs, ps, q_tails)]
    return cs, ts, ps


def reference_solve(w_comp, w_comm, rho, splits, kernel, device, calib) -> tuple[int, float]:
    """(C*, T(C*)): the least T(C); ties (|dT| <= 1e-9 T) to the larger C when shared,
    else to the least Delta_comp = (-W_comp) mod P, then the smaller C."""
    cs, ts, ps = reference_curve(w_comp, w_comm, rho, splits, kernel, device, calib)
    t_min = min(ts)
    tied = [i for i, t in enumerate(ts) if t - t_min <= TIE_RTOL * t_min]
    if kernel.shared_sms:
        best = max(tied)
    else:
        best = min(tied, key=lambda i: (-w_comp % ps[i], cs[i]))
    return cs[best], ts[best]


def reference_plan(workload: Workload, kernel, device, calib) -> tuple[int, float, int, int, float]:
    """(C*, T(C*), W_comp, W_comm, rho) of a validated workload."""
    w_comp, w_comm = compute_tiles(workload, kernel), comm_tiles(workload, kernel)
    rho = service_ratio(workload, kernel, calib)
    best, t = reference_solve(w_comp, w_comm, rho, workload.splits, kernel, device, calib)
    return best, t, w_comp, w_comm, rho


def reference_memory_t(tokens, hidden, ffn, splits, local_experts, tile_m, row_tiles, w_comp,
                       slots, phi, element_bytes=2, phi_w=None) -> float:
    """T_mem(L) of the splits' roofline (`planner.roofline`'s doc) at M = `tokens`, its
    bytes computed whole at that M, as the roofline was first written (the op passes M
    to it per launch instead)."""
    e = element_bytes
    x_row, y_row = tile_m * ffn * e, tile_m * hidden * e  # |x|, |y| per row tile
    weights, out = local_experts * hidden * ffn * e, tokens * hidden * e
    f0, r0 = weights / splits, x_row + y_row / splits  # B_0
    ft, rt = out / splits, y_row / splits  # B_t
    r1 = r0 + rt  # B_s = f0 + ft + r1 per row tile, s >= 1
    a_last = -(-splits * w_comp // slots)  # A_{L-1}
    # the splits' bytes, the weights' (f0 per split) at Phi_W, the rest at Phi
    weights_t = (f0 + (splits - 1) * f0) / (phi_w or phi)
    rest_t = (r0 * row_tiles + (splits - 1) * (ft + r1 * row_tiles)) / phi
    return max(a_last, weights_t + rest_t) + (ft + rt * row_tiles) / phi
