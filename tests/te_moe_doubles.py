"""Test-only doubles of Transformer Engine's MoE kernels as Megatron-Core's moe_utils calls
them (fused permute / unpermute, fused top-k), run by Megatron's own unfused code (same
bits), so that `moe_permute_fusion` / `moe_router_fusion` run on CPU. Each call is
counted in `CALLS` by name. `install()` also installs mcore_shims (a `--preload` target:
`--preload tests/te_moe_doubles.py`)."""

from __future__ import annotations

import os
import sys

CALLS = {"permute": 0, "unpermute": 0, "topk": 0}


def install() -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    import mcore_shims

    mcore_shims.install()
    from megatron.core.transformer.moe import moe_utils

    if getattr(moe_utils, "_te_doubles", False):
        return
    permute, unpermute = moe_utils.permute, moe_utils.unpermute
    unfused_topk = moe_utils.topk_routing_with_score_function

    def fused_permute(tokens, routing_map, num_out_tokens=None):
        CALLS["permute"] += 1
        out, _, sorted_indices, _, _ = permute(tokens, routing_map, num_out_tokens=num_out_tokens)
        return out, sorted_indices  # (as the row map TE returns, what unpermute reads)

    def fused_unpermute(tokens, row_map, merging_probs=None, restore_shape=None, **_):
        CALLS["unpermute"] += 1
        return unpermute(tokens, row_map, restore_shape, probs=merging_probs)

    def fused_topk(logits, topk, use_pre_softmax, expert_bias, **kwargs):
        CALLS["topk"] += 1
        return unfused_topk(logits, topk, use_pre_softmax=use_pre_softmax,
                            expert_bias=expert_bias, **kwargs, fused=False)

    moe_utils.HAVE_TE, moe_utils._te_doubles = True, True
    moe_utils.is_te_min_version = lambda *args, **kwargs: False
    moe_utils.fused_permute, moe_utils.fused_unpermute = fused_permute, fused_unpermute
    moe_utils.fused_topk_with_score_function = fused_topk
