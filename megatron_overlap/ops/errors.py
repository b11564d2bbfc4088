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


def describe_error(code: int, rank: int, expected: int | None = None) -> str:
    kind, value = code >> 24, code & 0xFFFFFF
    if kind == grs.ERR_READY_TIMEOUT:
        more = f" (expected {expected} GEMM2 tiles)" if expected is not None else ""
        return (f"GatherRS on rank {rank} timed out waiting for split {value} to become "
                f"ready{more}: a GEMM2 producer never published it")
    if kind == ERR_UNSORTED:
        return (f"token_index on rank {rank} is not in Megatron-Core's permutation order "
                f"(rows grouped by local expert, tokens strictly ascending inside each, all "
                f"in [0, num_tokens)); that call's output is wrong")
    if kind == ERR_TOPK:
        return (f"a token on rank {rank} has more rows than topk; that call's output is "
                f"wrong (each token has at most one row per expert and topk in all)")
    if kind == ERR_COUNTS:
        return (f"tokens_per_expert on rank {rank} (on the device) does not sum to x's rows "
                f"or has a negative entry; that call's output is wrong (a router that "
                f"gives some token fewer than top-k experts needs the host counts: "
                f"OverlapConfig(host_counts=True))")
    if kind == grs.ERR_BARRIER_TIMEOUT:
        return (f"GatherRS on rank {rank} timed out at the cross-rank barrier waiting for "
                f"rank {value}")
    return f"GatherRS on rank {rank} reported unknown error code {code:#x}"
