"""The op's second stage: a pure, cached plan of one launch from the planner's model.

`plan_launch(PlanRequest)` -> `LaunchPlan`: which L to run, the plan (C, P, R) at that L
and the launch's tiles, from a `KernelFamily` (the kernels' tiles and communication tile
with their compiled residency, read once per family from the binaries). Nothing here
touches a buffer or the routing: the request holds every input, the answer depends on
nothing else, so it is cached on the request itself.

In the shared placement (Hopper's default) the plan's C is G for every L, so what is
decided here per call is L (`rank_splits`) and with it the communication tile
(`TileConfig.comm_shape`); in the partition placement the model also chooses C."""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..kernels import gemm2
from ..planner import PlanCache, reservation, ranking_calibration, roofline
from .config import (GPU_TILES, INTERPRET_TILES, MAX_SPLITS, OverlapConfig, TileConfig, calibration_for,
                     default_splits, device_spec, in_placement, kernel_spec,
                     with_register_caps)
from .residency import compiled_occupancies

log = logging.getLogger("megatron_overlap")

SPLIT_CANDIDATES = (1, 2, 4)
#: the L ranked where the calibration prices the splits' HBM traffic (`hbm_balance`)
ROOFLINE_CANDIDATES = (1, 2, 4, 8)
#: decisions kept (routing can make many distinct row-tile counts)
MAX_DECISIONS = 4096


def default_tiles(backend: str, placement: str | None = None) -> TileConfig:
    """The backend's tiles (GPU_TILES on CUDA), in `placement` when given: on CUDA the
    tuned tiles of that placement (GPU_TILES / PARTITION_TILES)."""
    return in_placement(INTERPRET_TILES if backend == "interpret" else GPU_TILES, placement)


@functools.lru_cache(maxsize=16)  # on the launch path of every EP call: built once
def row_order(tiles: TileConfig) -> TileConfig:
    """The same tiles with y in GEMM2's row order."""
    return dataclasses.replace(tiles, token_major=False)


@functools.lru_cache(maxsize=64)
def resolved(tiles: TileConfig, device: torch.device, dtype: torch.dtype) -> TileConfig:
    """tiles with gemm_impl "auto" replaced by the kernel `gemm2.resolve_impl` picks for
    this device, dtype and y layout (and, in the shared placement, that kernel's register
    caps), so the planner's residency and the launch come from the same binary."""
    if tiles.gemm_impl == "auto":
        tiles = dataclasses.replace(tiles, gemm_impl=gemm2.resolve_impl(
            "auto", device, dtype, tiles.block_m, tiles.block_n, tiles.gemm_warps,
            tiles.token_major))
    # the shared placement's register caps, for the kernel just chosen (compiled only)
    return with_register_caps(tiles) if device.type == "cuda" else tiles


def launch_tiles(config: OverlapConfig, backend: str, device: torch.device,
                 dtype: torch.dtype, token_major: bool) -> TileConfig:
    """The tiles a launch runs: the config's or the backend's default, resolved; y
    token-major only where the caller allows it (every token has its k rows on this rank
    and y's row numbers fit int32), else in GEMM2's row order."""
    tiles = config.tiles or default_tiles(backend, config.placement)
    if tiles.gemm_impl not in ("triton", "auto") and (backend != "triton"
                                                      or dtype != torch.bfloat16):
        raise ValueError(f"TileConfig.gemm_impl={tiles.gemm_impl!r} is a Gluon kernel for "
                         f"bf16 on CUDA; got the {backend} backend and {dtype} "
                         f"(gemm_impl='triton' or 'auto' runs everywhere)")
    if tiles.token_major and not token_major:
        tiles = row_order(tiles)
    return resolved(tiles, device, dtype)


@dataclass(frozen=True)
class KernelFamily:
    """The two kernels of a launch as the planner sees them: GEMM2's tiles, GatherRS's
    communication tile and table slots, and how many CTAs of each fit one SM as compiled
    (o_comp, o_comm; `misfit`: the resource that keeps the shared placement from fitting
    one SM, None where it fits)."""

    tiles: TileConfig
    comm_tm: int
    comm_tn: int
    slots: int
    o_comp: int
    o_comm: int
    misfit: str | None
    #: registers / shared memory / spills / warps of the binaries (empty: interpreter)
    resources: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def shared(self) -> bool:
        """GatherRS's CTAs run beside GEMM2's on every SM (R = 0)."""
        return self.tiles.placement == "shared" and self.misfit is None


_families: dict[tuple, KernelFamily] = {}


def _occupancies(device: torch.device, backend: str, tiles: TileConfig, comm_tm: int,
                 comm_tn: int, slots: int) -> tuple[int, int, str | None, dict]:
    """(o_comp, o_comm, misfit, resources) of the compiled kernels (`residency`), with
    flags of the launch's dtypes and alignment as the compiles' arguments."""
    if backend != "triton":
        return 2, 1, None, {}
    flags = tuple(torch.zeros(n, dtype=torch.int32, device=device) for n in (MAX_SPLITS, 1, 1))
    return compiled_occupancies(device, flags, tiles, comm_tm, comm_tn, slots)


def kernel_family(device: torch.device, backend: str, tiles: TileConfig, comm_tm: int,
                  comm_tn: int, slots: int) -> KernelFamily:
    """The family of these kernels on `device`, compiled once (no launch) to read their
    residency; the interpreter has no binary (any residency plans correctly there)."""
    key = (device, backend, tiles, comm_tm, comm_tn, slots)
    found = _families.get(key)
    if found is None:
        o_comp, o_comm, misfit, resources = _occupancies(device, backend, *key[2:])
        found = _families[key] = KernelFamily(tiles, comm_tm, comm_tn, slots, o_comp, o_comm,
                                              misfit, resources)
        if tiles.placement == "shared" and misfit is not None:
            warnings.warn(f"megatron-overlap: the shared placement does not fit one SM "
                          f"({misfit}: {resources}); planning and launching the partition "
                          f"placement instead", RuntimeWarning, stacklevel=3)
    return found


def partition_o_comm(family: KernelFamily) -> int:
    """o_comm as the partition's reservation R(C) = ceil(C / o_comm) must count it: 1.
    The block scheduler spreads a grid's CTAs over the SMs; nothing packs o_comm
    GatherRS CTAs onto one SM. Planned packed, C small CTAs that cannot share an SM with
    GEMM2 (a shared placement that does not fit, launched as the partition) take up to C
    SMs where R(C) counted C / o_comm: at C = G no GEMM2 CTA could start and GatherRS
    waited for it until its time-out (one H200, 4-warp GatherRS CTAs, o_comm = 5).
    Counted one SM each, P(C) = o_comp (G - C) GEMM2 CTAs always find SMs. (Shared
    placement: R = 0 whatever o_comm is.)"""
    return family.o_comm if family.shared else 1


_caches: dict[tuple, PlanCache] = {}


def plan_cache(family: KernelFamily, config: OverlapConfig, device: torch.device,
               ranking: bool = False) -> PlanCache:
    """The planner's decision cache for one kernel family on one device. `ranking`: the
    model the op ranks L with (no tail-helper, no overlap-factor term, `plan_launch`)."""
    helpers = config.tail_helpers and not ranking
    key = (family, device, config.sm_margin, config.preset, helpers, ranking)
    cache = _caches.get(key)
    if cache is None:
        spec_device = device_spec(device, config.sm_margin)
        # the model serves the last split as the launch does: with the tail helpers when
        # they run (KernelSpec.tail_helpers)
        spec = kernel_spec(family.tiles, family.comm_tm, family.comm_tn, family.o_comp,
                           partition_o_comm(family), helpers, family.shared)
        calib = calibration_for(spec_device, config.preset)
        cache = _caches[key] = PlanCache(spec, spec_device,
                                         ranking_calibration(calib) if ranking else calib)
    return cache


@dataclass(frozen=True)
class PlanRequest:
    """Everything a launch's plan depends on: the sizes (M tokens, N hidden, K ffn, D
    ranks), the routing through W_comp's only input, row_tiles = sum_e ceil(M_e / TM),
    top-k and the rows per token this rank gathers (local_topk, in quarters so decisions
    stay cacheable), and the caller's explicit L and C (None: the planner's)."""

    config: OverlapConfig
    tiles: TileConfig
    device: torch.device
    backend: str
    row_tiles: int
    experts: int
    num_tokens: int
    hidden: int
    ffn: int
    world: int
    topk: int
    local_topk: float
    splits: int | None
    comm_ctas: int | None


@dataclass(frozen=True)
class LaunchPlan:
    """The decision for one launch: the planner's plan (C, P, R, predicted T) at L splits,
    the kernels' family, and the launch's bounds. Tools relaunch a plan with another C or
    P as `dataclasses.replace(launch_plan, plan=...)`."""

    plan: object  # planner.Plan
    family: KernelFamily
    splits: int
    tokens_per_rank: int
    helpers: int  # tail-helper CTAs launched behind GEMM2
    max_spins: int
    wait_timeout_s: float
    cache: PlanCache = field(compare=False, hash=False)  # (tools read its kernel/device)
    #: what it was planned from (tools ask the model about other L: `split_predictions`)
    request: "PlanRequest | None" = field(default=None, compare=False, hash=False)

    @property
    def tiles(self) -> TileConfig:
        return self.family.tiles


#: per kernels (config, tiles, device, backend, N, k): at each L the kernels' family and
#: the caches that rank and plan it
_kernels: dict[tuple, dict[int, tuple[KernelFamily, PlanCache, PlanCache]]] = {}


class _Shape:
    """A launch shape less M (a PlanRequest but its row_tiles, num_tokens and L): its
    kernels' entry of `_kernels`; at each L (family, cache, ranked, planned): the kernels'
    family, the cache that plans it, the ranking model's T (`PlanCache.predictor`, and the
    splits' roofline where calibrated) and the full model's Plan (`PlanCache.planner`),
    both functions of (tokens, row_tiles); and the L it ranks (`_candidates`). M is no
    part of it: a batch of a new length finds it all built (M sets W_comm and |out|)."""

    __slots__ = ("kernels", "at", "candidates")

    def __init__(self, kernels: dict):
        self.kernels, self.at, self.candidates = kernels, {}, None


_shapes: dict[tuple, _Shape] = {}


def _shape(request: PlanRequest) -> _Shape:
    """The request's launch shape, its L filled as they are asked for: a launch that
    misses looks it up once for all its L."""
    r = request
    key = (r.config, r.tiles, r.device, r.backend, r.experts, r.hidden, r.ffn, r.world,
           r.topk, r.local_topk, r.comm_ctas)
    found = _shapes.get(key)
    if found is None:
        if len(_shapes) >= MAX_DECISIONS:
            _shapes.clear()
        kernels_key = (r.config, r.tiles, r.device, r.backend, r.hidden, r.topk)
        kernels = _kernels.get(kernels_key)
        if kernels is None:
            if len(_kernels) >= MAX_DECISIONS:
                _kernels.clear()
            kernels = _kernels[kernels_key] = {}
        found = _shapes[key] = _Shape(kernels)
    return found


def _at(request: PlanRequest, splits: int, shape: _Shape) -> tuple:
    """(family, cache, ranked, planned) at L = `splits`; `shape`: the request's `_shape`.
    A term the ranking adds is a function of (M, row_tiles) per shape and L, as the
    splits' roofline (`planner.roofline.ranking_t`)."""
    r = request
    found = shape.at.get(splits)
    if found is None:
        family, ranking, cache = _caches_at(r, splits, shape.kernels)
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


def _caches_at(request: PlanRequest, splits: int,
               kernels: dict | None = None) -> tuple[KernelFamily, PlanCache, PlanCache]:
    """(family, ranking cache, cache) at L = `splits`; `kernels`: the request's entry of
    `_kernels`, where held."""
    r = request
    kernels = _shape(r).kernels if kernels is None else kernels
    found = kernels.get(splits)
    if found is None:
        comm_tm, comm_tn = r.tiles.comm_shape(r.topk, -(-r.hidden // splits))
        family = kernel_family(r.device, r.backend, r.tiles, comm_tm, comm_tn,
                               gemm2.next_pow2(r.topk))
        found = kernels[splits] = (family, plan_cache(family, r.config, r.device, True),
                                   plan_cache(family, r.config, r.device))
    return found


def _at_splits(request: PlanRequest, splits: int, shape: _Shape) -> LaunchPlan:
    """The launch's plan at L = `splits`."""
    r = request
    family, cache, _, planned = shape.at.get(splits) or _at(request, splits, shape)
    plan = planned(r.num_tokens, r.row_tiles)
    # one tail helper per SM that GEMM2 leaves when it ends (the comm CTAs keep theirs)
    helpers = (cache.device.available_sms - reservation(plan.comm_ctas, cache.kernel)
               if r.config.tail_helpers else 0)
    return LaunchPlan(plan, family, splits, r.num_tokens // r.world, max(0, helpers),
                      r.config.max_spins, r.config.wait_timeout_s, cache, request)


@functools.lru_cache(maxsize=64)
def split_candidates(hidden: int, roofline_tile_n: int | None = None) -> tuple[int, ...]:
    """The L the op ranks for a hidden size N. With the splits' roofline
    (`roofline_tile_n`: GEMM2's column tile TN, where the calibration has `hbm_balance`)
    ROOFLINE_CANDIDATES down to one column tile per split: the roofline prices what a
    split re-reads. Without it SPLIT_CANDIDATES up to 2 x the default (and N), so every
    split keeps at least 512 columns (four 128-wide column tiles share each row tile of x
    while it is in L2): the wave model alone has no such term (its T(L) only falls with
    L), and past this bound the captured sweep measured 1.03x-1.92x the fastest L
    (docs/RESULTS.md, "The planner's L")."""
    if roofline_tile_n:
        return tuple(c for c in ROOFLINE_CANDIDATES if c * roofline_tile_n <= hidden) or (1,)
    return tuple(c for c in SPLIT_CANDIDATES if c <= min(2 * default_splits(hidden), hidden))


def rank_splits(hidden: int, predicted, candidates: tuple[int, ...] | None = None) -> int:
    """The L the op runs when none is given: of `candidates` (`split_candidates(hidden)`
    by default), the least `predicted(L)` (compute waves, one unit for every L); ties go
    to fewer splits. `predicted` is the ranking model's T at that L."""
    chosen, best = None, None
    for cand in candidates or split_candidates(hidden):
        t = predicted(cand)
        if best is None or t < best * (1 - 1e-9):
            chosen, best = cand, t
    return chosen


def _candidates(request: PlanRequest, shape: _Shape) -> tuple[int, ...]:
    """The L `plan_launch` ranks: down to one column tile where the ranking prices the
    splits' HBM traffic (`split_candidates`); `shape`: the request's `_shape`, which
    keeps them."""
    if shape.candidates is None:
        ranking = _caches_at(request, 1, shape.kernels)[1]
        roof = ranking.calib.hbm_balance is not None
        shape.candidates = split_candidates(request.hidden,
                                            ranking.kernel.tile_n if roof else None)
    return shape.candidates


def split_predictions(request: PlanRequest, candidates=SPLIT_CANDIDATES) -> dict[int, float]:
    """The ranking model's T(C*) at each L of `candidates` (up to N): what `rank_splits`
    compares, in compute waves, for tools that set it beside measured times."""
    ranked = _ranked(request, _shape(request))
    return {cand: ranked(cand) for cand in candidates if cand <= request.hidden}


def _ranked(request: PlanRequest, shape: _Shape) -> Callable[[int], float]:
    """L -> T at L under the model that ranks L, for this request (no plan kept for it):
    each L's `ranked` at the request's M and row tiles."""
    at, tokens, row_tiles = shape.at, request.num_tokens, request.row_tiles

    def t(splits: int) -> float:
        return (at.get(splits) or _at(request, splits, shape))[2](tokens, row_tiles)
    return t


_decisions: dict[PlanRequest, LaunchPlan] = {}


def plan_launch(request: PlanRequest) -> LaunchPlan:
    """The launch's plan, remembered per request: the decision depends on the counts only
    through row_tiles (the host runs this after Megatron's sync, while the GPU waits).
    L unless given: the candidate with the least predicted T (compute waves, the same unit
    for every L; ties go to fewer splits) under the model without the tail-helper and
    overlap-factor terms. Those two were fitted and checked on C sweeps at a fixed L;
    ranking L with them picked one split, no overlap, for almost every workload, measured
    slower (docs/RESULTS.md). C is then the full model's at that L."""
    found = _decisions.get(request)
    if found is None:
        shape = _shape(request)
        splits = request.splits or rank_splits(request.hidden, _ranked(request, shape),
                                               _candidates(request, shape))
        found = _at_splits(request, splits, shape)
        if len(_decisions) >= MAX_DECISIONS:
            _decisions.clear()
        _decisions[request] = found
    return found


def cached_counts() -> dict[str, int]:
    """How many kernel families, plan caches and launch decisions are remembered (a long
    run's memory: `tools/soak.py`)."""
    return dict(families=len(_families), plan_caches=len(_caches), decisions=len(_decisions),
                kernels=len(_kernels), shapes=len(_shapes))


_last_logged: tuple | None = None


def log_decision(launch_plan: LaunchPlan, m: int, n: int, k: int, world: int) -> None:
    """A DEBUG line whenever the (C, L, sizes) of the op's decisions change."""
    global _last_logged
    plan = launch_plan.plan
    sig = (plan.comm_ctas, plan.splits, m, n, k, world)
    if _last_logged != sig:
        _last_logged = sig
        log.debug("gemm2_gather_rs: C=%d P=%d L=%d T=%.1f (M=%d N=%d K=%d D=%d, %s)",
                  plan.comm_ctas, plan.compute_slots, plan.splits, plan.predicted, m, n, k,
                  world, plan.source)
