"""The op's planning around the planner: which L to run, the plan and launch arguments of
an L, and the plan cache a prepared launch used (`op.prepare` calls these; tools read
the cache). The model itself is `planner/`; this module only chooses among its calls.

In the shared placement (Hopper's default) the plan's C is G for every L, so what is
decided here per call is L (`rank_splits`) and with it the communication tile
(`TileConfig.comm_shape`); in the partition placement the model also chooses C."""

from __future__ import annotations

import dataclasses
import functools
import logging

from ..planner import reservation
from .config import default_splits

log = logging.getLogger("megatron_overlap")


@functools.lru_cache(maxsize=16)  # on the launch path of every EP call: built once
def row_order(tiles):
    """The same tiles with y in GEMM2's row order."""
    return dataclasses.replace(tiles, token_major=False)


SPLIT_CANDIDATES = (1, 2, 4)


def rank_splits(hidden: int, predicted) -> int:
    """The L the op runs when none is given: of SPLIT_CANDIDATES up to 2 x the default
    (and N), the least `predicted(L)` (compute waves, one unit for every L); ties go to
    fewer splits. `predicted` is the ranking model's T(C*) at that L (see `prepare`)."""
    chosen, best = None, None
    for cand in SPLIT_CANDIDATES:
        if cand > min(2 * default_splits(hidden), hidden):
            continue
        t = predicted(cand)
        if best is None or t < best * (1 - 1e-9):
            chosen, best = cand, t
    return chosen


def plan_splits(buf, config, tiles, row_tiles, experts, sizes, topk, local_topk, splits, c,
                 ranking=False):
    """The cached plan for L = `splits` and the launch arguments that go with it
    (`ranking`: under the model that ranks L, see `prepare`)."""
    num_tokens, hidden, ffn, world = sizes
    comm_tm, comm_tn = tiles.comm_shape(topk, -(-hidden // splits))
    cache = buf.plan_cache(config, tiles, comm_tm, comm_tn, topk, ranking)
    plan = cache.decide_tiles(row_tiles, num_tokens, hidden, ffn, world, splits, experts,
                              comm_ctas=c, enabled=config.planner, topk=topk,
                              local_topk=local_topk)
    # one tail helper per SM that GEMM2 leaves when it ends (the comm CTAs keep theirs)
    helpers = (cache.device.available_sms - reservation(plan.comm_ctas, cache.kernel)
               if config.tail_helpers else 0)
    return plan, dict(splits=splits, tiles=tiles, comm_tm=comm_tm, comm_tn=comm_tn,
                      tokens_per_rank=num_tokens // world, max_spins=config.max_spins,
                      wait_timeout_s=config.wait_timeout_s,
                      helpers=max(0, helpers))


def planned(buf, config, tiles, row_tiles, experts, sizes, topk, local_topk, splits, c):
    """(plan, launch arguments) of one launch, remembered per buffer: the decision depends
    on the counts only through row_tiles (the host runs this after Megatron's sync, while
    the GPU waits). L unless given: the candidate with the least predicted T (compute
    waves, the same unit for every L; ties go to fewer splits) under the model without the
    tail-helper and overlap-factor terms. Those two were fitted and checked on C sweeps at
    a fixed L; ranking L with them picked one split, no overlap, for almost every
    workload, measured slower (docs/RESULTS.md). C is then the full model's at that L."""
    key = (config, tiles, row_tiles, sizes, topk, local_topk, splits, c, experts)
    best = buf.decisions.get(key)
    if best is None:
        chosen = splits or rank_splits(sizes[1], lambda cand: plan_splits(
            buf, config, tiles, row_tiles, experts, sizes, topk, local_topk, cand, c,
            ranking=True)[0].predicted)
        best = plan_splits(buf, config, tiles, row_tiles, experts, sizes, topk, local_topk,
                           chosen, c)
        buf.remember(key, best)
    return best


def plan_cache_of(launch):
    """The PlanCache a prepared launch was planned with (tools read its kernel/device)."""
    kw = launch.kwargs
    return launch.buffer.plan_cache(launch.config, kw["tiles"], kw["comm_tm"], kw["comm_tn"],
                                    launch.table.shape[1])


def log_decision(launch, m: int, n: int, k: int) -> None:
    plan, buf = launch.plan, launch.buffer
    sig = (plan.comm_ctas, plan.splits, m, n, k, launch.world)
    if getattr(buf, "_last_logged", None) != sig:
        buf._last_logged = sig
        log.debug("gemm2_gather_rs: C=%d P=%d L=%d T=%.1f (M=%d N=%d K=%d D=%d, %s)",
                  plan.comm_ctas, plan.compute_slots, plan.splits, plan.predicted, m, n, k,
                  launch.world, plan.source)

