"""The service-rate calibration (paper section III-C, eqs. 14-15; stdlib only): rho_ref
measured once per device and kernel family, the legal range of C, and the terms beyond
the paper (C_sat, K_epi, top-k, the overlap factor f), each off unless calibrated. What
each term means: `model.py`'s docstring; how rho scales with them: quantities.service_ratio.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .inputs import MAX_C, require_int, require_real


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
    # A compute wave's cost is t (K + k_epi) (model.py); None: t K, the paper's eq. 15.
    k_epi: float | None = None
    # The calibration case's top-k; set, rho scales with (k + 1) / (topk_ref + 1).
    topk_ref: int | None = None
    # f: waves of the splits served while GEMM2 runs take f rho (model.py); None: rho.
    overlap_factor: float | None = None
    # The splits' roofline (roofline.py). beta: GEMM2's FLOP per byte of HBM traffic at
    # the rates GEMM2 and GatherRS sustain side by side, a tile's FLOP counted at
    # K + hbm_k_epi (the fixed part of a tile's time, in K, of the GEMM2 kernel beta was
    # fitted with: the kernel of today, where k_epi above is the rho fit's). Set, the op
    # ranks L by the roofline as well and runs splits down to one column tile. None: no
    # such term (the candidates keep >= 512 columns per split).
    hbm_balance: float | None = None
    hbm_k_epi: float = 0.0
    # beta_W: the same FLOP per byte for the expert weights, which GEMM2 reads as whole
    # TMA tiles of contiguous rows, a pure read stream at the device-copy rate, where x's
    # and y's traffic (y's row scatter, the combine's gathers) moves at beta's. None:
    # the weights at beta too.
    hbm_stream_balance: float | None = None

    def __post_init__(self) -> None:
        require_real(self, "c_sat", 0, strict=True)
        require_real(self, "overlap_factor", 0, strict=True)
        require_real(self, "hbm_balance", 0, strict=True)
        require_real(self, "hbm_stream_balance", 0, strict=True)
        require_real(self, "hbm_k_epi", 0, optional=False)
        require_real(self, "k_epi", 0)
        require_real(self, "rho_ref", 0, strict=True, optional=False)
        for name in ("k_ref", "tm_ref", "tn_ref", "d_ref", "c_max"):
            require_int(self, name, 1)
        if self.c_max > MAX_C:
            raise ValueError(f"Calibration.c_max must be <= {MAX_C}, got {self.c_max}")
        for name in ("tmc_ref", "tnc_ref", "topk_ref"):
            if getattr(self, name) is not None:
                require_int(self, name, 1)

    @staticmethod
    def rho_from_measurement(
        comm_us: float, comm_splits: int, comp_us: float, comp_waves: int
    ) -> float:
        """rho_ref (eq. 14): time of one communication wave over one compute wave."""
        if min(comm_us, comp_us) <= 0 or min(comm_splits, comp_waves) < 1:
            raise ValueError("measurements must be positive")
        return (comm_us / comm_splits) / (comp_us / comp_waves)


@dataclass(frozen=True)
class Fp8Family:
    """The calibration of a GEMM2 on FP8 operands of one scaling kind ("tensor": a scale
    per expert; "block": 1x128 / 128x128 blocks), beside the bf16 family's. Only GEMM2's
    side changes with its operands: the communication reads the same bf16 output, so
    rho_ref is the bf16 family's communication wave over this family's compute wave, and
    `wave_us` is this family's t_ref for fuse-or-not (planner/fusion.py; None: the bf16
    family's)."""

    calibration: Calibration
    wave_us: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.calibration, Calibration):
            raise ValueError(f"Fp8Family.calibration must be a Calibration, got "
                             f"{type(self.calibration).__name__}")
        require_real(self, "wave_us", 0, strict=True)


def ranking_calibration(calib: Calibration) -> Calibration:
    """The calibration the op ranks L with: f was fitted and checked at a fixed L, and
    ranking L with it (and the tail-helper term) picked one split, no overlap, almost
    everywhere (measured on two H200s: every such plan slower). Pair it with KernelSpec(tail_helpers=False)."""
    return dataclasses.replace(calib, overlap_factor=None)
