"""OverlapBuffer: owns the peer memory, flags and plan cache of one process group.

One buffer per (group, device) lives for the whole run: receive slots grow on demand
(a collective re-allocation, identical on every rank because it depends only on M, N
and D) and are reused across calls and layers.

Peer memory layout (bytes): the signal area (D int32 barrier words, then the launch
descriptors [2 parities][D][DESC_WORDS], `gather_rs.signal_words`), padded to 128, then
two parity halves of fixed size, each [D slots][Md rows][N] partials of this call's
geometry. Local flags: ready[L_MAX], done, error, and the mismatch record (int32).

Ranks that disagree (issue 29.2): every call's descriptor (epoch, call number, M, N,
partial dtype) is agreed on in the kernels' barrier (`gather_rs`); the host adds no
collective per call. The only host collective of a call, growing the peer memory, is
entered only after the same agreement, run alone (`agreement_kernel`), has passed on
this rank, so a rank never waits in a collective its peer skipped; the group's first
allocation agrees through the allocation's own all-gather. The halves do not move
when the geometry changes inside them, so a new (Md, N, dtype) needs no quiesce.
"""

from __future__ import annotations

import contextlib
import ctypes
import warnings

import torch
import torch.distributed as dist

from ..kernels import gather_rs as grs
from ..kernels import gemm2
from ..kernels.routing_table import launch_routing_table
from ..planner import PlanCache, expert_row_tiles, ranking_calibration
from .config import (GPU_TILES, INTERPRET_TILES, MAX_SPLITS, OverlapConfig, TileConfig,
                     calibration_for, device_spec, in_placement, kernel_spec)
from .config import PARTIAL_DTYPES
from .counts_ring import CountsRing
from .errors import ErrorWord, OverlapMismatchError, OverlapTimeoutError, describe_mismatch
from .peer_memory import PeerMemory
from .residency import compiled_occupancies
from .stream_ops import StreamOps

L_MAX = MAX_SPLITS  # readiness words: one per split

#: op calls per process group so far, this process (id(group) -> [group, calls]): every
#: call counts, including one that raises before it launches, so a rank that raised and
#: calls again carries a call number its peers do not (the launch descriptor, `launch`)
_CALLS: dict[int, list] = {}


def _calls_of(group) -> list:
    entry = _CALLS.get(id(group))
    if entry is None or entry[0] is not group:
        entry = _CALLS[id(group)] = [group, 0]
    return entry


def note_call(group) -> int:
    """Count one op call on `group` (the op's first step, before any check can raise);
    the call's number."""
    entry = _calls_of(group)
    entry[1] += 1
    return entry[1]


def dtype_code(dtype: torch.dtype) -> int:
    """The partial dtype as a descriptor word (0: none of PARTIAL_DTYPES)."""
    return PARTIAL_DTYPES.index(dtype) + 1 if dtype in PARTIAL_DTYPES else 0


class OverlapBuffer(ErrorWord):
    """Workspace and launcher for `gemm2_gather_rs` on one group and device."""

    _instances: "dict[tuple, OverlapBuffer]" = {}  # one per group and device, for the process
    #: host offsets through a ring of pinned slots the routing-table kernel reads in
    #: place (`route`); False copies them. An instance turns it off where the GPU cannot
    #: read pinned memory in place; the class attribute is for A/B tools and tests.
    mapped_offsets = True

    @classmethod
    def get(cls, group, device: torch.device, backend: str) -> "OverlapBuffer":
        key = (id(group), str(device), backend)
        buf = cls._instances.get(key)
        if buf is None:
            buf = cls._instances[key] = cls(group, device, backend)
        return buf

    @classmethod
    def exists(cls, group, device: torch.device, backend: str) -> bool:
        return (id(group), str(device), backend) in cls._instances

    def __init__(self, group, device: torch.device, backend: str):
        self.group = group
        self.device = device
        self.backend = backend
        distributed = group is not None and dist.is_initialized()
        self.world = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        self.ready = torch.zeros(L_MAX, dtype=torch.int32, device=device)
        self._no_peers = torch.zeros(1, dtype=torch.int64, device=device)  # world 1's tables
        self.done = torch.zeros(1, dtype=torch.int32, device=device)
        self.error = torch.zeros(1, dtype=torch.int32, device=device)
        # the calls of this group so far (the barrier's epoch), on the device: GatherRS
        # reads and advances it, so replays of captured calls go on counting
        self.epoch = torch.zeros(1, dtype=torch.int32, device=device)
        self.captured = False  # some launch of it went into a CUDA graph
        self.broken: str | None = None
        self.broken_type: type = OverlapTimeoutError  # what a refused call raises
        # where GatherRS records a mismatch: both descriptors and the peer (RECORD_WORDS)
        self.record = torch.zeros(grs.RECORD_WORDS, dtype=torch.int32, device=device)
        self._calls = _calls_of(group)  # [group, op calls on it]: the descriptor's number
        self.wait_bounds: tuple | None = None  # (seconds, polls) of the latest launch's waits
        self._memory: PeerMemory | None = None
        self._layout: tuple | None = None  # (rows per rank Md, hidden, partial dtype)
        self._shape_words = (0, 0, 0)  # the descriptor's (M, N, dtype code) of the layout
        self._ptr_table: torch.Tensor | None = None  # [2, world]: each parity's slots
        self._recv_views: list[torch.Tensor] = []  # recv(0), recv(1)
        self._slots_at = (0, 0)  # (byte offset of the slots, bytes per parity): fixed
        self._signal_ptrs: torch.Tensor | None = None
        self._caches: dict[tuple, PlanCache] = {}
        self.decisions: dict[tuple, tuple] = {}  # the op's (plan, launch arguments) by key
        # registers / shared memory / warps of the compiled kernels, per kernel family
        # (tiles, comm tile, slots); `compiled_resources` is the latest family's
        self.resources_of: dict[tuple, dict] = {}
        self.compiled_resources: dict | None = None
        self._pending: tuple | None = None  # (event, pinned error word, expected)
        # event records, waits and the error word's copy through the driver (cheaper)
        self.stream_ops = StreamOps(device) if device.type == "cuda" else None
        self.counts_ring = CountsRing(device, stream_ops=self.stream_ops)
        if device.type == "cuda":
            self.side_stream = torch.cuda.Stream(device)
            self._pinned = torch.zeros(1, dtype=torch.int32, pin_memory=True)
            # read in place: indexing the tensor costs ~10 us on the launch path
            self._pinned_word = ctypes.c_int32.from_address(self._pinned.data_ptr())
            self._event = torch.cuda.Event()
            self._fork = torch.cuda.Event()  # main -> side before GatherRS
            self._join = torch.cuda.Event()  # side -> main after it

    # ---------------------------------------------------------------- memory
    def ensure(self, rows: int, hidden: int, dtype: torch.dtype, captured: bool = False) -> None:
        """Receive slots for `rows` tokens per rank x `hidden` columns of `dtype`.

        The slots of a call are [D][rows][hidden] at the start of each parity half, whose
        size the allocation fixes: a new geometry that fits changes no address and
        needs no collective (the slot stride is the call's own, the same on every rank
        that agrees). The allocation only grows (a process that alternates models does
        not reallocate collective memory per call); growing is collective, and entered
        only after every rank agreed on this call (module docstring).
        """
        if self.world == 1:  # no peers: the output is the only slot (`launch_comm`)
            return
        layout = (rows, hidden, dtype)
        if layout == self._layout:
            return
        need = -(-self.world * rows * hidden * (torch.finfo(dtype).bits // 8) // 128) * 128
        if self._memory is None or need > self._slots_at[1]:
            if captured:  # (it would synchronize, or allocate collectively)
                raise RuntimeError("gemm2_gather_rs cannot be captured in a CUDA graph here: "
                                   "its receive slots must grow to this call's rows or hidden "
                                   "size; make one eager call of the largest shapes before "
                                   "capturing")
            desc = self._descriptor(rows * self.world, hidden, dtype)
            if self._memory is not None:
                self._agree(desc)
            self._allocate(need, desc)
        self._layout = layout
        self._shape_words = (rows * self.world, hidden, dtype_code(dtype))
        self._recv_views = [self.recv(parity) for parity in (0, 1)]

    def _descriptor(self, tokens: int, hidden: int, dtype: torch.dtype) -> tuple:
        """(call number, M, N, dtype code): what this rank launches (as GatherRS's)."""
        return (self._calls[1] & 0x7FFFFFFF, tokens, hidden, dtype_code(dtype))

    def _agree(self, desc: tuple) -> None:
        """The barrier and agreement of this call alone, before a collective growth:
        raises (OverlapMismatchError, OverlapTimeoutError) unless every peer launched
        the same call. A peer that did not raises from its own GatherRS's barrier."""
        seconds, polls = self.wait_bounds or (grs.WAIT_TIMEOUT_S, (1 << 31) - 1)
        self.wait_bounds = (seconds, polls)
        self.check(sync=True)  # (an earlier call's error first, with its own message)
        grs.launch_agreement(self._signal_ptrs, self.epoch, self.error, self.record,
                             rank=self.rank, world=self.world, call_no=desc[0],
                             tokens=desc[1], hidden=desc[2], dtype_code=desc[3],
                             max_spins=polls, wait_timeout_s=seconds)
        self._pending = (None, self.error.clone(), None)  # (a synchronizing copy)
        self.check(sync=True)

    def _allocate(self, need: int, desc: tuple | None) -> None:
        """New peer memory (collective) with parity halves of at least `need` bytes, the
        largest any rank asks for; `desc` (None: a reset) is checked against every
        rank's first, in the same all-gather, where no kernel could agree on it."""
        mine = (desc, need, self._slots_at[1])
        every = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        if desc is not None:
            for src, (other, _, _) in enumerate(every):
                if other != desc:
                    self._raise_mismatch((0,) + desc, (0,) + other, src, host=True)
        half = max(max(n, h) for _, n, h in every)
        signal_bytes = -(-4 * grs.signal_words(self.world) // 128) * 128
        # (the old memory is freed after the new one's allocation, whose barrier waits
        # until every rank's device is done with it)
        self._memory = PeerMemory.allocate(signal_bytes + 2 * half, self.device, self.group,
                                           self.rank, self.world)
        self._signal_ptrs = torch.tensor(self._memory.peer_ptrs, dtype=torch.int64,
                                         device=self.device)
        self.epoch.zero_()  # fresh barrier words are zero on every rank
        self._slots_at = (signal_bytes, half)
        self._ptr_table = torch.tensor(
            [p + signal_bytes + parity * half for parity in (0, 1) for p in self._memory.peer_ptrs],
            dtype=torch.int64, device=self.device)
        self._layout = None

    def _raise_mismatch(self, mine: tuple, other: tuple, src: int, host: bool = False):
        """Raise OverlapMismatchError naming both descriptors ((epoch, call, M, N, dtype
        code) each); where the ranks' epochs or call numbers differ the buffer is broken
        until `reset` (they would differ for every later call too)."""
        message, fatal = describe_mismatch(self.rank, mine, src, other, host)
        if fatal:
            self.broken, self.broken_type = message, OverlapMismatchError
        raise OverlapMismatchError(message)

    def mismatch(self) -> None:
        """Raise the mismatch GatherRS recorded (the error word held ERR_MISMATCH; `check`)."""
        record = self.record.tolist()
        self.record.zero_()
        words = grs.DESC_WORDS
        self._raise_mismatch(tuple(record[:words]), tuple(record[words:2 * words]),
                             record[2 * words])

    def recv(self, parity: int) -> torch.Tensor:
        cap, hidden, dtype = self._layout
        start, half = self._slots_at
        raw = self._memory.local[start + parity * half:start + parity * half
                                 + self.world * cap * hidden * torch.finfo(dtype).bits // 8]
        return raw.view(dtype).view(self.world, cap, hidden)

    # ---------------------------------------------------------------- offsets, table
    def route(self, token_index, counts, block_m: int, num_tokens: int, topk: int,
              dest=None, padded: bool = False) -> tuple:
        """(table, (row_start, tile_start), counts_dev, row_tiles, event) from host
        counts: the expert offsets (`gemm2.packed_offsets_host`'s layout) on the device, the
        routing table, the row tiles of all experts (what the planner's W_comp reads),
        and an event recorded right after the routing-table kernel (None on CPU and on
        the copy path): `launch(fork=event)` forks GatherRS's stream from it instead of
        recording one more (valid while nothing the side stream depends on is queued
        on the caller's stream between the two; the op queues nothing there).

        `counts` may instead be an int tensor on this device (counts the host never
        saw): the kernel reads it in place the same way; row_tiles and the event are
        then None (the caller estimates the former); with `padded` they may sum to fewer
        than the rows, the rest being padding (`launch_routing_table`).

        The counts go into the next pinned slot of a ring (`counts_ring`), which the
        routing-table kernel reads in place (mapped): it sums them and writes the offsets
        into a fresh device tensor as it runs. No pinned allocation, copy or prefix sum
        of their own on the launch path, which runs after Megatron's sync while the GPU
        waits
        (`mapped_offsets = False`: the offsets built on the host and copied, one pinned
        copy per call). A slot is written
        again only once the kernel that read it has run (the event above)."""
        experts = len(counts)
        table = None
        on_device = isinstance(counts, torch.Tensor)
        if on_device or self.mapped_offsets:
            row_tiles = None if on_device else expert_row_tiles(counts, block_m)
            src = counts if on_device else self.counts_ring.write(counts)
            dev = torch.empty(3 * experts + 2, dtype=torch.int32, device=self.device)
            try:
                table = launch_routing_table(token_index, src, num_tokens, topk, self.error,
                                             dest, from_counts=(dev, block_m),
                                             padded=padded and on_device)
            except ValueError as err:  # raised by the launcher before anything is queued
                if on_device or "cannot be accessed" not in str(err):
                    raise
                self.mapped_offsets = False
                warnings.warn(f"megatron-overlap: the GPU cannot read pinned host memory in "
                              f"place here ({err}); the expert offsets are copied instead",
                              RuntimeWarning, stacklevel=3)
        if table is not None:
            routed = None if on_device else self.counts_ring.record()
            row_start, tile_start, counts_dev = gemm2.unpack_offsets(dev, experts)
        else:  # the copy path
            dev, row_tiles = gemm2.packed_offsets_host(counts, block_m, self.device)
            row_start, tile_start, counts_dev = gemm2.unpack_offsets(dev, experts)
            table = launch_routing_table(token_index, row_start, num_tokens, topk,
                                         self.error, dest)
            routed = None
        return table, (row_start, tile_start), counts_dev, row_tiles, routed

    # ---------------------------------------------------------------- planning
    def default_tiles(self, placement: str | None = None) -> TileConfig:
        """The backend's tiles (GPU_TILES on CUDA), in `placement` when given: on CUDA
        the tuned tiles of that placement (GPU_TILES / PARTITION_TILES)."""
        return in_placement(INTERPRET_TILES if self.backend == "interpret" else GPU_TILES,
                            placement)

    def remember(self, key: tuple, decision: tuple) -> None:
        """Keep an op decision (bounded: routing can make many distinct row-tile counts)."""
        if len(self.decisions) >= 4096:
            self.decisions.clear()
        self.decisions[key] = decision

    def plan_cache(self, config: OverlapConfig, tiles: TileConfig, comm_tm: int,
                   comm_tn: int, topk: int, ranking: bool = False) -> PlanCache:
        """The decision cache for one kernel family; o_comp / o_comm from its binaries.
        `ranking`: the model the op ranks L with (no tail-helper, no overlap-factor term)."""
        slots = gemm2.next_pow2(topk)
        helpers = config.tail_helpers and not ranking
        key = (config.sm_margin, config.preset, tiles, comm_tm, comm_tn, slots, helpers,
               ranking)
        cache = self._caches.get(key)
        if cache is None:
            device = device_spec(self.device, config.sm_margin)
            o_comp, o_comm, misfit = self._occupancies(tiles, comm_tm, comm_tn, slots)
            shared = tiles.placement == "shared" and misfit is None
            if tiles.placement == "shared" and not shared:
                warnings.warn(f"megatron-overlap: the shared placement does not fit one SM "
                              f"({misfit}: {self.compiled_resources}); planning and "
                              f"launching the partition placement instead", RuntimeWarning,
                              stacklevel=3)
            # the model serves the last split as the launch does: with the tail helpers
            # when they run (KernelSpec.tail_helpers)
            spec = kernel_spec(tiles, comm_tm, comm_tn, o_comp, o_comm, helpers, shared)
            calib = calibration_for(device, config.preset)
            if ranking:
                calib = ranking_calibration(calib)
            cache = PlanCache(spec, device, calib)
            self._caches[key] = cache
        return cache

    def _occupancies(self, t: TileConfig, comm_tm: int, comm_tn: int,
                     slots: int) -> tuple[int, int, str | None]:
        """`residency.compiled_occupancies` for this buffer's kernels; remembers their
        resources (`compiled_resources`, `resources_of`)."""
        if self.backend != "triton":
            return 2, 1, None  # the interpreter has no binary; any residency plans correctly
        o_comp, o_comm, misfit, self.compiled_resources = compiled_occupancies(
            self.device, (self.ready, self.done, self.error), t, comm_tm, comm_tn, slots)
        self.resources_of[(t, comm_tm, comm_tn, slots)] = self.compiled_resources
        return o_comp, o_comm, misfit

    def reset(self) -> None:
        """Forget a failed state; collective: rebuilds peer memory on every rank (the
        largest any rank had) and restarts the group's epochs and call numbers."""
        self.broken, self.broken_type = None, OverlapTimeoutError
        self._pending = None
        self.ready.zero_()
        self.done.zero_()
        self.error.zero_()
        self.record.zero_()
        self._calls[1] = 0
        if self._memory is not None:
            self._allocate(self._slots_at[1], None)

    # ---------------------------------------------------------------- launch
    @contextlib.contextmanager
    def _all_or_broken(self):
        """Launches that share the flag protocol: if one fails after another has started,
        the flags (done, ready) are left mid-call, so the buffer refuses further calls
        until `reset` (a later call would read them as this call's)."""
        try:
            yield
        except BaseException as err:
            self.broken = (f"a GEMM2/GatherRS launch failed after another launch of the "
                           f"call had started ({type(err).__name__}: {err}); the flags are "
                           f"mid-call")
            raise

    def launch(self, x, weight, counts_dev, table, probs, out, *, plan, splits, tiles,
               comm_tm, comm_tn, tokens_per_rank, max_spins, wait_timeout_s=grs.WAIT_TIMEOUT_S,
               phases=("gemm2", "comm"),
               y=None, offsets=None, helpers=0, dest=None, comm_first=None, fork=None,
               width=None):
        """GEMM2 (P programs) and GatherRS (C programs), then the local sum over ranks.

        `offsets` (row_start, tile_start), when the caller has them, saves recomputing.
        `dest` ([T] int32 from the routing table; every token has its k rows here, so
        T = M k): y is token-major, row j of the product at y[dest[j]].
        `phases` runs one side alone for calibration: without "gemm2" the readiness
        flags are preset and GatherRS reads the given `y`; without "comm" only GEMM2
        runs and the flags are cleared after it. `helpers`: tail-helper CTAs launched
        after GEMM2 to share the last split (none when GatherRS runs alone).
        `comm_first`: launch GatherRS before GEMM2 (None: where the plan reserves SMs for
        it, R > 0, the partition placement; see the launch below). `fork`: an event on
        the caller's stream, recorded after everything GatherRS reads was queued (the
        op's: `route`'s), for GatherRS's stream to start from (None: one recorded here).
        `width`: the split width sw (None: ceil(N/L)); a larger one narrows the last split
        to the N - (L-1) sw columns left (`gemm2.split_col_tiles`).
        """
        t = tiles
        self.wait_bounds = (wait_timeout_s, max_spins)  # (for a time-out's message)
        hidden = weight.shape[1]
        width = width or gemm2.split_width(hidden, splits)
        col_tiles, last_col_tiles = gemm2.split_col_tiles(hidden, splits, width, t.block_n)
        row_start, tile_start = (offsets if offsets is not None
                                 else gemm2.expert_offsets(counts_dev, t.block_m))
        if y is None:
            y = torch.empty(x.shape[0], hidden, dtype=out.dtype, device=x.device)
        gemm_args = dict(splits=splits, programs=plan.compute_slots, block_m=t.block_m,
                         block_n=t.block_n, block_k=t.block_k, num_warps=t.gemm_warps,
                         num_stages=t.gemm_stages, upcast=self.backend == "interpret",
                         flatten=t.gemm_flatten, dest=dest, impl=t.gemm_impl,
                         maxnreg=t.gemm_maxnreg, width=width)
        if "comm" not in phases:
            gemm2.launch_grouped_gemm2(x, weight, y, row_start, tile_start, self.ready,
                                       **gemm_args)
            self.ready.zero_()
            return y
        if "gemm2" not in phases:
            self.ready[:splits].fill_(1 << 30)
            helpers = 0

        def launch_comm(**kw):
            if self.world == 1:  # no peers: the one "slot" is the output itself (the
                # kernel writes partial_like there and reads no address table)
                dst = signals = self._no_peers
                slot_stride, row_stride, partial_like = 0, out.stride(0), out
            else:
                # (both parities' slots: the kernel picks this call's by its epoch)
                dst, signals = self._ptr_table, self._signal_ptrs
                slot_stride, row_stride = self._layout[0] * hidden, hidden
                partial_like = self._recv_views[0]
                # this launch's descriptor, agreed on at the barrier (M and N are the
                # kernel's own sizes)
                kw.update(record=self.record, call_no=self._calls[1] & 0x7FFFFFFF,
                          dtype_code=self._shape_words[2])
            grs.launch_gather_rs(
                y, table, probs, dst, signals, self.ready, self.done, self.error, tile_start,
                tokens_per_rank=tokens_per_rank, splits=splits, rank=self.rank,
                world=self.world,
                gemm_col_tiles=col_tiles, gemm_last_col_tiles=last_col_tiles,
                width=width, epoch=self.epoch, max_spins=max_spins,
                wait_timeout_s=wait_timeout_s, partial_like=partial_like,
                dst_slot_stride=slot_stride, dst_row_stride=row_stride,
                programs=plan.comm_ctas, block_tm=comm_tm, block_tn=comm_tn,
                num_warps=t.comm_warps, item_stages=t.comm_stages,
                slot_loop=t.comm_slot_loop, helpers=helpers, token_major=dest is not None,
                maxnreg=t.comm_maxnreg, **kw)

        if "gemm2" not in phases:
            launch_comm()
        elif self.backend == "interpret":
            # Programs of one launch run one after another here: GEMM2 must finish first.
            gemm2.launch_grouped_gemm2(x, weight, y, row_start, tile_start, self.ready,
                                       **gemm_args)
            with self._all_or_broken():
                launch_comm()
                if helpers:
                    launch_comm(launch_helpers=True)
        else:
            # GEMM2 compiled and loaded before GatherRS starts spinning on its flags (a
            # JIT compile or a lazy module load after that would leave it spinning).
            launch_gemm2 = gemm2.grouped_gemm2_launcher(x, weight, y, row_start, tile_start,
                                                        self.ready, **gemm_args)
            # GEMM2 (and the helpers behind it) on the caller's stream, which already
            # orders the offsets and the routing table before it; GatherRS on the side
            # stream from the same point. (No `torch.cuda.stream` switch anywhere: it
            # costs more than a launch.)
            side, ops = self.side_stream, self.stream_ops
            if fork is None:
                fork = self._fork
                ops.record(fork)
            if comm_first is None:
                comm_first = plan.reservation > 0
            if comm_first:
                # The partition: GatherRS's C programs take their R(C) SMs before GEMM2
                # fills the rest, so both grids are co-resident (P(C) + R(C) fit by
                # construction).
                ops.wait(fork, side)
                with self._all_or_broken():
                    launch_comm(stream=side)
                    launch_gemm2()
            else:
                # The shared placement (R = 0): the GatherRS CTAs fit beside GEMM2's on
                # every SM, so the order decides no residency, and GEMM2 first starts the
                # GPU one launch earlier (the GatherRS launch's host time runs while GEMM2
                # computes split 0, which GatherRS waits for anyway). It is also the order
                # that cannot deadlock: GEMM2 waits on nothing. (If its launch fails,
                # nothing of this call has touched the flags.)
                launch_gemm2()
                ops.wait(fork, side)
                with self._all_or_broken():
                    launch_comm(stream=side)
            if helpers:  # queued behind GEMM2: they start on the SMs it leaves
                with self._all_or_broken():
                    launch_comm(launch_helpers=True)
            ops.record(self._join, side)
            ops.wait(self._join)  # the caller's stream waits for GatherRS
        if self.world > 1:  # the slots of this call's parity (GatherRS stored its epoch)
            recv = self._recv_views[0]
            grs.launch_sum_partials(recv, out, self.world, epoch=self.epoch,
                                    parity_stride=self._slots_at[1] // recv.element_size())
        return y
