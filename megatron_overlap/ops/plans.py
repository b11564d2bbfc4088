"""The op's plans over compiled kernel families, held by the session that launches them.

Compiling and planning are two steps. `KernelFamilies` (the session's) compiles kernel
families when asked (no launch) and reads their residency from the binaries: at
`OverlapSession.warm_up`, or at a call whose families warm_up did not cover (a logged
step of the session, `OverlapSession.plan`). `Planner` answers `plan(PlanRequest) ->
LaunchPlan` from the planner's model over the families it looks up and never compiles:
a family it does not find raises `MissingKernelFamily`. Both are plain objects an
`OverlapSession` owns: nothing here is process-wide, and a request's answer depends on
the request and the families alone (the caches only remember it; `planning` holds the
pure parts).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Callable, Protocol

import torch

from ..planner import DeviceSpec, PlanCache, ranking_calibration, reservation, roofline
from .config import (MAX_SPLITS, OverlapConfig, TileConfig, calibration_for, device_spec,
                     kernel_spec)
from .planning import (SPLIT_CANDIDATES, FamilyKey, KernelFamily, LaunchPlan, PlanRequest,
                       family_key, partition_o_comm, rank_splits, split_candidates)
from .residency import compiled_occupancies

log = logging.getLogger("megatron_overlap")

#: decisions kept per planner (routing can make many distinct row-tile counts)
MAX_DECISIONS = 4096


class MissingKernelFamily(LookupError):
    """A plan needs a kernel family its planner's lookup does not hold (not compiled)."""

    def __init__(self, key: FamilyKey):
        super().__init__(f"kernel family not compiled: {key} (OverlapSession.warm_up)")
        self.key = key


class FamilyLookup(Protocol):
    """What a Planner reads its kernel families from: read-only."""

    def get(self, key: FamilyKey) -> KernelFamily | None: ...

    def __len__(self) -> int: ...


class UncompiledFamilies:
    """The families that have no binary, as a lookup: the interpreter's (any residency
    plans correctly there), made from the key alone; none of the triton backend's. A
    Planner given no families plans with these (tools that plan without a device)."""

    def get(self, key: FamilyKey) -> KernelFamily | None:
        return None if key.backend == "triton" else _family(key, *_occupancies(key))

    def __len__(self) -> int:
        return 0


class KernelFamilies(Mapping):
    """The kernel families of one session, key -> family, each compiled once (`warm`) to
    read its residency; `at_call`: the keys a call had to compile (warm_up had not)."""

    def __init__(self):
        self._found: dict[FamilyKey, KernelFamily] = {}
        self.at_call: list[FamilyKey] = []

    def __getitem__(self, key: FamilyKey) -> KernelFamily:
        return self._found[key]

    def __iter__(self) -> Iterator[FamilyKey]:
        return iter(self._found)

    def __len__(self) -> int:
        return len(self._found)

    def warm(self, keys: Iterable[FamilyKey], at_call: bool = False) -> tuple[KernelFamily, ...]:
        """The families of `keys`, each compiled where it is not yet (`at_call`: by a call
        that warm_up did not prepare, logged)."""
        return tuple(self._found.get(key) or self._compile(key, at_call) for key in keys)

    def _compile(self, key: FamilyKey, at_call: bool) -> KernelFamily:
        if at_call:  # (visible: a call pays a compile where a warm-up should have)
            log.log(logging.INFO if key.backend == "triton" else logging.DEBUG,
                    "megatron-overlap: compiling kernel family %s at a call (warm_up was "
                    "not called for this shape)", key)
            self.at_call.append(key)
        found = self._found[key] = _family(key, *_occupancies(key))
        if key.tiles.placement == "shared" and found.misfit is not None:
            warnings.warn(f"megatron-overlap: the shared placement does not fit one SM "
                          f"({found.misfit}: {found.resources}); planning and launching "
                          f"the partition placement instead", RuntimeWarning, stacklevel=5)
        return found


def _family(key: FamilyKey, o_comp: int, o_comm: int, misfit: str | None,
            resources: dict) -> KernelFamily:
    return KernelFamily(key.tiles, key.comm_tm, key.comm_tn, key.slots, o_comp, o_comm,
                        misfit, resources)


def _occupancies(key: FamilyKey) -> tuple[int, int, str | None, dict]:
    """(o_comp, o_comm, misfit, resources) of the compiled kernels (`residency`), with
    flags of the launch's dtypes and alignment as the compiles' arguments; the
    interpreter's fixed values (no binary)."""
    if key.backend != "triton":
        return 2, 1, None, {}
    flags = tuple(torch.zeros(n, dtype=torch.int32, device=key.device)
                  for n in (MAX_SPLITS, 1, 1))
    return compiled_occupancies(key.device, flags, key.tiles, key.comm_tm, key.comm_tn,
                                key.slots, key.fp8)


def planned_splits(config: OverlapConfig, tiles: TileConfig, device: torch.device, hidden: int,
                   splits: int | None = None, fp8: str | None = None) -> tuple[int, ...]:
    """The L a plan may run at: `splits` where given, else the candidates `Planner.plan`
    ranks (`split_candidates`: down to one column tile where the calibration of the
    operands' family, `fp8` their FP8 scaling kind, prices the splits' HBM traffic)."""
    if splits:
        return (splits,)
    calib = calibration_for(device_spec(device, config.sm_margin), config.preset, fp8)
    return split_candidates(hidden, tiles.block_n if calib.hbm_balance is not None else None)


def family_keys(config: OverlapConfig, tiles: TileConfig, device: torch.device, backend: str,
                hidden: int, topk: int, splits: int | Iterable[int] | None = None,
                fp8: str | None = None) -> tuple[FamilyKey, ...]:
    """The families plans of this shape (on FP8 operands of kind `fp8`) look up: at each
    L of `splits` (up to N), else at each L `planned_splits` gives (the config's, or the
    candidates the planner ranks)."""
    each = (splits,) if isinstance(splits, int) else splits
    each = each or planned_splits(config, tiles, device, hidden, config.splits, fp8)
    return tuple(dict.fromkeys(family_key(tiles, device, backend, hidden, topk, s, fp8)
                               for s in each if 1 <= s <= hidden))


def request_families(r: PlanRequest, splits: Iterable[int] | None = None
                     ) -> tuple[FamilyKey, ...]:
    """The families `Planner.plan(r)` looks up (at `splits` where given: those L)."""
    return family_keys(r.config, r.tiles, r.device, r.backend, r.hidden, r.topk,
                       splits or r.splits, r.fp8)


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
    workload, measured slower (docs/RESULTS.md). C is then the full model's at that L.

    Planning compiles nothing: the kernel families come from `families`, a read-only
    lookup (the session's `KernelFamilies`), and one not found there raises
    `MissingKernelFamily` (the session compiles it and asks again)."""

    def __init__(self, families: FamilyLookup | None = None,
                 for_device: DeviceSpec | None = None):
        #: read only: a family not found raises MissingKernelFamily (None: the families
        #: without a binary, `UncompiledFamilies`)
        self.families = families if families is not None else UncompiledFamilies()
        if for_device is not None and not isinstance(for_device, DeviceSpec):
            raise TypeError(f"for_device must be a planner DeviceSpec or None, got "
                            f"{type(for_device).__name__}")
        #: the GPU the plans are for; None: the request's device (`device_spec`). Tools
        #: replay a GPU's plans on a host without it (its preset's DeviceSpec).
        self.for_device = for_device
        self._caches: dict[tuple, PlanCache] = {}
        #: per kernels (config, tiles, device, backend, N, k, fp8): at each L the family and
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
    def _plan_cache(self, family: KernelFamily, r: PlanRequest,
                    ranking: bool = False) -> PlanCache:
        """The planner's decision cache for one kernel family (on the request's operands)
        on its device. `ranking`: the model the op ranks L with (no tail-helper, no
        overlap-factor term)."""
        config, device = r.config, r.device
        helpers = config.tail_helpers and not ranking
        key = (family, device, config.sm_margin, config.preset, r.fp8, helpers, ranking)
        cache = self._caches.get(key)
        if cache is None:
            spec_device = (device_spec(device, config.sm_margin) if self.for_device is None
                           else dataclasses.replace(self.for_device,
                                                    sm_margin=config.sm_margin))
            # the model serves the last split as the launch does: with the tail helpers
            # when they run (KernelSpec.tail_helpers)
            spec = kernel_spec(family.tiles, family.comm_tm, family.comm_tn, family.o_comp,
                               partition_o_comm(family), helpers, family.shared)
            calib = calibration_for(spec_device, config.preset, r.fp8)
            cache = self._caches[key] = PlanCache(
                spec, spec_device, ranking_calibration(calib) if ranking else calib)
        return cache

    def _shape(self, r: PlanRequest) -> _Shape:
        """The request's launch shape, its L filled as they are asked for."""
        key = (r.config, r.tiles, r.device, r.backend, r.experts, r.hidden, r.ffn, r.world,
               r.topk, r.local_topk, r.comm_ctas, r.fp8)
        found = self._shapes.get(key)
        if found is None:
            if len(self._shapes) >= MAX_DECISIONS:
                self._shapes.clear()
            kernels_key = (r.config, r.tiles, r.device, r.backend, r.hidden, r.topk, r.fp8)
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
            key = family_key(r.tiles, r.device, r.backend, r.hidden, r.topk, splits, r.fp8)
            family = self.families.get(key)
            if family is None:
                raise MissingKernelFamily(key)
            found = kernels[splits] = (family,
                                       self._plan_cache(family, r, True),
                                       self._plan_cache(family, r))
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
            shape.candidates = planned_splits(r.config, r.tiles, r.device, r.hidden,
                                              fp8=r.fp8)
        return shape.candidates

    def _ranked(self, r: PlanRequest, shape: _Shape) -> Callable[[int], float]:
        """L -> T at L under the model that ranks L, for this request (no plan kept)."""
        at, tokens, row_tiles = shape.at, r.num_tokens, r.row_tiles

        def t(splits: int) -> float:
            return (at.get(splits) or self._at(r, splits, shape))[2](tokens, row_tiles)
        return t
