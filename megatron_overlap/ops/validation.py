"""Input checks and host/device moves of `gemm2_gather_rs`, before any kernel sees the data.

Every check that can fail does so here with a message that names the argument; the
checks that would cost a host sync on CUDA (token range, rows per token, Megatron's
permutation order) run on CPU tensors only, and the routing-table kernel makes them on
the device (`kernels/routing_table.py`), raised at the next call.
"""

from __future__ import annotations

import numbers
import operator

from itertools import accumulate

import torch

from .config import MAX_SPLITS, OverlapConfig

#: dtypes the kernels take for x and the weights
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: the largest top-k: GatherRS unrolls one gather per slot (rounded up to a power of
#: two) and the routing table holds k slots per token, so compile time and memory grow
#: with it; routers pick at most a few dozen experts per token
MAX_TOPK = 256
#: the largest M: token numbers are int32 in the routing table's kernels
MAX_TOKENS = (1 << 31) - 1


def check_int(name: str, value, lo: int | None, hi: int | None = None) -> int:
    """value as a Python int in [lo, hi] (None: unbounded), else a TypeError / ValueError
    naming `name`. Integer-like scalars (numpy's) pass and come back as int, so that no
    cache or kernel argument downstream ever sees another type; bools, floats and
    tensors (a CUDA one would synchronize) do not."""
    if type(value) is not int:  # (a plain int skips the ABC check: ~1 us a call)
        value = _integral(name, value)
    if lo is None:
        return value
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be an int {bound}, got {value}")
    return value


def _integral(name: str, value) -> int:
    """An integer-like scalar as a Python int, else a TypeError naming `name`."""
    if isinstance(value, (bool, torch.Tensor)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return operator.index(value)


def check_options(config, comm_ctas, splits) -> tuple:
    """(config, C, L): the op's keyword options, checked: the config (None = the
    defaults), and an explicit C and L as ints, which override the config's where given
    (0 is an error, not "unset")."""
    if config is None:
        config = OverlapConfig()
    elif not isinstance(config, OverlapConfig):
        raise TypeError(f"config must be an OverlapConfig or None, got {type(config).__name__}")
    if comm_ctas is not None:
        comm_ctas = check_int("comm_ctas", comm_ctas, 1)
    if splits is not None:
        splits = check_int("splits", splits, 1, MAX_SPLITS)
    return config, comm_ctas, splits


def expert_count(x, weight) -> int:
    """E, from weight [E, N, K] (checked first: the counts are checked against it)."""
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2 or weight.dim() != 3:
        raise ValueError(f"x must be [T, K] and weight [E, N, K]; got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    return weight.shape[0]


def host_counts(tokens_per_expert, rows: int, experts: int, device: torch.device):
    """(host list or None, device-ready tensor) of the per-expert row counts (a tensor
    on the CPU or on x's `device`)."""
    if isinstance(tokens_per_expert, torch.Tensor):
        if tokens_per_expert.device.type != "cpu" and tokens_per_expert.device != device:
            raise ValueError(f"tokens_per_expert must be on the CPU or on x's device "
                             f"({device}), got a tensor on {tokens_per_expert.device}")
        if tokens_per_expert.dim() != 1 or tokens_per_expert.numel() != experts:
            raise ValueError(f"tokens_per_expert must have {experts} entries (one per local "
                             f"expert), got shape {tuple(tokens_per_expert.shape)}")
        if tokens_per_expert.dtype.is_floating_point or tokens_per_expert.dtype in (
                torch.bool, torch.complex64, torch.complex128):
            raise ValueError(f"tokens_per_expert must hold integers, got "
                             f"{tokens_per_expert.dtype}")
        if tokens_per_expert.device.type == "cpu":
            return tokens_per_expert.tolist(), tokens_per_expert
        if tokens_per_expert.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"tokens_per_expert on the device must be int32 or int64, got "
                             f"{tokens_per_expert.dtype}")
        # (the kernels read it in place: their sum is checked there, ERR_COUNTS)
        return None, tokens_per_expert.contiguous()
    try:
        counts = list(tokens_per_expert)
    except TypeError:
        raise TypeError(f"tokens_per_expert must be a list or tensor of ints, got "
                        f"{type(tokens_per_expert).__name__}") from None
    # (plain non-negative Python ints, the common case, pass as they are: a check_int per
    # expert costs ~0.6 us each on the launch path, 40 us at E = 60; anything else,
    # numpy ints included, is checked and normalized one by one)
    if not (all(type(c) is int for c in counts) and (not counts or min(counts) >= 0)):
        counts = [check_int(f"tokens_per_expert[{e}]", c, 0) for e, c in enumerate(counts)]
    if len(counts) != experts:
        raise ValueError(f"tokens_per_expert must have {experts} entries (one per local "
                         f"expert), got {len(counts)}")
    return counts, None  # the kernels' path uploads them with the offsets


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without making the host wait for the stream (a
    pageable copy would: it synchronizes with all queued work)."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def validate(x, weight, counts, token_index, num_tokens, topk, probs, world, padded=False,
             fp8=False):
    """Every check that can fail with a clear message before a kernel sees the data
    (`padded`: the counts may sum to fewer than x's rows; the rest are padding). x and
    weight have passed `expert_count`, num_tokens and topk `check_int` (the op's
    `_checked_call`), and with `fp8` their dtypes and scales `fp8.check_call`."""
    for name, t in (("token_index", token_index), ("probs", probs)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not fp8 and (x.dtype not in DTYPES or weight.dtype != x.dtype):
        raise ValueError(f"x and weight must share a dtype in {DTYPES}; got {x.dtype}, "
                         f"{weight.dtype}")
    if weight.shape[2] != x.shape[1]:
        raise ValueError(f"weight [E, N, K] has K={weight.shape[2]} but x has K={x.shape[1]}")
    if x.device != weight.device or token_index.device != x.device:
        raise ValueError("x, weight and token_index must be on one device")
    if token_index.dim() != 1 or token_index.numel() != x.shape[0]:
        raise ValueError(f"token_index must be [T] = [{x.shape[0]}], got {tuple(token_index.shape)}")
    if token_index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_index must be int32 or int64, got {token_index.dtype}")
    if counts is not None:
        if counts and min(counts) < 0:
            raise ValueError(f"tokens_per_expert must be non-negative, got {counts}")
        if sum(counts) != x.shape[0] and not (padded and sum(counts) <= x.shape[0]):
            raise ValueError(f"tokens_per_expert sums to {sum(counts)} but x has {x.shape[0]} "
                             f"rows" + (" (padded: at most)" if padded else ""))
    if num_tokens < 1 or num_tokens % world:
        raise ValueError(f"num_tokens ({num_tokens}) must be a positive multiple of the group "
                         f"size ({world}): each rank owns num_tokens / world rows")
    if probs is not None and (probs.shape != (x.shape[0],) or probs.device != x.device):
        raise ValueError(f"probs must be [T] = [{x.shape[0]}] on x's device, got {tuple(probs.shape)}")
    if probs is not None and probs.dtype not in DTYPES:
        raise ValueError(f"probs must have a dtype in {DTYPES}, got {probs.dtype}")
    if padded and counts is not None:
        token_index = token_index[:sum(counts)]  # (the padding's tokens are anything)
    if x.device.type == "cpu" and token_index.numel():
        # Cheap on the host; on CUDA these would cost a sync, and Megatron's routing
        # guarantees them by construction.
        lo, hi = int(token_index.min()), int(token_index.max())
        if lo < 0 or hi >= num_tokens:
            raise ValueError(f"token_index values must lie in [0, {num_tokens}), got [{lo}, {hi}]")
        most = int(torch.bincount(token_index, minlength=num_tokens).max())
        if most > topk:
            raise ValueError(f"a token has {most} rows but topk is {topk}")
        if counts is not None:  # Megatron's permutation order (on CUDA the kernel checks)
            # tokens ascending inside each expert's rows; a pair across an expert boundary
            # may fall (a larger expert index orders it). Not through repeat_interleave:
            # CPU torch 2.13 takes ~12 ms for it at 1k rows, more than the whole call.
            ascending = token_index[1:] > token_index[:-1]
            ends = [end - 1 for end in accumulate(counts) if 0 < end < token_index.numel()]
            if ends:
                ascending[torch.tensor(ends)] = True
            if not bool(ascending.all()):
                raise ValueError("token_index must list each expert's rows with tokens in "
                                 "strictly ascending order (Megatron-Core's permutation order)")


def aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous with a 16-byte aligned base: what the TMA descriptors need."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def capturing(t: torch.Tensor) -> bool:
    """Whether t's device stream is being captured into a CUDA graph."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def capture_refusal(backend: str, counts) -> str | None:
    """Why a call captured into a CUDA graph would replay wrongly (None: it replays the
    routing of each replay's own tensors). A replay re-runs the recorded kernels with
    their recorded arguments, so nothing the host prepares per call may reach them (the
    barrier's epoch and the receive slots' parity are device words: `gather_rs`)."""
    if backend == "reference":
        return "the reference backend splits the rows by expert on the host"
    if counts is not None:
        return ("the expert counts come from the host (a replay would combine with the "
                "routing of the capture); pass tokens_per_expert as a CUDA tensor")
    return None
