"""The operator's errors: what a kernel recorded in the error word, as a message.

Kernels cannot raise: a bounded wait that runs out, or input that breaks the routing
table's contract, stores `kind << 24 | value` into an int32 word, and the host turns it
into one of these at its next check (`OverlapBuffer.check`).
"""

from __future__ import annotations


from ..kernels import gather_rs as grs
from ..kernels.routing_table import ERR_COUNTS, ERR_TOPK, ERR_UNSORTED


class OverlapTimeoutError(RuntimeError):
    """A bounded wait inside GEMM2+GatherRS ran out: a producer or a peer never arrived."""


class OverlapMismatchError(RuntimeError):
    """Ranks of the group launched calls that do not pair (other M, N, partial dtype or
    backend, or a rank whose call failed or raised before launching). Raised on every
    rank, naming what each launched."""


class OverlapPeerError(RuntimeError):
    """Another rank of the group faulted (a wait there ran out, or it gave up on this
    rank's call): this call's output is not computed. Raised on every rank the fault
    reached; the group recovers by itself (the message says when)."""


def _dtype_name(code: int) -> str:
    from .config import PARTIAL_DTYPES

    return str(PARTIAL_DTYPES[code - 1]).replace("torch.", "") if 0 < code <= len(
        PARTIAL_DTYPES) else f"dtype code {code}"


def _launched(rank: int, desc: tuple | None, host: bool) -> str:
    """What one descriptor (epoch, generation, M, N, kind) says rank `rank` launched."""
    if desc is None:
        return f"rank {rank} was resetting its buffer (OverlapBuffer.reset)"
    epoch, gen, m, n, kind = desc
    what, tag = kind >> 8 & 0xFF, kind >> 16
    if what & grs.KIND_FAILED:
        return (f"rank {rank}'s call failed before its barrier or raised before it launched "
                f"(its own error says why)")
    at = "" if host else f" (epoch {epoch}, generation {gen})"
    path = " on the reference backend" if what & grs.KIND_REFERENCE else ""
    return f"rank {rank} launched a call{at}{path} with M={m}, N={n}, partials " \
           f"{_dtype_name(kind & 0xFF)}, call_tag={tag}"


def describe_mismatch(rank: int, mine: tuple, src: int, other: tuple | None,
                      host: bool = False, flags: int = 0) -> str:
    """The message of descriptors (epoch, generation, M, N, kind) of this rank and of
    rank `src` that differ; `host`: found by the first allocation's all-gather (no
    epochs yet); `flags`: the barrier's recovery flags, where the ranks' epochs or
    generations differed (a fault)."""
    head = (f"gemm2_gather_rs: the ranks of the group launched calls that do not pair: "
            f"{_launched(rank, mine, host)}; {_launched(src, other, host)}")
    if flags:
        return head + recovery_note(flags)
    return (head + ". Every rank of the group raises this for the call; its output is "
            "not computed. The next call the ranks make alike runs")


def recovery_note(flags: int) -> str:
    """What the group does after a fault, from the barrier's flags (`flags.py`)."""
    if flags & grs.RECOVERED:
        return (". The group recovered in this call (every rank raised for it or for its "
                "previous call): the next call runs on every rank, no reset needed")
    if flags & grs.PENDING:
        return (". Not every rank joined the recovery within the bound yet: each rank's next "
                "call finishes it and raises; the call after runs (no reset needed)")
    return ""


def _waited(bounds) -> str:
    """How long a timed-out wait waited: the bound that ran out (time or polls)."""
    if bounds is None:
        return ""
    seconds, polls = bounds
    return f" after waiting {seconds:g} s (OverlapConfig.wait_timeout_s) or {polls} polls"


def describe_error(code: int, rank: int, expected: int | None = None,
                   bounds: tuple | None = None) -> str:
    kind, value = code >> 24, code & 0xFFFFFF
    if kind == grs.ERR_READY_TIMEOUT:
        more = f" (expected {expected} GEMM2 tiles)" if expected is not None else ""
        return (f"GatherRS on rank {rank} timed out waiting for split {value} to become "
                f"ready{more}{_waited(bounds)}: a GEMM2 producer never published it")
    if kind == ERR_UNSORTED:
        return (f"token_index on rank {rank} is not in Megatron-Core's permutation order "
                f"(rows grouped by local expert, tokens strictly ascending inside each, all "
                f"in [0, num_tokens)); that call's output is wrong")
    if kind == ERR_TOPK:
        return (f"a token on rank {rank} has more rows than topk; that call's output is "
                f"wrong (each token has at most one row per expert and topk in all)")
    if kind == ERR_COUNTS:
        return (f"tokens_per_expert on rank {rank} (on the device) does not sum to x's rows "
                f"(with expected_rows: sums past them) or has a negative entry; that call's "
                f"output is wrong (a router that "
                f"gives some token fewer than top-k experts needs the host counts: "
                f"the layer's LayerPolicy(host_counts=True), --moe-overlap-host-counts)")
    src, flags = value & 0xFFFF, value & ~0xFFFF
    if kind == grs.ERR_MISMATCH:
        return f"GatherRS on rank {rank}: rank {src} launched another call (see the record)"
    if kind == grs.ERR_BARRIER_TIMEOUT:
        return (f"GatherRS on rank {rank} timed out at the cross-rank barrier waiting for "
                f"rank {src}{_waited(bounds)}; its output is not computed"
                + recovery_note(flags))
    if kind == grs.ERR_PEER_FAULT:
        return (f"gemm2_gather_rs on rank {rank}: rank {src} faulted (a wait there ran out, "
                f"or it gave up waiting for this rank's call); this call's output is not "
                f"computed" + recovery_note(flags))
    if kind == grs.ERR_RECOVERY:
        return (f"gemm2_gather_rs on rank {rank}: this call only finished the group's "
                f"recovery from an earlier fault; its output is not computed"
                + recovery_note(flags))
    return f"GatherRS on rank {rank} reported unknown error code {code:#x}"


class ErrorWord:
    """`OverlapBuffer`'s error word on its way to the host: each launch queues its copy
    into pinned memory behind it and `check` reads it once it has arrived (the buffer
    holds `error`, `ready`, `done`, `broken`, `broken_type`, `_pending`, the
    pinned word and its event, `deferred`, and raises a recorded mismatch with
    `mismatch`)."""

    deferred: Exception | None = None  # an earlier call's error, raised after this launch

    def clear_flags(self) -> None:
        """The kernels' flags back to zero (a call's last program leaves them so): after
        a time-out, and by `reset`."""
        self.ready.zero_()
        self.done.zero_()
        self.error.zero_()

    def check(self, sync: bool = True) -> None:
        """Raise what an earlier launch recorded (a time-out, a mismatch, a peer's fault,
        bad input found on the device)."""
        if self.broken:
            raise self.broken_type(self.broken + ("" if "reset()" in self.broken else
                                   " (the buffer must be rebuilt: call OverlapBuffer.reset "
                                   "on every rank)"))
        if self._pending is None:
            return
        event, word, expected = self._pending
        if event is not None:
            if not event.query():
                if not sync:
                    return
                event.synchronize()
            code = self._pinned_word.value
        else:
            code = int(word[0])
        self._pending = None
        if code >> 24 in (ERR_UNSORTED, ERR_TOPK, ERR_COUNTS):  # bad input, not a broken buffer
            self.error.zero_()
            raise ValueError(describe_error(code, self.rank))
        if code >> 24 == grs.ERR_MISMATCH:  # (flags reset as after any call that ran)
            self.error.zero_()
            self.mismatch(code)  # raises, naming both ranks' descriptors
        if code >> 24 in (grs.ERR_BARRIER_TIMEOUT, grs.ERR_PEER_FAULT, grs.ERR_RECOVERY):
            # (the barrier recovers the group by itself: `kernels/flags.py`)
            self.clear_flags()
            raise (OverlapTimeoutError if code >> 24 == grs.ERR_BARRIER_TIMEOUT else
                   OverlapPeerError)(describe_error(code, self.rank, expected, self.wait_bounds))
        if code:
            self.broken = describe_error(code, self.rank, expected, self.wait_bounds)
            self.clear_flags()
            raise OverlapTimeoutError(self.broken)

    def take_stale(self, sync: bool) -> None:
        """An earlier launch's error, if it has reached the host (`sync`: wait for it),
        kept in `deferred` rather than raised: the call goes on, pairing with its peers'
        launches, and raises it after launching (`raise_deferred`). A broken buffer
        raises at once (it refuses the call)."""
        if self.broken:
            self.check()
        try:
            self.check(sync=sync)
        except (ValueError, RuntimeError) as err:
            self.deferred = self.deferred or err

    def raise_deferred(self) -> None:
        err, self.deferred = self.deferred, None
        if err is not None:
            raise err

    def note_launch(self, expected: int | None, sync: bool, captured: bool = False) -> None:
        """Queue the error word's copy to the host behind this call, for `check`
        (`captured`: the call went into a CUDA graph, where nothing is queued for the
        host; `note_replay` queues it behind a replay)."""
        if captured:
            self.captured = True
            return
        if self.device.type == "cuda":
            self.stream_ops.copy_to_host(self._pinned, self.error)
            # one event, re-recorded: only the latest launch is pending (the error word
            # is sticky, so it also carries any earlier launch's error)
            self.stream_ops.record(self._event)
            self._pending = (self._event, self._pinned, expected)
        else:
            self._pending = (None, self.error.clone(), expected)
        if sync or self.device.type != "cuda":
            self.check(sync=True)

    def note_replay(self) -> None:
        """After replaying a CUDA graph that holds calls on this buffer: raise what an
        earlier replay's kernels recorded and has reached the host (as the op's next call
        would), then queue the error word's copy behind this replay, for the next check
        (nothing where no call went into a graph)."""
        if self.captured:
            self.check(sync=False)
            self.note_launch(None, sync=False)
