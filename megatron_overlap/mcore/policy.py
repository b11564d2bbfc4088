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
        them (TEGroupedMLP under tensorwise, delayed or blockwise: mcore/te_fp8.py). Opt-in
        until the fused FP8 layer is measured against core-TE FP8 on a GPU (RESULTS).
        `--moe-overlap-fp8`.
    """

    fuse: str = "auto"
    host_counts: bool = False
    fp8: bool = False

    def __post_init__(self) -> None:
        if self.fuse not in FUSE_CHOICES:
            raise ValueError(f"LayerPolicy.fuse must be one of {FUSE_CHOICES}, got "
                             f"{self.fuse!r}")
        for name in ("host_counts", "fp8"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LayerPolicy.{name} must be a bool, got "
                                 f"{getattr(self, name)!r}")
