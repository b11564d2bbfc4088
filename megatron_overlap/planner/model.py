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

Where each part lives (the names are importable from `megatron_overlap.planner`; this
module re-exports the ones it defined before the split, for tools that import them here):

    inputs.py        Workload, KernelSpec, DeviceSpec (the inputs), MAX_C
    calibration.py   Calibration (rho_ref and the terms above), ranking_calibration
    quantities.py    R, P, W_comp, W_comm, rho, q, and T(C) by the recurrence (makespan),
                     tail_ctas
    curve.py         T(C) in closed form, at one C or every C; the curve a Plan holds
    bounds.py        the C that can be C* (a bound on T below each C; one T per stretch)
    search.py        Algorithm 1: C* and its ties (solve, plan, timed_plan), Plan
    cache.py         PlanCache: plans, and what does not read the routing, per sizes
"""

from __future__ import annotations

from .calibration import Calibration, ranking_calibration
from .inputs import MAX_C, DeviceSpec, KernelSpec, Workload
from .quantities import (comm_tiles, compute_slots, compute_tiles, expert_row_tiles, makespan,
                         reservation, service_ratio, service_time, tail_ctas)
from .search import DEFAULT_COMM_CTAS, Plan, plan, solve, timed_plan

__all__ = [
    "Calibration", "DEFAULT_COMM_CTAS", "DeviceSpec", "KernelSpec", "MAX_C", "Plan", "Workload",
    "comm_tiles", "compute_slots", "compute_tiles", "expert_row_tiles", "makespan", "plan",
    "ranking_calibration", "reservation", "service_ratio", "service_time", "solve", "tail_ctas",
    "timed_plan",
]
