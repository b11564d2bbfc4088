"""The op's second stage, its pure parts: the launch's tiles, the kernels' family, the
request a plan depends on and the plan it gets (`LaunchPlan`: which L to run, the plan
(C, P, R) at that L and the launch's tiles), and how L is ranked.

`plans.Planner.plan(PlanRequest)` -> `LaunchPlan` answers from the planner's model over
a `KernelFamily` (the kernels' tiles and communication tile with their compiled
residency, read once per family from the binaries); the session owns that planner and
its caches. Nothing here touches a buffer or the routing: the request holds every input
and the answer depends on nothing else.

In the shared placement (Hopper's default) the plan's C is G for every L, so what is
decided here per call is L (`rank_splits`) and with it the communication tile
(`TileConfig.comm_shape`); in the partition placement the model also chooses C."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from ..kernels import gemm2
from ..planner import PlanCache
from .config import (GPU_TILES, INTERPRET_TILES, OverlapConfig, TileConfig, default_splits,
                     in_placement, with_register_caps)
from .fp8 import fp8_tiles

SPLIT_CANDIDATES = (1, 2, 4)
#: the L ranked where the calibration prices the splits' HBM traffic (`hbm_balance`)
ROOFLINE_CANDIDATES = (1, 2, 4, 8)


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
                 dtype: torch.dtype, token_major: bool, fp8: str | None = None) -> TileConfig:
    """The tiles a launch runs: the config's or the backend's default, resolved; y
    token-major only where the caller allows it (every token has its k rows on this rank
    and y's row numbers fit int32), else in GEMM2's row order. `fp8`: the scaling kind
    of FP8 operands (`dtype` e4m3; "block" runs BLOCK_K = 128: `fp8.fp8_tiles`)."""
    tiles = fp8_tiles(config.tiles or default_tiles(backend, config.placement), fp8)
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


@dataclass(frozen=True)
class FamilyKey:
    """What a kernel family's binaries depend on: the device, the backend, GEMM2's tiles,
    GatherRS's communication tile (TMc x TNc), its table slots (pow2(top-k)) and GEMM2's
    FP8 scaling kind (None: bf16 operands; "tensor" / "block": the FP8 kernel, compiled
    and its residency read apart). The planner looks a family up by it;
    `plans.KernelFamilies` compiles one per key."""

    device: torch.device
    backend: str
    tiles: TileConfig
    comm_tm: int
    comm_tn: int
    slots: int
    fp8: str | None = None

    def __str__(self) -> str:
        t = self.tiles
        layout = "token-major" if t.token_major else "row order"
        fp8 = f"FP8 {self.fp8} " if self.fp8 else ""
        return (f"{self.backend} {fp8}GEMM2 {t.block_m}x{t.block_n}x{t.block_k} ({t.gemm_impl}, "
                f"{t.placement}, {layout}) + GatherRS {self.comm_tm}x{self.comm_tn} x "
                f"{self.slots} slots on {self.device}")


def family_key(tiles: TileConfig, device: torch.device, backend: str, hidden: int,
               topk: int, splits: int, fp8: str | None = None) -> FamilyKey:
    """The family a launch of hidden size N = `hidden` and top-k `topk` (on FP8 operands
    of kind `fp8`) runs at L = `splits`: the communication tile follows the split width
    ceil(N / L)."""
    comm_tm, comm_tn = tiles.comm_shape(topk, -(-hidden // splits))
    return FamilyKey(device, backend, tiles, comm_tm, comm_tn, gemm2.next_pow2(topk), fp8)


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


@dataclass(frozen=True)
class PlanRequest:
    """Everything a launch's plan depends on: the sizes (M tokens, N hidden, K ffn, D
    ranks), the routing through W_comp's only input, row_tiles = sum_e ceil(M_e / TM),
    top-k and the rows per token this rank gathers (local_topk, in quarters so decisions
    stay cacheable), the caller's explicit L and C (None: the planner's), and the FP8
    scaling kind of GEMM2's operands (None: bf16; the kernel family's key)."""

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
    fp8: str | None = None


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
