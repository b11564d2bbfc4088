"""OverlapBuffer: the peer memory, flags, epoch and error word of one process group.

It holds no plan and no routing: the op's stages (`routing`, `planning`, `launcher`)
pass those as values; a launch borrows the buffer's flags and slots.

The session of a (group, device) owns one buffer per backend for the whole run
(`session.OverlapSession`): receive slots grow on demand
(a collective re-allocation, identical on every rank because it depends only on M, N
and D) and are reused across calls and layers.

Peer memory layout (bytes): the signal area (D int32 barrier words, then the launch
descriptors [2 parities][D][DESC_WORDS], `gather_rs.signal_words`), padded to 128, then
two parity halves of fixed size, each [D slots][Md rows][N] partials of this call's
geometry. Local flags: ready[L_MAX], done, error, and the mismatch record (int32).

Ranks that disagree, and faults: every call's descriptor (epoch, generation, M, N,
kind) is agreed on in the kernels' barrier, which also recovers the group after a fault
(`kernels/flags.py`, the protocol in full); the host adds no collective per call. The
only host collectives of a call, growing the peer memory and the reference path's
reduce-scatter, are entered only after the same agreement, run alone
(`agreement_kernel`), has passed on this rank, so a rank never waits in a collective
its peer skipped; a call that raises on the host before it launched still arrives at
the barrier (`announce_raise`), marked failed, so that its peers raise for it at once
instead of waiting out the bound. The group's first allocation agrees through the
allocation's own all-gather. The halves do not move when the geometry changes inside
them, so a new (Md, N, dtype) needs no quiesce.
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
from .errors import (ErrorWord, OverlapMismatchError, OverlapTimeoutError, describe_error,
                     describe_mismatch)
from .peer_memory import PeerMemory
from .stream_ops import StreamOps

L_MAX = MAX_SPLITS  # readiness words: one per split

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
        # the protocol state (the barrier's epoch, generation, pending round;
        # `flags.STATE_WORDS`), on the device: GatherRS reads and advances it, so replays
        # of captured calls go on counting and recover as eager ones do
        self.epoch = torch.zeros(grs.STATE_WORDS, dtype=torch.int32, device=device)
        self.arrived = False  # this op call has reached the barrier here (`begin_call`)
        self.launch_streams = None  # GatherRS's stream and events (`launcher`, on first use)
        self.captured = False  # some launch of it went into a CUDA graph
        self.broken: str | None = None
        self.broken_type: type = OverlapTimeoutError  # what a refused call raises
        # where GatherRS records a mismatch: both descriptors and the peer (RECORD_WORDS)
        self.record = torch.zeros(grs.RECORD_WORDS, dtype=torch.int32, device=device)
        self.wait_bounds: tuple | None = None  # (seconds, polls) of the latest launch's waits
        self._memory: PeerMemory | None = None
        self._layout: tuple | None = None  # (rows per rank Md, hidden, partial dtype)
        self._shape_words = (0, 0, 0)  # the descriptor's (M, N, kind) of the layout
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
    @property
    def peer_bytes(self) -> int:
        """Bytes of peer memory this buffer holds on this rank (0 before its first call)."""
        return 0 if self._memory is None else self._memory.local.numel()

    def ensure(self, rows: int, hidden: int, dtype: torch.dtype, captured: bool = False,
               call_tag: int = 0) -> None:
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
        # (this call's descriptor, agreed on in its barrier: `call_tag` in the kind word)
        self._shape_words = (rows * self.world, hidden, dtype_code(dtype) | call_tag << 16)
        if layout == self._layout:
            return
        need = -(-self.world * rows * hidden * (torch.finfo(dtype).bits // 8) // 128) * 128
        if self._memory is None or need > self._slots_at[1]:
            if captured:  # (it would synchronize, or allocate collectively)
                raise RuntimeError("gemm2_gather_rs cannot be captured in a CUDA graph here: "
                                   "its receive slots must grow to this call's rows or hidden "
                                   "size; make one eager call of the largest shapes before "
                                   "capturing")
            desc = self._descriptor(rows * self.world, hidden, dtype, call_tag=call_tag)
            if self._memory is not None:
                self._agree(desc)
            self._allocate(need, desc)
        self._layout = layout
        self._recv_views = [self.recv(parity) for parity in (0, 1)]

    @staticmethod
    def _descriptor(tokens: int, hidden: int, dtype: torch.dtype, kind: int = 0,
                    call_tag: int = 0) -> tuple:
        """(M, N, kind): what this rank launches (as GatherRS's, beside its epoch and
        generation); `kind`: a KIND_* flag; the caller's call tag in bits 16-30."""
        return (tokens, hidden, dtype_code(dtype) | kind << 8 | call_tag << 16)

    def _agree(self, desc: tuple) -> None:
        """The barrier and agreement of this call alone (before a host collective):
        raises (OverlapMismatchError, OverlapTimeoutError, OverlapPeerError) unless every
        peer launched the same call. A peer that did not raises from its own barrier."""
        self.take_stale(sync=True)  # (an earlier call's error: raised after this call)
        self._launch_agreement(desc)
        self.check(sync=True)

    def _launch_agreement(self, desc: tuple) -> None:
        seconds, polls = self.wait_bounds or (grs.WAIT_TIMEOUT_S, (1 << 31) - 1)
        self.wait_bounds = (seconds, polls)
        self.arrived = True
        grs.launch_agreement(self._signal_ptrs, self.epoch, self.error, self.record,
                             rank=self.rank, world=self.world, tokens=desc[0],
                             hidden=desc[1], kind=desc[2], max_spins=polls,
                             wait_timeout_s=seconds)
        self._pending = (None, self.error.clone(), None)  # (a synchronizing copy)

    def agree_reference(self, tokens: int, hidden: int, dtype: torch.dtype,
                        call_tag: int = 0) -> None:
        """Before the reference path's reduce-scatter on this group: every peer must run
        the reference path for the same M and N (a peer on peer memory would never join
        the collective); raises otherwise, as its peers do."""
        if self._memory is not None:
            self._agree(self._descriptor(tokens, hidden, dtype, grs.KIND_REFERENCE, call_tag))

    def begin_call(self) -> None:
        """An op call starts: the buffer has not arrived at its barrier for it yet."""
        self.arrived = False

    def announce_raise(self, err: BaseException) -> None:
        """This rank's op call raises before it launched: arrive at the barrier with a
        failed call, so that every peer raises for it at once (its own wait bounds)
        rather than after waiting out the bound."""
        if self.arrived or self._memory is None:
            return
        self._launch_agreement((0, 0, grs.KIND_FAILED << 8))
        code = int(self.error[0])  # (peers raise a mismatch for this call: expected)
        self._pending = None
        self.clear_flags()
        self.record.zero_()
        if code >> 24 in (grs.ERR_BARRIER_TIMEOUT, grs.ERR_PEER_FAULT,
                          grs.ERR_RECOVERY) or code & (grs.RECOVERED | grs.PENDING):
            err.add_note("at its barrier: " + describe_error(code, self.rank, None,
                                                             self.wait_bounds))

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
                    raise OverlapMismatchError(describe_mismatch(
                        self.rank, (0, 0) + desc, src, other and (0, 0) + other, host=True))
        half = max(max(n, h) for _, n, h in every)
        signal_bytes = -(-4 * grs.signal_words(self.world) // 128) * 128
        # (the old memory is freed after the new one's allocation, whose barrier waits
        # until every rank's device is done with it)
        self._memory = PeerMemory.allocate(signal_bytes + 2 * half, self.device, self.group,
                                           self.rank, self.world)
        self._signal_ptrs = torch.tensor(self._memory.peer_ptrs, dtype=torch.int64,
                                         device=self.device)
        self.epoch.zero_()  # fresh barrier words are zero on every rank (generation 0)
        self._slots_at = (signal_bytes, half)
        self._ptr_table = torch.tensor(
            [p + signal_bytes + parity * half for parity in (0, 1) for p in self._memory.peer_ptrs],
            dtype=torch.int64, device=self.device)
        self._layout = None

    def mismatch(self, code: int) -> None:
        """Raise the mismatch the barrier recorded (`code`: the error word, ERR_MISMATCH
        with its recovery flags; `check`), naming both descriptors."""
        record = self.record.tolist()
        self.record.zero_()
        words = grs.DESC_WORDS
        raise OverlapMismatchError(describe_mismatch(
            self.rank, tuple(record[:words]), record[2 * words], tuple(record[words:2 * words]),
            flags=code & (grs.RECOVERED | grs.PENDING)))

    def recv(self, parity: int) -> torch.Tensor:
        cap, hidden, dtype = self._layout
        start, half = self._slots_at
        raw = self._memory.local[start + parity * half:start + parity * half
                                 + self.world * cap * hidden * torch.finfo(dtype).bits // 8]
        return raw.view(dtype).view(self.world, cap, hidden)

    def reset(self) -> None:
        """Forget a failed state; collective: rebuilds peer memory on every rank (the
        largest any rank had) and restarts the group's epochs and generations. Needed
        only after a launch failed mid-call or a GEMM2 producer never published (the
        barrier recovers the group from faults between ranks by itself)."""
        self.broken, self.broken_type = None, OverlapTimeoutError
        self._pending = None
        self.clear_flags()
        self.record.zero_()
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
        self.arrived = True
        return CommTarget(self._ptr_table, self._signal_ptrs, self._layout[0] * out.shape[1],
                          out.shape[1], self._recv_views[0],
                          dict(record=self.record, kind=self._shape_words[2]))

    def sum_partials(self, out: torch.Tensor) -> None:
        """`out` = the sum over ranks of the partials in this call's parity slots (its
        epoch, stored by GatherRS); nothing with no peers (GatherRS wrote `out`)."""
        if self.world > 1:
            recv = self._recv_views[0]
            sum_partials.launch_sum_partials(recv, out, self.world, epoch=self.epoch,
                                    parity_stride=self._slots_at[1] // recv.element_size())
