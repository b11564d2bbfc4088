"""`LayerPolicy`: what OverlapMoELayer decides around the op, per call. The op never
reads it (its own configuration is `ops.OverlapConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

FUSE_CHOICES = ("auto", "always")


@dataclass(frozen=True)
class LayerPolicy:
    """How an OverlapMoELayer chooses its path and where its expert counts live.

    fuse: "auto" (the default): before each call of a new size the layer asks the
        planner whether the fused op beats the stock path it replaces
        (`planner.fusion`, priced with the device calibration's `step_costs`; a device
        without them fuses), and runs the one predicted faster; "always": the fused op
        at every size (tests, the eager reference of a capture). `--moe-overlap-fuse`.
    host_counts: False (the default): where the rows are known without the expert
        counts (every expert on the rank, no token dropped: M x top-k) and FC1 runs on
        device offsets, the layer hands the op the counts on the device and the host
        never waits for them, so no MoE layer synchronizes the host and it can queue
        later layers while the GPU runs this one (the planner then reads the load as
        uniform; GEMM2's row tiles barely depend on the skew). True brings them to the
        host first: exact planning, one host sync per layer (after FC1 is queued).
        `--moe-overlap-host-counts`.
    fp8: False (the default): MoE layers under TE's FP8 recipes run stock; True fuses
        them under tensorwise and delayed scaling (TEGroupedMLP: mcore/te_fp8.py;
        measured at parity with core-TE FP8 on one H100, docs/RESULTS.md).
        `--moe-overlap-fp8`.
    fp8_blockwise: with fp8, fuse under blockwise scaling too. Off by default: the fused
        blockwise layer measured 0.64x-0.85x core-TE FP8's forward on one H100 (its
        block-scaled GEMM2 runs a wave in twice bf16's time); for checks and benchmarks.
        `--moe-overlap-fp8-blockwise`.
    """

    fuse: str = "auto"
    host_counts: bool = False
    fp8: bool = False
    fp8_blockwise: bool = False

    def __post_init__(self) -> None:
        if self.fuse not in FUSE_CHOICES:
            raise ValueError(f"LayerPolicy.fuse must be one of {FUSE_CHOICES}, got "
                             f"{self.fuse!r}")
        for name in ("host_counts", "fp8", "fp8_blockwise"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LayerPolicy.{name} must be a bool, got "
                                 f"{getattr(self, name)!r}")
        if self.fp8_blockwise and not self.fp8:
            raise ValueError("LayerPolicy.fp8_blockwise needs fp8=True (blockwise is one "
                             "of the FP8 recipes fp8 opts into)")
