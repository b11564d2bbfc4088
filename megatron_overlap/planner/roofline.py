"""The splits' roofline: what ranks L where the wave model alone cannot (stdlib only).

The wave model (eqs. 10-13) prices a split by its compute waves and its communication
service q, so its T(L) only falls as L grows: more splits, less communication exposed
after GEMM2. What it leaves out is that GEMM2 and GatherRS share one HBM. Every split
re-reads all of x (a row tile of x is reused only by the column tiles of one split),
writes its slice of y, and overlaps the combine of the split before it, which reads that
slice of y back and writes the output. Past a few splits the bytes of a split outgrow
its compute: on one H200 the captured sweep of L = 1, 2, 4, 8 has its optimum inside,
at 512 columns per split, in every workload (docs/RESULTS.md, "The planner's L").

Quantities, in compute waves like the rest of the model (e: bytes of an element):

    |x| = R K e, |W| = E N K e, |y| = R N e, |out| = M N e      (R = row tiles x TM)
    B_0 = |x| + (|W| + |y|) / L                 split 0: GEMM2 alone
    B_s = B_0 + (|y| + |out|) / L, s >= 1       beside the combine of split s - 1
    B_t = (|y| + |out|) / L                     the combine of the last split, alone
    Phi = P 2 TM TN (K + K_epi) / beta          bytes HBM moves in one compute wave
    Phi_W = P 2 TM TN (K + K_epi) / beta_W      the same for the weights' stream
    T_mem(L) = max(A_{L-1}, sum_s (B_s - |W| / L) / Phi + |W| / Phi_W) + B_t / Phi

GEMM2 ends no earlier than its compute waves (A_{L-1}, eq. 10) nor than the HBM can move
its splits' bytes; the splits are not barriers (a CTA done with split s goes on to s + 1),
so the bound is on the sums, not split by split. (Summing max(c_s, m_s) per split
instead double-counts each split's last partial wave: on the fresh S = 1024 / 2048 sweep
it picked L = 1 for Qwen at S = 1024, 5.6% slower than L = 2.)

beta (`Calibration.hbm_balance`) is GEMM2's FLOP per byte of HBM traffic at the rates the
two sustain side by side, counting a tile's FLOP at K + K_epi (`Calibration.hbm_k_epi`:
the fixed part of a tile's time, as eq. 15 scales a wave's time with K). beta_W
(`Calibration.hbm_stream_balance`) is the same for the expert weights, which GEMM2 reads
as whole TMA tiles of contiguous rows: a pure read stream, at the device-copy rate where
x and y (y's row scatter, the combine's gathers) move at beta's. On one H200, 730 TFLOP/s
over 4.3 TB/s: 170 FLOP per byte, against beta's 230. Where the weights dominate the
bytes (S = 512: W is 173-369 MB, x and y 17-34 MB) pricing them at beta made GEMM2 look
HBM-bound, so the model charged split 0's combine to a busy HBM and chose L = 1, never
the fastest measured there (docs/RESULTS.md, "The planner's L"). The op ranks L by
max(T_wave(L), T_mem(L)): each is a time the launch cannot beat.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from .calibration import Calibration
from .inputs import DeviceSpec, KernelSpec


class SplitBytes(NamedTuple):
    """B_s of one launch shape and L, so that T_mem is a few operations per launch:
    B = fixed + per_row_tile x row_tiles for split 0, the later splits and the tail, and
    for the last two |out| / L, the one count that reads M, which `memory_t` adds from M
    (`out_token` = N e), as it takes the row tiles."""

    first: tuple[float, float]
    later: tuple[float, float]  # (less |out| / L)
    tail: tuple[float, float]  # (less |out| / L)
    out_token: int


def split_bytes(hidden: int, ffn: int, splits: int, local_experts: int, tile_m: int,
                element_bytes: int = 2) -> SplitBytes:
    """B_0, B_s (s >= 1) and B_t at L = `splits`, as (fixed, per row tile) pairs, the
    last two less |out| / L (any M)."""
    e = element_bytes
    x_row, y_row = tile_m * ffn * e, tile_m * hidden * e  # |x|, |y| per row tile
    first = (local_experts * hidden * ffn * e / splits, x_row + y_row / splits)
    tail = (0.0, y_row / splits)
    return SplitBytes(first, (first[0], first[1] + tail[1]), tail, hidden * e)


def wave_bytes(compute_slots: int, tile_m: int, tile_n: int, ffn: int, k_epi: float,
               balance: float) -> float:
    """Phi: the HBM bytes of one compute wave's time (P tiles of 2 TM TN (K + K_epi))."""
    return compute_slots * 2 * tile_m * tile_n * (ffn + k_epi) / balance


def memory_t(w_comp: int, compute_slots: int, splits: int, traffic: SplitBytes,
             phi: float, row_tiles: int, tokens: int, phi_w: float | None = None) -> float:
    """T_mem(L): GEMM2 ends no earlier than its compute waves A_{L-1} and than the bytes of
    all its splits, then the last split's combine moves its bytes (module doc). The fixed
    bytes of a split are its weights, moved at Phi_W (`phi_w`; None: Phi)."""
    (f0, r0), (f1, r1), (ft, rt), out_token = traffic
    out = tokens * out_token / splits  # |out| / L (M N e / L)
    a_last = -(-splits * w_comp // compute_slots)  # A_{L-1}
    gemm = ((f0 + (splits - 1) * f1) / (phi_w or phi)
            + (r0 * row_tiles + (splits - 1) * (out + r1 * row_tiles)) / phi)
    return (a_last if a_last > gemm else gemm) + (ft + out + rt * row_tiles) / phi


def ranking_t(wave: Callable[[int, int], float], hidden: int, ffn: int, splits: int,
              local_experts: int, kernel: KernelSpec, device: DeviceSpec,
              calib: Calibration) -> Callable[[int, int], float]:
    """max(T_wave, T_mem), what the op ranks L by, as a function of (M, row tiles) at one
    launch shape and L: `wave` the wave model's T(C*) (`PlanCache.predictor`), T_mem in
    bf16 bytes with GEMM2 on all o_comp G slots; the bytes per row tile and Phi computed
    once, here."""
    slots = kernel.o_comp * device.available_sms
    per_row = -(-(-(-hidden // splits)) // kernel.tile_n)  # ceil(ceil(N/L) / TN)
    traffic = split_bytes(hidden, ffn, splits, local_experts, kernel.tile_m)
    phi = wave_bytes(slots, kernel.tile_m, kernel.tile_n, ffn, calib.hbm_k_epi,
                     calib.hbm_balance)
    phi_w = None if calib.hbm_stream_balance is None else wave_bytes(
        slots, kernel.tile_m, kernel.tile_n, ffn, calib.hbm_k_epi, calib.hbm_stream_balance)

    def t(tokens: int, row_tiles: int) -> float:
        t_wave = wave(tokens, row_tiles)  # (M and row_tiles checked)
        t_mem = memory_t(per_row * row_tiles, slots, splits, traffic, phi, row_tiles, tokens,
                         phi_w)
        return t_wave if t_wave > t_mem else t_mem
    return t
