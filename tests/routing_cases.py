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


def block_graded(t: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
    """t [R, C] times a power of two (2^-6 .. 2^6) per `rows` x 128 block, so that an FP8
    scale read from the wrong block is far off."""
    g = torch.Generator().manual_seed(seed)
    shape = (-(-t.shape[0] // rows), -(-t.shape[1] // 128))
    mag = (2.0 ** torch.randint(-6, 7, shape, generator=g).float()).to(t.device)
    return t * mag.repeat_interleave(rows, 0).repeat_interleave(128, 1)[:t.shape[0], :t.shape[1]]


def fp8_routed_problem(kind: str, per_expert_x: bool = False, rank: int = 0, world: int = 1,
                       **problem):
    """`routed_problem` (fp32, then graded: `block_graded`) quantized as the FP8 recipe of
    `kind` quantizes it: "block" x in 1x128 and each W_e in 128x128 blocks; "tensor" each
    W_e per tensor and x whole or, with `per_expert_x`, split by expert as TE's
    GroupedLinear does. x_hp: x before quantization; scales: a `gemm2_fp8.Fp8Scales`;
    `rank` of `world`: that rank's rows and experts (`routed_problem`)."""
    from megatron_overlap.kernels import fp8_quant as q
    from megatron_overlap.kernels.gemm2_fp8 import Fp8Scales

    p = routed_problem(rank, world, dtype=torch.float32, **problem)
    x = block_graded(p["x"], 1, 1)
    w = [block_graded(we, 128, 2 + e) for e, we in enumerate(p["weight"])]
    if kind == "block":
        xq, sx = q.quantize_blockwise(x, 1)
        wq = [q.quantize_blockwise(we, 128) for we in w]
    else:
        counts = p["counts"].tolist()
        xq, sx = (q.quantize_tensorwise_splits(x, counts) if per_expert_x
                  else q.quantize_tensorwise(x))
        wq = [q.quantize_tensorwise(we) for we in w]
    scales = Fp8Scales(kind, sx, torch.stack([s for _, s in wq]))
    p.update(x=xq, weight=torch.stack([d for d, _ in wq]), scales=scales, x_hp=x)
    return p


def fp8_reference(p) -> tuple[torch.Tensor, torch.Tensor]:
    """(ref, mag) of an `fp8_routed_problem`, float64 on its device: the product of the
    dequantized operands, and the same of their absolute values (|x| |W|^T, what bounds
    the accumulation error)."""
    from megatron_overlap.kernels.gemm2_fp8 import Fp8Scales, grouped_gemm2_fp8_reference

    s, counts = p["scales"], p["counts"].tolist()
    ref = grouped_gemm2_fp8_reference(p["x"], p["weight"], counts, s)
    absolute = Fp8Scales(s.kind, s.x_scale_inv.abs(), s.w_scale_inv.abs())
    mag = grouped_gemm2_fp8_reference(p["x"].float().abs().to(torch.float8_e4m3fn),
                                      p["weight"].float().abs().to(torch.float8_e4m3fn),
                                      counts, absolute)
    return ref, mag
