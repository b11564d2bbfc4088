"""Operator configuration: backend choice, tile shapes, and the planner's view of the device."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from dataclasses import dataclass

import torch

from ..planner import (A100_PAPER, Calibration, DeviceSpec, KernelSpec, Preset, get_preset,
                       preset_for_device)
from ..planner.presets import MAX_SPLITS  # (the readiness flags: one word per split)
from .. import env
from ..kernels.gather_rs import MAX_WAIT_TIMEOUT_S, WAIT_TIMEOUT_S

log = logging.getLogger("megatron_overlap")

BACKENDS = ("auto", "triton", "interpret", "reference")
PLACEMENTS = ("partition", "shared")  # TileConfig.placement


#: dtypes the pushed partial sums may have (OverlapConfig.partial_dtype)
PARTIAL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: the largest spin bound: GatherRS's poll counter is an int32
MAX_SPINS = (1 << 31) - 1
#: SMs of the largest device the planner is asked about (sm_margin, the interpreter's)
MAX_SMS = 1024


def _check_int(name: str, value, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"OverlapConfig.{name} must be an int in [{lo}, {hi}], got {value!r}")


@dataclass(frozen=True)
class OverlapConfig:
    """How `gemm2_gather_rs` runs. Every field has a sensible default, a constant: the
    environment never changes an OverlapConfig() (`OverlapConfig.from_env` reads it).

    backend: "triton" (CUDA), "interpret" (the same kernels under TRITON_INTERPRET=1 on
        CPU tensors), "reference" (torch grouped GEMM + combine + reduce_scatter_tensor,
        also the non-overlapped baseline) or "auto" (triton on CUDA tensors, interpret on
        CPU when TRITON_INTERPRET=1, else reference).
    comm_ctas: explicit C; None lets the planner choose before every launch.
    splits: explicit L; None uses max(1, N // 1024): one 1024-wide communication tile
        per split, the paper's choice (L=1 for N=1024, L=2 for N=2048).
    planner: False returns the fixed default C = 3 (the public COMET A100 path).
    sm_margin: SMs left to other concurrent kernels.
    preset: calibration preset name or JSON path; None finds the shipped calibration
        for this device name (falling back to the paper's A100 rho_ref with a warning).
    max_spins: a bound on the polls of every spin-wait (default: none but int32's); a
        time-out raises OverlapTimeoutError.
    wait_timeout_s: the time bound of every spin-wait, in seconds of the GPU's global
        timer (the host's clock under the interpreter).
    partial_dtype: dtype of the pushed partial sums; None = the output dtype.
    sync_errors: check the kernels' error word right after every call (a host sync);
        otherwise it is checked at the next call or at `OverlapBuffer.check()`.
    tiles: kernel tile shapes; None = the backend's default in `placement`: `GPU_TILES`
        on CUDA, `INTERPRET_TILES` under the interpreter (`load_tiles` reads the file
        `tools/tune_tiles.py` writes).
    tail_helpers: when GEMM2 ends, launch one more GatherRS CTA per SM it leaves, to
        share the last split (which becomes ready only then) with the C communication
        CTAs; False leaves the last split to the C CTAs, as the paper's model assumes.
    placement: where the communication CTAs run when `tiles` is None (TileConfig.placement):
        "shared" (one beside GEMM2's on every SM; the Hopper default), "partition" (SMs
        of their own, the paper's scheme), or None (the default tiles' own).
    """

    backend: str = "auto"
    comm_ctas: int | None = None
    splits: int | None = None
    planner: bool = True
    sm_margin: int = 0
    preset: str | None = None
    # (no poll bound of its own by default: the waits are bounded by time, wait_timeout_s)
    max_spins: int = MAX_SPINS
    partial_dtype: torch.dtype | None = None
    sync_errors: bool = False
    tiles: "TileConfig | None" = None
    tail_helpers: bool = True
    placement: str | None = None
    # (last: a field added after the others keeps positional construction working)
    wait_timeout_s: float = WAIT_TIMEOUT_S

    @classmethod
    def from_env(cls, **overrides) -> "OverlapConfig":
        """A config from the MEGATRON_OVERLAP_* variables, for tools and launchers;
        `overrides` win (a field given there is not read from its variable):
        MEGATRON_OVERLAP_TILES (a `tools/tune_tiles.py` JSON: tiles, in `placement` where
        that is set too), _PLACEMENT (shared | partition), _TAIL_HELPERS (0/1, false/true,
        no/yes, off/on), _WAIT_TIMEOUT_S (seconds), _MAX_SPINS, each setting the field of
        its name. Unset or empty: the default. A bad value raises ValueError naming the
        variable; any other MEGATRON_OVERLAP_* set draws a warning (megatron_overlap/env.py)."""
        fields = env.fields_from_env({  # (each field's bounds are OverlapConfig's)
            "tiles": lambda n: env.env_parsed(n, load_tiles),
            "placement": lambda n: env.env_choice(n, PLACEMENTS),
            "tail_helpers": lambda n: env.env_bool(n, True),
            "wait_timeout_s": lambda n: env.env_float(n, WAIT_TIMEOUT_S, MAX_WAIT_TIMEOUT_S),
            "max_spins": lambda n: env.env_int(n, MAX_SPINS, 1, MAX_SPINS),
        }, overrides)
        if "tiles" not in overrides and fields.get("tiles") is not None:
            # a tiles file in the placement asked for, as the default tiles are
            fields["tiles"] = in_placement(fields["tiles"], fields.get("placement"))
        return cls(**fields)

    def __post_init__(self) -> None:
        if self.placement is not None and self.placement not in PLACEMENTS:
            raise ValueError(f"OverlapConfig.placement must be one of {PLACEMENTS} or None, "
                             f"got {self.placement!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"OverlapConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        for name, most in (("comm_ctas", MAX_SMS), ("splits", MAX_SPLITS)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 1 <= value <= most):
                raise ValueError(f"OverlapConfig.{name} must be an int in [1, {most}] or None, "
                                 f"got {value!r}")
        _check_int("sm_margin", self.sm_margin, 0, MAX_SMS - 1)
        # (GatherRS counts its polls in int32: a larger bound would never be reached)
        _check_int("max_spins", self.max_spins, 1, MAX_SPINS)
        t = self.wait_timeout_s
        if (isinstance(t, bool) or not isinstance(t, (int, float))
                or not 0 < t <= MAX_WAIT_TIMEOUT_S):
            raise ValueError(f"OverlapConfig.wait_timeout_s must be a number of seconds in "
                             f"(0, {MAX_WAIT_TIMEOUT_S:g}], got {t!r}")
        if self.partial_dtype not in (None,) + PARTIAL_DTYPES:
            raise ValueError(f"OverlapConfig.partial_dtype must be None or one of "
                             f"{PARTIAL_DTYPES}, got {self.partial_dtype!r}")
        if not isinstance(self.tail_helpers, bool):
            raise ValueError(f"OverlapConfig.tail_helpers must be a bool, got "
                             f"{self.tail_helpers!r}")


@dataclass(frozen=True)
class TileConfig:
    """Compile-time shapes of the two kernels.

    GEMM2: BLOCK_M x BLOCK_N x BLOCK_K tiles, warps, pipeline stages. GatherRS: a CTA
    gathers [comm_rows // pow2(k) tokens, pow2(k) slots, comm_tn columns] at once, so the
    registers per thread stay the same whatever top-k is; comm_tn is capped at the split
    width (rounded up to a power of two). `comm_slot_loop` gathers that block as one
    [TM, TN] tile per slot added into a register accumulator; without it as one
    [TM, k, TN] tensor reduced over k (a cross-thread reduction through shared memory).
    `comm_stages` > 1 software-pipelines GatherRS's item loop: the gathers of the next
    comm_stages - 1 items go to shared memory by cp.async while the CTA sums the
    current one (lowered where the buffers would not fit, `gather_rs.fit_item_stages`).

    `token_major`: where every token has its k rows on this rank (TP layouts: T = M k),
    GEMM2 stores row j of its output at y[t * k + s] (token t, slot s of its rows: the
    routing table's inverse) instead of y[j], so GatherRS computes the address of slot s
    of a block of tokens instead of reading it from the table first. Same sums, same
    bits; on H200 GatherRS alone moved 1.1x-1.4x more bytes per CTA (docs/RESULTS.md).
    Under EP (tokens with rows elsewhere) y stays in GEMM2's row order: there the
    layout measured no faster and would double y (M k rows for about M k / EP).

    `gemm_impl`: "auto" (the default: the Gluon kernel for bf16 on Hopper where y is
    token-major, Triton's elsewhere; `gemm2.resolve_impl`), "triton" (`kernels/gemm2.py`, every
    backend) or a warp-specialized
    Gluon kernel (`kernels/gemm2_ws.py`: a loader warp runs the TMA loads ahead across
    tiles; CUDA on Hopper only): "gluon" publishes each stored tile from a warp of its
    own, "gluon_inline_publish" from the warpgroup that stored it, as the Triton kernel.

    `placement`: where the communication CTAs run. "partition" (the paper's scheme):
    C CTAs take R(C) SMs of their own and GEMM2 runs on the rest. "shared": one small
    GatherRS CTA (comm_warps = 4) beside GEMM2's CTAs on every SM, in the registers they
    leave (the op caps both kernels' registers on CUDA: `SHARED_GEMM_MAXNREG`,
    `SHARED_COMM_MAXNREG`), so GEMM2 keeps all G SMs; 0.84x-0.98x of the partition's
    overlapped time on H200 (docs/RESULTS.md, "Kernel choices measured"). Where the compiled kernels
    do not fit one SM together the op plans and launches the partition instead.
    `gemm_maxnreg` / `comm_maxnreg`: explicit register caps per thread (None: the
    placement's default).
    """

    block_m: int
    block_n: int
    block_k: int
    gemm_warps: int
    gemm_stages: int
    comm_rows: int
    comm_tn: int
    comm_warps: int
    gemm_flatten: bool = False  # let Triton pipeline across the persistent tile loop
    comm_stages: int = 1  # GatherRS item-loop pipeline depth (1 = none)
    comm_slot_loop: bool = True  # gather one [TM, TN] tile per top-k slot (else [TM, k, TN])
    token_major: bool = True  # y rows in (token, slot) order: GEMM2 scatters, GatherRS streams
    gemm_impl: str = "auto"  # GEMM2 kernel: "auto", "triton", or a warp-specialized Gluon one
    gemm_maxnreg: int | None = None  # register cap per GEMM2 thread (None: the kernel's own)
    comm_maxnreg: int | None = None  # register cap per GatherRS thread (None: the compiler's)
    placement: str = "partition"  # "partition": comm CTAs on SMs of their own; "shared"

    def __post_init__(self) -> None:
        from ..kernels.gemm2 import IMPLS

        self._check_shapes()
        if self.gemm_impl not in ("auto",) + IMPLS:
            raise ValueError(f"TileConfig.gemm_impl must be one of {('auto',) + IMPLS}, "
                             f"got {self.gemm_impl!r}")
        if self.gemm_impl not in ("triton", "auto") and (self.block_m != 128 or self.block_n > 128
                                           or self.gemm_warps != 4):
            raise ValueError(f"TileConfig.gemm_impl={self.gemm_impl!r} runs 128 x (<= 128) "
                             f"tiles on 4 warps, got {self.block_m} x {self.block_n}, "
                             f"{self.gemm_warps} warps")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"TileConfig.placement must be one of {PLACEMENTS}, got "
                             f"{self.placement!r}")
        for name in ("gemm_maxnreg", "comm_maxnreg"):
            cap = getattr(self, name)
            if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int)
                                    or not 24 <= cap <= 248 or cap % 8):
                raise ValueError(f"TileConfig.{name} must be None or a multiple of 8 in "
                                 f"[24, 248] (registers per thread), got {cap!r}")
        if self.token_major and not self.comm_slot_loop:
            raise ValueError("a token-major y is gathered one slot at a time: "
                             "comm_slot_loop must be True (or token_major False)")

    def _check_shapes(self) -> None:
        """Tile sizes the kernels can compile: powers of two (tl.arange's shapes) in
        ranges Triton and the TMA descriptors take (a box side is at most 256)."""
        for name, lo, hi, pow2 in (
                ("block_m", 16, 256, True), ("block_n", 16, 256, True),
                ("block_k", 16, 256, True), ("gemm_warps", 1, 32, True),
                ("gemm_stages", 1, 64, False), ("comm_rows", 1, 4096, True),
                ("comm_tn", 1, 4096, True), ("comm_warps", 1, 32, True),
                ("comm_stages", 1, 64, False)):
            v = getattr(self, name)
            if (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi
                    or (pow2 and v & (v - 1))):
                kind = "a power of two" if pow2 else "an int"
                raise ValueError(f"TileConfig.{name} must be {kind} in [{lo}, {hi}], got {v!r}")
        for name in ("gemm_flatten", "comm_slot_loop", "token_major"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TileConfig.{name} must be a bool, got {getattr(self, name)!r}")

    def comm_shape(self, topk: int, split_width: int) -> tuple[int, int]:
        """(TMc, TNc) of the communication tile for this top-k and split width."""
        slots = 1 << max(0, (topk - 1).bit_length())
        return max(1, self.comm_rows // slots), min(self.comm_tn, 1 << max(0, (split_width - 1).bit_length()))


#: The partition placement on Hopper, chosen with `tools/tune_tiles.py` and measured
#: overlapped on H200 (docs/RESULTS.md, "Kernel choices measured"):
#: 32-warp GatherRS CTAs (one per SM, so R(C) = C holds), each gathering 256 rows x 1024
#: columns per item, one top-k slot at a time, from a token-major y.
PARTITION_TILES = TileConfig(128, 128, 64, 4, 3, 256, 1024, 32)
#: Hopper defaults: the shared placement, one 4-warp GatherRS CTA per SM beside GEMM2's
#: two, gathering 32 rows x 512 columns per item (measured overlapped on one H200: the
#: fastest of 32 x 512 and 16 x 1024 in four of six cases, within 1% in the others).
GPU_TILES = TileConfig(128, 128, 64, 4, 3, 32, 512, 4, placement="shared")
#: Register caps of the shared placement, per thread: two GEMM2 CTAs and one 4-warp
#: GatherRS CTA in one SM's 64K registers (Gluon: 2 x 8 warps x 32 x 104 + 4 x 32 x 96
#: = 65536; Triton: 2 x 4 x 32 x 200 + 12288 = 63488). Compiled without spills on sm_90
#: (the Gluon kernel's MMA warpgroup still gets 184 after the workers give theirs back).
SHARED_GEMM_MAXNREG = {"triton": 200, "gluon": 104, "gluon_inline_publish": 104}
SHARED_COMM_MAXNREG = 96


@functools.lru_cache(maxsize=8)  # read once: the default is looked up on every launch
def load_tiles(path: str) -> TileConfig:
    """The tiles `tools/tune_tiles.py` chose (its JSON's `best`), on top of GPU_TILES.
    Keys of `best` other than those read here are ignored, so a file that names a switch
    removed after it measured no gain (comm_evict_first, comm_dynamic_items,
    gemm_places_from_marks, gemm_tail_evict_last; all off by default) still loads."""
    import json

    try:
        with open(path) as f:
            best = json.load(f)["best"]
        m, n, k, w, s, flat, *impl = best["gemm"]  # [..., flatten, implementation]
        rows, tn, cw, *mode = best["comm"]  # [rows, tn, warps, slot loop, stages, token-major]
        slot_loop = _flag(mode[0]) if mode else GPU_TILES.comm_slot_loop
        # files from before the layout choice: token-major where the gather allows it
        token_major = _flag(mode[2]) if len(mode) > 2 else slot_loop and GPU_TILES.token_major
        # (TileConfig checks the sizes' types and ranges)
        return TileConfig(m, n, k, w, s, rows, tn, cw, _flag(flat),
                          comm_stages=mode[1] if len(mode) > 1 else 1,
                          comm_slot_loop=slot_loop, token_major=token_major,
                          gemm_impl=str(impl[0]) if impl else GPU_TILES.gemm_impl,
                          # files from before the placement: 32-warp CTAs, partitioned
                          placement=str(best.get("placement", "partition")))
    except (OSError, KeyError, ValueError, TypeError, AttributeError) as err:
        raise ValueError(f"{path}: not a tune_tiles result ({type(err).__name__}: {err})") from err


def _flag(value) -> bool:
    """A tiles file's switch: true/false (or 1/0, as older files wrote)."""
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise ValueError(f"a switch must be true, false, 0 or 1, got {value!r}")


def in_placement(tiles: TileConfig, placement: str | None) -> TileConfig:
    """`tiles` in `placement` (None: their own): the other placement's tuned tiles where
    `tiles` are one placement's (GPU_TILES / PARTITION_TILES), else the same shapes."""
    if placement is None or placement == tiles.placement:
        return tiles
    if tiles in (GPU_TILES, PARTITION_TILES):
        return GPU_TILES if placement == "shared" else PARTITION_TILES
    return dataclasses.replace(tiles, placement=placement)


#: The interpreter: small tiles so tiny test shapes still span many tiles and splits.
INTERPRET_TILES = TileConfig(16, 16, 16, 4, 1, 16, 16, 4, gemm_impl="triton")
#: SMs of the virtual device the interpreter plans for (small, so P stays small)
INTERPRET_SMS = 20


def interpreting() -> bool:
    # (Triton's own variable, read as Triton reads it: the interpreter is chosen when
    # triton is imported, before any config exists)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(requested: str, device: torch.device) -> str:
    if requested == "auto":
        if device.type == "cuda":
            return "triton"
        return "interpret" if interpreting() else "reference"
    if requested == "triton" and device.type != "cuda":
        raise ValueError("backend 'triton' needs CUDA tensors; use 'interpret' or 'reference' on CPU")
    if requested == "interpret":
        if device.type != "cpu":
            raise ValueError("backend 'interpret' runs on CPU tensors")
        if not interpreting():
            raise ValueError("backend 'interpret' needs TRITON_INTERPRET=1 set before triton "
                             "is imported (e.g. in the environment of the launch)")
    return requested


def default_splits(hidden: int) -> int:
    return max(1, hidden // 1024)


def device_spec(device: torch.device, sm_margin: int) -> DeviceSpec:
    """G from the device (torch.cuda properties); the interpreter's virtual device on CPU."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return DeviceSpec(props.name, props.multi_processor_count, sm_margin)
    return DeviceSpec("triton-interpreter", INTERPRET_SMS, sm_margin)


_warned: set[str] = set()


def calibration_for(device: DeviceSpec, preset: str | None, fp8: str | None = None
                    ) -> Calibration:
    """The shipped (or given) calibration for this device and GEMM2's operands (`fp8`:
    their FP8 scaling kind; None: bf16); the paper's as a fallback."""
    found = _preset(preset, device)
    if found is not None:
        if fp8 is not None and fp8 not in found.fp8:
            _warn_once(f"{found.name}/{fp8}", "calibration %s has no FP8 %s-scaled family; "
                       "planning it with the bf16 family's (tools/calibrate.py --fp8 %s "
                       "makes one)", found.name, fp8, fp8)
        return found.for_operands(fp8)[0]
    if device.name != "triton-interpreter":
        _warn_once(device.name, "no calibration shipped for %s; using the paper's A100 "
                   "rho_ref (run tools/calibrate.py to make one)", device.name)
    return A100_PAPER.calibration


def _warn_once(key: str, message: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def preset_of(config: OverlapConfig, device: DeviceSpec) -> Preset | None:
    """The config's preset, else the shipped one for this device (None: none shipped)."""
    return _preset(config.preset, device)


def _preset(name: str | None, device: DeviceSpec) -> Preset | None:
    return get_preset(name) if name is not None else preset_for_device(device.name)


def kernel_spec(tiles: TileConfig, comm_tm: int, comm_tn: int, o_comp: int,
                o_comm: int, tail_helpers: bool = False, shared_sms: bool = False) -> KernelSpec:
    return KernelSpec(tiles.block_m, tiles.block_n, comm_tm, comm_tn, o_comp, o_comm,
                      tail_helpers, shared_sms)


def with_register_caps(tiles: TileConfig) -> TileConfig:
    """The shared placement's register caps where the tiles leave them unset (CUDA)."""
    if tiles.placement != "shared":
        return tiles
    return dataclasses.replace(
        tiles, gemm_maxnreg=tiles.gemm_maxnreg or SHARED_GEMM_MAXNREG[tiles.gemm_impl],
        comm_maxnreg=tiles.comm_maxnreg or SHARED_COMM_MAXNREG)
