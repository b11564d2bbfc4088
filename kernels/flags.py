"""The flag words of the operator's cross-CTA and cross-rank protocol: bounded waits on
the GPU's global timer, the cross-rank barrier with its agreement on what was launched,
and the error codes the host turns into exceptions. The protocol in full (who writes,
who waits, scopes, reset, CUDA graphs) is in `gather_rs.py`'s docstring; GatherRS runs
the barrier in its last program, `agreement_kernel` alone before a peer-memory growth.
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

#: a launch's descriptor, as published to the peers: epoch, call number, M, N, dtype code
DESC_WORDS = 5
#: int32 words of a mismatch record: this rank's descriptor, the peer's, the peer
RECORD_WORDS = 2 * DESC_WORDS + 1


def signal_words(world: int) -> int:
    """int32 words of a rank's signal area: `world` epochs, then the descriptors
    [2 parities][world sources][DESC_WORDS]."""
    return world * (1 + 2 * DESC_WORDS)


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
def barrier(signal_ptrs, error_ptr, record_ptr, epoch, rank, world, call_no, tokens, N,
             dtype_code, max_spins, timeout_ns):
    """The cross-rank barrier of call `epoch` with the agreement on what was launched
    (module docstring): publish this rank's descriptor and epoch to every peer, wait for
    every peer's epoch, compare its descriptor with ours. One program runs it. (Literals:
    a kernel reads no module constant; 5 is DESC_WORDS, 2 and 6 the ERR_ kinds.)"""
    parity = epoch % 2
    for peer in range(world):
        sig = tl.load(signal_ptrs + peer).to(error_ptr.dtype)
        desc = sig + world + (parity * world + rank) * 5
        # (relaxed atomics: issued by the thread whose release below orders them)
        tl.atomic_xchg(desc, epoch, sem="relaxed", scope="sys")
        tl.atomic_xchg(desc + 1, call_no, sem="relaxed", scope="sys")
        tl.atomic_xchg(desc + 2, tokens, sem="relaxed", scope="sys")
        tl.atomic_xchg(desc + 3, N, sem="relaxed", scope="sys")
        tl.atomic_xchg(desc + 4, dtype_code, sem="relaxed", scope="sys")
        tl.atomic_xchg(sig + rank, epoch, sem="release", scope="sys")
    mine = tl.load(signal_ptrs + rank).to(error_ptr.dtype)
    for src in range(world):
        ok = wait_at_least(mine + src, epoch, max_spins, timeout_ns, "sys")
        if ok == 0:
            tl.atomic_cas(error_ptr, 0, (2 << 24) | src)
        else:
            desc = mine + world + (parity * world + src) * 5
            e = tl.atomic_add(desc, 0, sem="acquire", scope="sys")
            c = tl.atomic_add(desc + 1, 0, sem="relaxed", scope="sys")
            m = tl.atomic_add(desc + 2, 0, sem="relaxed", scope="sys")
            n = tl.atomic_add(desc + 3, 0, sem="relaxed", scope="sys")
            d = tl.atomic_add(desc + 4, 0, sem="relaxed", scope="sys")
            same = (e == epoch) & (c == call_no) & (m == tokens) & (n == N) & (d == dtype_code)
            if not same:
                if tl.atomic_cas(error_ptr, 0, (6 << 24) | src) == 0:
                    # (the first error only: the host reads the record beside its code)
                    tl.store(record_ptr, epoch)
                    tl.store(record_ptr + 1, call_no)
                    tl.store(record_ptr + 2, tokens)
                    tl.store(record_ptr + 3, N)
                    tl.store(record_ptr + 4, dtype_code)
                    tl.store(record_ptr + 5, e)
                    tl.store(record_ptr + 6, c)
                    tl.store(record_ptr + 7, m)
                    tl.store(record_ptr + 8, n)
                    tl.store(record_ptr + 9, d)
                    tl.store(record_ptr + 10, src)


@triton.jit(do_not_specialize=["rank", "world", "call_no", "tokens", "N", "dtype_code",
                               "max_spins", "timeout_us"])
def agreement_kernel(signal_ptrs, epoch_ptr, error_ptr, record_ptr, rank, world, call_no,
                     tokens, N, dtype_code, max_spins, timeout_us):
    """The barrier and agreement of one call without its data (one program): what a rank
    runs before a collective re-allocation of the peer memory, so that it enters the
    host collective only where every peer launched the same call (a peer that did not
    is told by its own GatherRS, which sees this descriptor)."""
    epoch = tl.load(epoch_ptr) + 1
    barrier(signal_ptrs, error_ptr, record_ptr, epoch, rank, world, call_no, tokens, N,
             dtype_code, max_spins, timeout_us.to(tl.int64) * 1000)
    tl.store(epoch_ptr, epoch)


#: the longest wait bound: microseconds in an int32
MAX_WAIT_TIMEOUT_S = ((1 << 31) - 1) / 1e6


def timeout_us(seconds: float) -> int:
    """A wait bound in whole microseconds (at least 1)."""
    if not 0 < seconds <= MAX_WAIT_TIMEOUT_S:
        raise ValueError(f"wait_timeout_s must be in (0, {MAX_WAIT_TIMEOUT_S:g}], got {seconds!r}")
    return max(1, int(seconds * 1e6))


def launch_agreement(signal_ptrs: torch.Tensor, epoch: torch.Tensor, error: torch.Tensor,
                     record: torch.Tensor, *, rank: int, world: int, call_no: int,
                     tokens: int, hidden: int, dtype_code: int, max_spins: int,
                     wait_timeout_s: float = WAIT_TIMEOUT_S):
    """One `agreement_kernel` program: the barrier of the next epoch with this descriptor
    (call_no, M = tokens, N = hidden, dtype_code), no data."""
    agreement_kernel[(1,)](signal_ptrs, epoch, error, record, rank, world, call_no, tokens,
                           hidden, dtype_code, max_spins, timeout_us(wait_timeout_s))
