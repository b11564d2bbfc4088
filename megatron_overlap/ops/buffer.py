"""OverlapBuffer: the peer memory, flags, epoch and error word of one process group.

It holds no plan and no routing: the op's stages (`routing`, `planning`, `launcher`)
pass those as values; a launch borrows the buffer's flags and slots.

One buffer per (group, device) lives for the whole run: receive slots grow on demand
(a collective re-allocation, identical on every rank because it depends only on M, N
and D) and are reused across calls and layers.

Peer memory layout (bytes): the signal area (D int32 barrier words, then the launch
descriptors [2 parities][D][DESC_WORDS], `gather_rs.signal_words`), padded to 128, then
two parity halves of fixed size, each [D slots][Md rows][N] partials of this call's
geometry. Local flags: ready[L_MAX], done, error, and the mismatch record (int32).

Ranks that disagree: every call's descriptor (epoch, call number, M, N,
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
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..kernels import gather_rs as grs
from ..kernels import sum_partials
from .config import MAX_SPLITS, PARTIAL_DTYPES
from .errors import ErrorWord, OverlapMismatchError, OverlapTimeoutError, describe_mismatch
from .peer_memory import PeerMemory
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


@dataclass(frozen=True)
class CommTarget:
    """The peer slots of one GatherRS launch (`OverlapBuffer.comm_target`)."""

    dst: torch.Tensor  # [2, D] int64 slot addresses of each parity
    signals: torch.Tensor  # [D] int64 signal areas
    slot_stride: int
    row_stride: int
    partial_like: torch.Tensor  # a partial's dtype and layout
    descriptor: dict  # this launch's descriptor words, for the barrier's agreement


class OverlapBuffer(ErrorWord):
    """The workspace of `gemm2_gather_rs` on one group and device."""

    _instances: "dict[tuple, OverlapBuffer]" = {}  # one per group and device, for the process
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
        # GatherRS's item counter per split (TileConfig.comm_dynamic_items), left zero by
        # each call's last program
        self.claims = torch.zeros(L_MAX, dtype=torch.int32, device=device)
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
        self._pending: tuple | None = None  # (event, pinned error word, expected)
        # the error word's copy and its event record through the driver (cheaper)
        self.stream_ops = StreamOps(device) if device.type == "cuda" else None
        if device.type == "cuda":
            self._pinned = torch.zeros(1, dtype=torch.int32, pin_memory=True)
            # read in place: indexing the tensor costs ~10 us on the launch path
            self._pinned_word = ctypes.c_int32.from_address(self._pinned.data_ptr())
            self._event = torch.cuda.Event()

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

    def reset(self) -> None:
        """Forget a failed state; collective: rebuilds peer memory on every rank (the
        largest any rank had) and restarts the group's epochs and call numbers."""
        self.broken, self.broken_type = None, OverlapTimeoutError
        self._pending = None
        self.clear_flags()
        self.record.zero_()
        self._calls[1] = 0
        if self._memory is not None:
            self._allocate(self._slots_at[1], None)

    # ---------------------------------------------------------------- a launch's slots
    @contextlib.contextmanager
    def all_or_broken(self):
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

    def comm_target(self, out: torch.Tensor) -> CommTarget:
        """Where this call's GatherRS pushes its partial sums: both parities' peer slots
        (the kernel picks this call's by its epoch) and the descriptor agreed on at its
        barrier (M and N are the kernel's own sizes); with no peers the one "slot" is the
        output itself (the kernel writes partial_like there and reads no address table)."""
        if self.world == 1:
            return CommTarget(self._no_peers, self._no_peers, 0, out.stride(0), out, {})
        return CommTarget(self._ptr_table, self._signal_ptrs, self._layout[0] * out.shape[1],
                          out.shape[1], self._recv_views[0],
                          dict(record=self.record, call_no=self._calls[1] & 0x7FFFFFFF,
                               dtype_code=self._shape_words[2]))

    def sum_partials(self, out: torch.Tensor) -> None:
        """`out` = the sum over ranks of the partials in this call's parity slots (its
        epoch, stored by GatherRS); nothing with no peers (GatherRS wrote `out`)."""
        if self.world > 1:
            recv = self._recv_views[0]
            sum_partials.launch_sum_partials(recv, out, self.world, epoch=self.epoch,
                                    parity_stride=self._slots_at[1] // recv.element_size())
