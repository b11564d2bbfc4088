"""The INFO line OverlapMoELayer logs on its first fused launch and whenever its (C, L)
changes: the plan and the sizes it was made for."""

from __future__ import annotations

import torch

from .dispatch import Permuted
from .experts import host_counts


def launch_line(layer_number, plan, permuted: Permuted, weight) -> str:
    """`plan` (None: the reference backend) for the op call on `permuted`'s rows with FC2
    weights `weight` [E, N, K]; the load from host counts (device counts are not read:
    reading them would sync the host)."""
    e, n, k = weight.shape
    d = permuted.group.size() if permuted.group is not None else 1
    if isinstance(permuted.counts, torch.Tensor) and permuted.counts.is_cuda:
        load = "counts on the device"
    else:
        counts = host_counts(permuted.counts)
        load = f"rows={sum(counts)} max_e={max(counts, default=0)}"
    sig = f"M={permuted.num_tokens} N={n} K={k} D={d} E={e} {load}"
    if plan is None:
        return f"moe-overlap layer {layer_number}: reference backend (not overlapped), {sig}"
    # R = 0: the shared placement (communication CTAs beside GEMM2's)
    return (f"moe-overlap layer {layer_number}: C={plan.comm_ctas} R={plan.reservation} "
            f"L={plan.splits} P={plan.compute_slots} predicted T={plan.predicted:.1f} "
            f"({plan.source}), {sig}")
