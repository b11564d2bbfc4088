"""Small routed problems for operator tests: random data, stated seeds."""

from __future__ import annotations

import torch


def routed_problem(rank: int, world: int, *, tokens: int, experts: int, topk: int, ffn: int,
                   hidden: int, ep: int = 1, dtype=torch.bfloat16, hot: bool = False,
                   empty: tuple = (), seed: int = 0, device="cpu"):
    """Rows of this rank's local experts, sorted by expert then token, as Megatron does.

    EP ranks own experts [ep_rank*E/ep, ...); with ep == 1 every rank has all experts
    (TP: each rank holds a K-shard). `hot` sends every token to expert 0 first;
    `empty` lists global experts no token picks.
    """
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    if hot:
        scores[:, 0] += 10.0
    for e in empty:
        scores[:, e] = -1.0
    topk_idx = scores.topk(topk, dim=1).indices  # [M, k]
    local_e = experts // ep
    ep_rank = rank % ep
    mine = (topk_idx // local_e) == ep_rank
    flat_e = (topk_idx % local_e)[mine]
    flat_t = torch.arange(tokens)[:, None].expand(tokens, topk)[mine]
    order = torch.argsort(flat_e * tokens + flat_t)
    token_index = flat_t[order]
    counts = torch.bincount(flat_e, minlength=local_e)
    gr = torch.Generator().manual_seed(seed * 1000 + rank + 1)
    x = torch.randn(token_index.numel(), ffn, generator=gr).to(dtype)
    w = (torch.randn(local_e, hidden, ffn, generator=gr) / ffn ** 0.5).to(dtype)
    probs = torch.rand(token_index.numel(), generator=gr)
    return dict(x=x.to(device), weight=w.to(device), counts=counts,
                token_index=token_index.to(device), probs=probs.to(device))


def fp64_rank_partial(p, num_tokens: int, with_probs: bool = False) -> torch.Tensor:
    """This rank's [M, N] contribution in float64."""
    x, w, counts = p["x"].double().cpu(), p["weight"].double().cpu(), p["counts"].tolist()
    ys, start = [], 0
    for e, n in enumerate(counts):
        ys.append(x[start:start + n] @ w[e].t())
        start += n
    y = torch.cat(ys)
    if with_probs:
        y = y * p["probs"].double().cpu()[:, None]
    full = torch.zeros(num_tokens, w.shape[1], dtype=torch.float64)
    return full.index_add_(0, p["token_index"].cpu(), y)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double().cpu() - ref).norm() / ref.norm())
