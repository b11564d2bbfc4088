"""The flag words of the operator's cross-rank protocol: bounded waits on the GPU's global
timer, the barrier that ends every call, the agreement on what each rank launched, and
the recovery after a fault. GatherRS's readiness flags (GEMM2 -> GatherRS on one rank)
are in `gather_rs.py`'s docstring; this is the cross-rank part, in full.

Words. Each rank's signal area (int32, in peer memory; D = world) holds, per source
rank s: `arrive[s]`, the epoch s last arrived with (or minus an epoch this rank gave
up on); `desc[2][s]`, s's descriptor per epoch parity (epoch, generation, M, N, kind:
the partial dtype's code | KIND_FAILED or KIND_REFERENCE << 8 | the call tag << 16); `rec[s]`, the last
recovery round s entered; `recep[2][s]`, the epoch s published with its round (per
round parity). Each rank's local state (`OverlapBuffer.epoch`, STATE_WORDS): the last
call's epoch, the generation g (rounds completed) and a pending round (0: none). Only
rank s writes the words indexed [s] in the others' areas, except that the area's owner
may turn its own `arrive[s]` into a give-up mark.

A call (GatherRS's last program, or `agreement_kernel` where a call has no data) of
epoch e = the last epoch + 1 in generation g:
 1. arrive: for every peer p, store the descriptor into p's `desc[e % 2][me]`
    (relaxed), then exchange p's `arrive[me]` with e (release, sys). The exchange
    returns what was there: -e means p already gave up on this call (a fault).
 2. wait, for every source s: until `arrive[s]` >= e (acquire, sys), or `rec[s]` > g (s
    faulted: it will not arrive), or the bound (`wait_timeout_s`, polls). On the bound
    the waiter exchanges its `arrive[s]` with -e: if the old value was >= e the arrival
    landed first and counts (it is restored with atomic max); else s, arriving later,
    reads -e in step 1 and faults. One word decides both ranks' view of that arrival,
    so a call one rank gave up on is never completed by its peer (two ranks).
 3. agree: compare `desc[e % 2][s]` with this rank's. M, N, or kind differ: every rank
    raises OverlapMismatchError for the call (each differs from at least one peer), the
    group stays paired. The epoch or generation differ, a peer faulted, a wait ran out,
    or any `rec[s]` > g: a fault, step 4.
 4. recover, round r = g + 1: publish this call's epoch into every `recep[r % 2][me]`,
    then r into every `rec[me]` (release); wait for every `rec[s]` >= r. When all have:
    every rank read the same D epochs, so all set g = r and the epoch to their maximum
    + 2, past every word any rank wrote (the next call pairs, on fresh parities). When
    the bound runs out first: the round stays pending; the rank's next call arrives
    nowhere and only waits for the round again (nothing republished).
A call that faulted, or only finished a pending round, raises on its rank (ERR_* with
the RECOVERED or PENDING flag: `ops/errors.py`); its output is not computed. A call
that raised on the host before launching arrives with KIND_FAILED through
`agreement_kernel`: peers raise for that call too, no round. (An earlier call's error
that reaches the host at a call's start is raised after that call has launched, so
that its peers pair with it: raising it before would make them raise for this call,
one call late on CUDA, and so on back and forth.) So after any fault every rank raises for the call it happened in or for its
next call, and the call after pairs: recovery needs no host call and no collective, and
CUDA-graph replays go on counting (every word above is on the device). Calls pair in
order, and a late call and a skipped one look alike: a rank whose peer skipped a call
detects it where the skipped call's wait ran out before the skipping rank's next call
arrived, where their shapes differ, or where the caller tags its calls (`call_tag`, in
bits 16-30 of the kind word; OverlapMoELayer tags each call with its layer and count):
then the skipping rank's next call and its peers' skipped one differ in kind, and every
rank raises instead of completing a mix of two calls.

Scopes: descriptors relaxed, each arrival and round a release of the same thread,
read with acquire: what a rank stored before its arrival (its partial sums) is visible
to the peer that acquired it. Epochs grow by one per call and jump at a recovery, so
the words are never reset, except by `OverlapBuffer.reset` (new, zeroed memory).
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

ERR_READY_TIMEOUT = 1
ERR_BARRIER_TIMEOUT = 2
ERR_MISMATCH = 6  # (3-5: the routing table's, routing_table.ERR_*)
ERR_PEER_FAULT = 7
ERR_RECOVERY = 8
#: flags beside an error's source rank: the group recovered in that call (the next call
#: pairs), or entered a recovery not every rank has joined yet (the next call finishes it)
RECOVERED, PENDING = 1 << 20, 1 << 21

#: a launch's descriptor, as published to the peers: epoch, generation, M, N, kind
DESC_WORDS = 5
#: int32 words of a mismatch record: this rank's descriptor, the peer's, the peer
RECORD_WORDS = 2 * DESC_WORDS + 1
#: the descriptor's kind: the partial dtype's code | one of these << 8
KIND_FAILED, KIND_REFERENCE = 1, 2
#: int32 words of a rank's protocol state (`OverlapBuffer.epoch`): the last call's epoch,
#: the generation (recovery rounds completed), the round entered and not completed (0: none)
STATE_WORDS = 4


def signal_words(world: int) -> int:
    """int32 words of a rank's signal area: `world` arrivals, the descriptors
    [2 parities][world sources][DESC_WORDS], `world` recovery rounds, and the epochs
    published with them [2 round parities][world]."""
    return world * (1 + 2 * DESC_WORDS + 3)


#: the default bound of a wait, in seconds (OverlapConfig.wait_timeout_s)
WAIT_TIMEOUT_S = 60.0


@triton.jit
def now_ns():
    """The GPU's global timer, in ns."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


if not isinstance(now_ns, JITFunction):  # the interpreter runs no PTX: the host's clock
    def now_ns():
        return tl.full((), time.monotonic_ns(), tl.int64)


@triton.jit
def wait_at_least(ptr, target, max_spins, timeout_ns, SCOPE: tl.constexpr):
    """Poll `*ptr` until it reaches `target`, `timeout_ns` ns pass or `max_spins` polls
    do; 1 if it reached it. (Bounded by time: a poll's cost differs between the GPU and
    the interpreter by orders of magnitude.)

    Polls are plain volatile loads, so dozens of waiting CTAs do not queue atomics on
    the L2 line the producers increment; one acquire read after success orders
    everything the producers released before it. (Sleeping between polls, nanosleep,
    measured no faster on H200: 400 ns sleeps with the partition placement; 200 ns with
    the shared one, in a prefill at the power limit, where they saved no power.)
    """
    start = now_ns()
    seen = tl.load(ptr, volatile=True)
    spins = 0
    while (seen < target) & (spins < max_spins) & (now_ns() - start < timeout_ns):
        seen = tl.load(ptr, volatile=True)
        spins += 1
    seen = tl.atomic_add(ptr, 0, sem="acquire", scope=SCOPE)
    return (seen >= target).to(tl.int32)


@triton.jit
def _area(signal_ptrs, peer, like):
    """Rank `peer`'s signal area as an int32 pointer (`like`: any int32 pointer)."""
    return tl.load(signal_ptrs + peer).to(like.dtype)


@triton.jit
def _wait_arrival(arrive, rec, epoch, gen, max_spins, timeout_ns):
    """Poll a source's arrival word until it reaches `epoch` (1), its recovery word passes
    `gen` (2: it faulted and will not arrive for this call) or the bound runs out (0)."""
    start = now_ns()
    seen = tl.load(arrive, volatile=True)
    joined = tl.load(rec, volatile=True)
    spins = 0
    while (seen < epoch) & (joined <= gen) & (spins < max_spins) & (now_ns() - start < timeout_ns):
        seen = tl.load(arrive, volatile=True)
        joined = tl.load(rec, volatile=True)
        spins += 1
    seen = tl.atomic_add(arrive, 0, sem="acquire", scope="sys")
    return tl.where(seen >= epoch, 1, tl.where(joined > gen, 2, 0))


@triton.jit
def _fail(error_ptr, record_ptr, code, epoch, gen, tokens, N, kind, desc):
    """Record the call's first error (`code`), with both descriptors where it is a
    mismatch (`desc`: the peer's, whose last word after its 5 is the peer)."""
    if tl.atomic_cas(error_ptr, 0, code) == 0:
        if (code >> 24) == 6:
            tl.store(record_ptr, epoch)
            tl.store(record_ptr + 1, gen)
            tl.store(record_ptr + 2, tokens)
            tl.store(record_ptr + 3, N)
            tl.store(record_ptr + 4, kind)
            for w in range(5):
                tl.store(record_ptr + 5 + w, tl.atomic_add(desc + w, 0, sem="relaxed",
                                                           scope="sys"))
            tl.store(record_ptr + 10, code & 0xFFFF)


@triton.jit
def _arrive_and_wait(signal_ptrs, error_ptr, record_ptr, epoch, gen, rank, world, tokens, N,
                     kind, max_spins, timeout_ns):
    """Steps 1-3 of the barrier (module docstring); 1 where the call is faulty (the ranks
    must recover), with the first error recorded; 0 where it paired (a shape mismatch
    too: every rank raises for it and the next call pairs)."""
    parity = epoch % 2
    fault = rank * 0
    for peer in range(world):
        sig = _area(signal_ptrs, peer, error_ptr)
        desc = sig + world + (parity * world + rank) * 5
        # (relaxed: issued by the thread whose release below orders them)
        tl.atomic_xchg(desc, epoch, sem="relaxed", scope="sys")
        tl.atomic_xchg(desc + 1, gen, sem="relaxed", scope="sys")
        tl.atomic_xchg(desc + 2, tokens, sem="relaxed", scope="sys")
        tl.atomic_xchg(desc + 3, N, sem="relaxed", scope="sys")
        tl.atomic_xchg(desc + 4, kind, sem="relaxed", scope="sys")
        if tl.atomic_xchg(sig + rank, epoch, sem="release", scope="sys") == -epoch:
            _fail(error_ptr, record_ptr, (7 << 24) | peer, epoch, gen, tokens, N, kind, desc)
            fault = fault * 0 + 1  # that peer gave up on this call before our arrival
    mine = _area(signal_ptrs, rank, error_ptr)
    for src in range(world):
        got = _wait_arrival(mine + src, mine + 11 * world + src, epoch, gen, max_spins,
                            timeout_ns)
        if got == 0:  # give up, unless the arrival lands first (one word decides)
            old = tl.atomic_xchg(mine + src, -epoch, sem="acq_rel", scope="sys")
            if old >= epoch:
                tl.atomic_max(mine + src, old, sem="relaxed", scope="sys")
                got = got * 0 + 1
        desc = mine + world + (parity * world + src) * 5
        if got == 1:
            e = tl.atomic_add(desc, 0, sem="acquire", scope="sys")
            g = tl.atomic_add(desc + 1, 0, sem="relaxed", scope="sys")
            m = tl.atomic_add(desc + 2, 0, sem="relaxed", scope="sys")
            n = tl.atomic_add(desc + 3, 0, sem="relaxed", scope="sys")
            d = tl.atomic_add(desc + 4, 0, sem="relaxed", scope="sys")
            if (e != epoch) | (g != gen):
                fault = fault * 0 + 1  # another call or generation: every later call would pair wrongly
            if (e != epoch) | (g != gen) | (m != tokens) | (n != N) | (d != kind):
                _fail(error_ptr, record_ptr, (6 << 24) | src, epoch, gen, tokens, N, kind, desc)
        else:
            fault = fault * 0 + 1
            _fail(error_ptr, record_ptr, tl.where(got == 0, 2 << 24, 7 << 24) | src, epoch,
                  gen, tokens, N, kind, desc)
    for src in range(world):  # a fault elsewhere in the group (a peer of a peer)
        if tl.atomic_add(mine + 11 * world + src, 0, sem="relaxed", scope="sys") > gen:
            fault = fault * 0 + 1
            _fail(error_ptr, record_ptr, (7 << 24) | src, epoch, gen, tokens, N, kind, mine)
    return fault


@triton.jit
def _rendezvous(signal_ptrs, state_ptr, error_ptr, epoch, round_no, publish, rank, world,
                max_spins, timeout_ns):
    """Step 4 (module docstring): enter recovery round `round_no` (`publish`: first time,
    with this call's epoch) and wait for every rank to; the epoch the call leaves."""
    at = (round_no % 2) * world + rank
    if publish:
        for peer in range(world):
            sig = _area(signal_ptrs, peer, error_ptr)
            tl.atomic_xchg(sig + 12 * world + at, epoch, sem="relaxed", scope="sys")
            tl.atomic_xchg(sig + 11 * world + rank, round_no, sem="release", scope="sys")
    mine = _area(signal_ptrs, rank, error_ptr)
    joined = rank * 0 + 1
    base = epoch * 0  # (the published epochs alone: every rank reads the same ones)
    for src in range(world):
        if wait_at_least(mine + 11 * world + src, round_no, max_spins, timeout_ns, "sys") == 0:
            joined = joined * 0
        else:
            base = tl.maximum(base, tl.atomic_add(
                mine + 12 * world + (round_no % 2) * world + src, 0, sem="relaxed", scope="sys"))
    tl.atomic_cas(error_ptr, 0, 8 << 24)  # (a call that only recovered raises too)
    if joined == 1:  # every rank restarts from the same epoch, past every word written
        tl.store(state_ptr + 1, round_no)
        tl.store(state_ptr + 2, 0)
        tl.atomic_or(error_ptr, 1 << 20, sem="relaxed", scope="gpu")
        epoch = base + 2
    else:
        tl.store(state_ptr + 2, round_no)
        tl.atomic_or(error_ptr, 1 << 21, sem="relaxed", scope="gpu")
        epoch = epoch - 1 + publish  # (not arrived: the next call reuses the epoch)
    return epoch


@triton.jit
def barrier(signal_ptrs, state_ptr, error_ptr, record_ptr, epoch, rank, world, tokens, N,
            kind, max_spins, timeout_ns):
    """The cross-rank barrier of call `epoch` with the agreement on what was launched and
    the recovery after a fault (module docstring). One program runs it; returns the epoch
    to store as the last call's. (Literals: a kernel reads no module constant; 5 is
    DESC_WORDS, 11 and 12 world multiples the offsets of the recovery words, 2, 6, 7, 8
    the ERR_ kinds.)"""
    gen = tl.load(state_ptr + 1)
    pending = tl.load(state_ptr + 2)
    if pending != 0:  # a round this rank entered and not every peer did: finish it first
        epoch = _rendezvous(signal_ptrs, state_ptr, error_ptr, epoch, pending, 0, rank,
                            world, max_spins, timeout_ns)
    else:
        fault = _arrive_and_wait(signal_ptrs, error_ptr, record_ptr, epoch, gen, rank, world,
                                 tokens, N, kind, max_spins, timeout_ns)
        if fault != 0:
            epoch = _rendezvous(signal_ptrs, state_ptr, error_ptr, epoch, gen + 1, 1, rank,
                                world, max_spins, timeout_ns)
    return epoch


@triton.jit(do_not_specialize=["rank", "world", "tokens", "N", "kind", "max_spins",
                               "timeout_us"])
def agreement_kernel(signal_ptrs, state_ptr, error_ptr, record_ptr, rank, world, tokens, N,
                     kind, max_spins, timeout_us):
    """The barrier of one call without its data (one program): before a collective
    growth of the peer memory, before the reference path's collective, and for a call
    that raised before it launched (`kind` says which; module docstring)."""
    epoch = tl.load(state_ptr) + 1
    epoch = barrier(signal_ptrs, state_ptr, error_ptr, record_ptr, epoch, rank, world, tokens,
                    N, kind, max_spins, timeout_us.to(tl.int64) * 1000)
    tl.store(state_ptr, epoch)


#: the longest wait bound: microseconds in an int32
MAX_WAIT_TIMEOUT_S = ((1 << 31) - 1) / 1e6


def timeout_us(seconds: float) -> int:
    """A wait bound in whole microseconds (at least 1)."""
    if not 0 < seconds <= MAX_WAIT_TIMEOUT_S:
        raise ValueError(f"wait_timeout_s must be in (0, {MAX_WAIT_TIMEOUT_S:g}], got {seconds!r}")
    return max(1, int(seconds * 1e6))


def launch_agreement(signal_ptrs: torch.Tensor, state: torch.Tensor, error: torch.Tensor,
                     record: torch.Tensor, *, rank: int, world: int, tokens: int, hidden: int,
                     kind: int, max_spins: int, wait_timeout_s: float = WAIT_TIMEOUT_S):
    """One `agreement_kernel` program: the barrier of the next epoch with this descriptor
    (M = tokens, N = hidden, `kind`: the partial dtype's code | KIND_* << 8), no data."""
    agreement_kernel[(1,)](signal_ptrs, state, error, record, rank, world, tokens, hidden,
                           kind, max_spins, timeout_us(wait_timeout_s))
