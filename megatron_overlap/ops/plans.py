"""The op's plans and compiled kernel families, held by the session that launches them.

`KernelFamilies` compiles each kernel family once (no launch) and reads its residency
from the binaries; `Planner` answers `plan(PlanRequest) -> LaunchPlan` from the planner's
model over those families and remembers its answers. Both are plain objects an
`OverlapSession` owns: nothing here is process-wide, and a request's answer depends on
the request alone (the caches only remember it; `planning` holds the pure parts).
"""

from __future__ import annotations

import logging
import warnings
from typing import Callable

import torch

from ..kernels import gemm2
from ..planner import PlanCache, ranking_calibration, reservation, roofline
from .config import MAX_SPLITS, OverlapConfig, TileConfig, calibration_for, device_spec, kernel_spec
from .planning import (SPLIT_CANDIDATES, KernelFamily, LaunchPlan, PlanRequest,
                       partition_o_comm, rank_splits, split_candidates)
from .residency import compiled_occupancies

log = logging.getLogger("megatron_overlap")

#: decisions kept per planner (routing can make many distinct row-tile counts)
MAX_DECISIONS = 4096


class KernelFamilies:
    """The kernel families of one session, each compiled once to read its residency (the
    interpreter has no binary: any residency plans correctly there)."""

    def __init__(self):
        self._found: dict[tuple, KernelFamily] = {}

    def __len__(self) -> int:
        return len(self._found)

    def get(self, device: torch.device, backend: str, tiles: TileConfig, comm_tm: int,
            comm_tn: int, slots: int) -> KernelFamily:
        key = (device, backend, tiles, comm_tm, comm_tn, slots)
        found = self._found.get(key)
        if found is None:
            o_comp, o_comm, misfit, resources = _occupancies(*key)
            found = self._found[key] = KernelFamily(tiles, comm_tm, comm_tn, slots, o_comp,
                                                    o_comm, misfit, resources)
            if tiles.placement == "shared" and misfit is not None:
                warnings.warn(f"megatron-overlap: the shared placement does not fit one SM "
                              f"({misfit}: {resources}); planning and launching the "
                              f"partition placement instead", RuntimeWarning, stacklevel=3)
        return found


def _occupancies(device: torch.device, backend: str, tiles: TileConfig, comm_tm: int,
                 comm_tn: int, slots: int) -> tuple[int, int, str | None, dict]:
    """(o_comp, o_comm, misfit, resources) of the compiled kernels (`residency`), with
    flags of the launch's dtypes and alignment as the compiles' arguments."""
    if backend != "triton":
        return 2, 1, None, {}
    flags = tuple(torch.zeros(n, dtype=torch.int32, device=device) for n in (MAX_SPLITS, 1, 1))
    return compiled_occupancies(device, flags, tiles, comm_tm, comm_tn, slots)


class _Shape:
    """A launch shape less M (a PlanRequest but its row_tiles, num_tokens and L): at each
    L (family, cache, ranked, planned): the kernels' family, the cache that plans it, the
    ranking model's T (`PlanCache.predictor`, and the splits' roofline where calibrated)
    and the full model's Plan (`PlanCache.planner`), both functions of (tokens,
    row_tiles); and the L it ranks. M is no part of it: a batch of a new length finds it
    all built (M sets W_comm and |out|)."""

    __slots__ = ("kernels", "at", "candidates")

    def __init__(self, kernels: dict):
        self.kernels, self.at, self.candidates = kernels, {}, None


class Planner:
    """`plan(request)`: the launch's plan, remembered per request. The decision depends on
    the counts only through row_tiles (the host runs this after Megatron's sync, while the
    GPU waits). L unless given: the candidate with the least predicted T (compute waves,
    the same unit for every L; ties go to fewer splits) under the model without the
    tail-helper and overlap-factor terms; those two were fitted and checked on C sweeps
    at a fixed L, and ranking L with them picked one split, no overlap, for almost every
    workload, measured slower (docs/RESULTS.md). C is then the full model's at that L."""

    def __init__(self, families: KernelFamilies | None = None):
        self.families = families if families is not None else KernelFamilies()
        self._caches: dict[tuple, PlanCache] = {}
        #: per kernels (config, tiles, device, backend, N, k): at each L the family and
        #: the caches that rank and plan it
        self._kernels: dict[tuple, dict] = {}
        self._shapes: dict[tuple, _Shape] = {}
        self._decisions: dict[PlanRequest, LaunchPlan] = {}
        self._last_logged: tuple | None = None

    def plan(self, request: PlanRequest) -> LaunchPlan:
        found = self._decisions.get(request)
        if found is None:
            shape = self._shape(request)
            splits = request.splits or rank_splits(request.hidden,
                                                   self._ranked(request, shape),
                                                   self._candidates(request, shape))
            found = self._at_splits(request, splits, shape)
            if len(self._decisions) >= MAX_DECISIONS:
                self._decisions.clear()
            self._decisions[request] = found
        return found

    def split_predictions(self, request: PlanRequest,
                          candidates=SPLIT_CANDIDATES) -> dict[int, float]:
        """The ranking model's T(C*) at each L of `candidates` (up to N): what
        `rank_splits` compares, in compute waves, for tools that set it beside measured
        times."""
        ranked = self._ranked(request, self._shape(request))
        return {cand: ranked(cand) for cand in candidates if cand <= request.hidden}

    def caches_at(self, request: PlanRequest, splits: int) -> tuple:
        """(family, ranking cache, cache) at L = `splits`."""
        return self._caches_at(request, splits, self._shape(request).kernels)

    def cached_counts(self) -> dict[str, int]:
        """How many kernel families, plan caches and launch decisions are remembered (a
        long run's memory: `tools/soak.py`)."""
        return dict(families=len(self.families), plan_caches=len(self._caches),
                    decisions=len(self._decisions), kernels=len(self._kernels),
                    shapes=len(self._shapes))

    def log_decision(self, launch_plan: LaunchPlan, m: int, n: int, k: int,
                     world: int) -> None:
        """A DEBUG line whenever the (C, L, sizes) of this planner's decisions change."""
        plan = launch_plan.plan
        sig = (plan.comm_ctas, plan.splits, m, n, k, world)
        if self._last_logged != sig:
            self._last_logged = sig
            log.debug("gemm2_gather_rs: C=%d P=%d L=%d T=%.1f (M=%d N=%d K=%d D=%d, %s)",
                      plan.comm_ctas, plan.compute_slots, plan.splits, plan.predicted, m, n,
                      k, world, plan.source)

    # ------------------------------------------------------------------ the caches
    def _plan_cache(self, family: KernelFamily, config: OverlapConfig, device: torch.device,
                    ranking: bool = False) -> PlanCache:
        """The planner's decision cache for one kernel family on one device. `ranking`:
        the model the op ranks L with (no tail-helper, no overlap-factor term)."""
        helpers = config.tail_helpers and not ranking
        key = (family, device, config.sm_margin, config.preset, helpers, ranking)
        cache = self._caches.get(key)
        if cache is None:
            spec_device = device_spec(device, config.sm_margin)
            # the model serves the last split as the launch does: with the tail helpers
            # when they run (KernelSpec.tail_helpers)
            spec = kernel_spec(family.tiles, family.comm_tm, family.comm_tn, family.o_comp,
                               partition_o_comm(family), helpers, family.shared)
            calib = calibration_for(spec_device, config.preset)
            cache = self._caches[key] = PlanCache(
                spec, spec_device, ranking_calibration(calib) if ranking else calib)
        return cache

    def _shape(self, r: PlanRequest) -> _Shape:
        """The request's launch shape, its L filled as they are asked for."""
        key = (r.config, r.tiles, r.device, r.backend, r.experts, r.hidden, r.ffn, r.world,
               r.topk, r.local_topk, r.comm_ctas)
        found = self._shapes.get(key)
        if found is None:
            if len(self._shapes) >= MAX_DECISIONS:
                self._shapes.clear()
            kernels_key = (r.config, r.tiles, r.device, r.backend, r.hidden, r.topk)
            kernels = self._kernels.get(kernels_key)
            if kernels is None:
                if len(self._kernels) >= MAX_DECISIONS:
                    self._kernels.clear()
                kernels = self._kernels[kernels_key] = {}
            found = self._shapes[key] = _Shape(kernels)
        return found

    def _caches_at(self, r: PlanRequest, splits: int, kernels: dict) -> tuple:
        found = kernels.get(splits)
        if found is None:
            comm_tm, comm_tn = r.tiles.comm_shape(r.topk, -(-r.hidden // splits))
            family = self.families.get(r.device, r.backend, r.tiles, comm_tm, comm_tn,
                                       gemm2.next_pow2(r.topk))
            found = kernels[splits] = (family,
                                       self._plan_cache(family, r.config, r.device, True),
                                       self._plan_cache(family, r.config, r.device))
        return found

    def _at(self, r: PlanRequest, splits: int, shape: _Shape) -> tuple:
        """(family, cache, ranked, planned) at L = `splits`. A term the ranking adds is a
        function of (M, row_tiles) per shape and L, as the splits' roofline
        (`planner.roofline.ranking_t`)."""
        found = shape.at.get(splits)
        if found is None:
            family, ranking, cache = self._caches_at(r, splits, shape.kernels)
            ranked = ranking.predictor(r.hidden, r.ffn, r.world, splits, r.experts,
                                       comm_ctas=r.comm_ctas, enabled=r.config.planner,
                                       topk=r.topk, local_topk=r.local_topk)
            if ranking.calib.hbm_balance is not None:  # max(T_wave, T_mem)
                ranked = roofline.ranking_t(ranked, r.hidden, r.ffn, splits, r.experts,
                                            ranking.kernel, ranking.device, ranking.calib)
            planned = cache.planner(r.hidden, r.ffn, r.world, splits, r.experts,
                                    comm_ctas=r.comm_ctas, enabled=r.config.planner,
                                    topk=r.topk, local_topk=r.local_topk)
            found = shape.at[splits] = (family, cache, ranked, planned)
        return found

    def _at_splits(self, r: PlanRequest, splits: int, shape: _Shape) -> LaunchPlan:
        """The launch's plan at L = `splits`."""
        family, cache, _, planned = shape.at.get(splits) or self._at(r, splits, shape)
        plan = planned(r.num_tokens, r.row_tiles)
        # one tail helper per SM that GEMM2 leaves when it ends (the comm CTAs keep theirs)
        helpers = (cache.device.available_sms - reservation(plan.comm_ctas, cache.kernel)
                   if r.config.tail_helpers else 0)
        return LaunchPlan(plan, family, splits, r.num_tokens // r.world, max(0, helpers),
                          r.config.max_spins, r.config.wait_timeout_s, cache, r)

    def _candidates(self, r: PlanRequest, shape: _Shape) -> tuple[int, ...]:
        """The L `plan` ranks: down to one column tile where the ranking prices the
        splits' HBM traffic (`split_candidates`)."""
        if shape.candidates is None:
            ranking = self._caches_at(r, 1, shape.kernels)[1]
            roof = ranking.calib.hbm_balance is not None
            shape.candidates = split_candidates(r.hidden,
                                                ranking.kernel.tile_n if roof else None)
        return shape.candidates

    def _ranked(self, r: PlanRequest, shape: _Shape) -> Callable[[int], float]:
        """L -> T at L under the model that ranks L, for this request (no plan kept)."""
        at, tokens, row_tiles = shape.at, r.num_tokens, r.row_tiles

        def t(splits: int) -> float:
            return (at.get(splits) or self._at(r, splits, shape))[2](tokens, row_tiles)
        return t
