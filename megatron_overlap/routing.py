"""Synthetic top-k routing with a stated generator and seed, for demos and benchmarks.

Expert popularity follows a Zipf law over a seeded permutation of the experts,
w_e ~ (rank_e + 1) ** -alpha; each token draws its top-k distinct experts by Gumbel-top-k
on log w_e. alpha is found by bisection so that the expected skew
R = max_e L_e / (M k / E) (the paper's R_expert) hits the named target. Without real
router traces the p50 / p90 targets are assumptions, stated in SKEW_TARGETS; a trace
file (a [M, k] integer tensor saved with torch.save) can replace the generator.
"""

from __future__ import annotations

import functools

import torch

#: Target R = max_e load / mean load for the named workloads (synthetic stand-ins for the
#: paper's LMSYS-Chat-1M p50 / p90 traces, which are not public in count form).
SKEW_TARGETS = {"uniform": 1.0, "p50": 1.5, "p90": 2.5}


def _zipf_logits(experts: int, alpha: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rank = torch.randperm(experts, generator=gen).double()
    return -alpha * torch.log1p(rank)


def _draw(tokens: int, experts: int, topk: int, alpha: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    u = torch.rand(tokens, experts, generator=gen, dtype=torch.float64).clamp_(1e-12, 1.0)
    gumbel = -torch.log(-torch.log(u))
    return (_zipf_logits(experts, alpha, seed) + gumbel).topk(topk, dim=1).indices


def skew_ratio(counts: torch.Tensor, tokens: int, topk: int) -> float:
    """R_expert = max_e L_e / (M k / E)."""
    return float(counts.max()) / (tokens * topk / counts.numel())


@functools.lru_cache(maxsize=256)
def alpha_for_skew(experts: int, topk: int, target: float, seed: int = 0) -> float:
    """The Zipf exponent whose draws have skew ~target (bisection on 8192 tokens)."""
    if target <= 1.0:
        return 0.0
    if target > experts / topk:
        raise ValueError(f"skew {target} is above the maximum E/k = {experts / topk:.2f}")
    lo, hi = 0.0, 8.0
    for _ in range(30):
        mid = (lo + hi) / 2
        counts = torch.bincount(_draw(8192, experts, topk, mid, seed).flatten(), minlength=experts)
        if skew_ratio(counts, 8192, topk) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def route(tokens: int, experts: int, topk: int, skew: str | float = "uniform",
          seed: int = 0) -> torch.Tensor:
    """Top-k expert indices, [tokens, topk] int64, drawn with the named skew."""
    target = SKEW_TARGETS[skew] if isinstance(skew, str) else float(skew)
    return _draw(tokens, experts, topk, alpha_for_skew(experts, topk, target, seed), seed)


def expert_counts(topk_idx: torch.Tensor, experts: int) -> torch.Tensor:
    """Assignments per expert, [experts] int64."""
    return torch.bincount(topk_idx.flatten(), minlength=experts)
