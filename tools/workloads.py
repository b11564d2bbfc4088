"""Per-rank GEMM2+GatherRS inputs for a model x layout x S x routing (benchmarks)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatron_overlap.routing import expert_counts, route, skew_ratio
from megatron_overlap.shapes import BATCH, LAYOUTS, MODELS, MoEShape

#: A shape small enough for the Triton interpreter: `--smoke` runs of the tools on CPU.
SHAPES = dict(MODELS, tiny=MoEShape("tiny", 64, 32, 8, 2, 2))
#: (TP, EP) of each layout: the model's, and TP1EP1 (every expert on one GPU: no
#: reduce-scatter, the combine alone beside GEMM2)
LAYOUT_SIZES = dict(LAYOUTS, TP1EP1=(1, 1))


@dataclass(frozen=True)
class OpCase:
    model: str  # key of shapes.MODELS
    layout: str  # key of LAYOUT_SIZES
    seq: int
    routing: str  # uniform | p50 | p90
    batch: int = BATCH

    @property
    def tokens(self) -> int:  # M: the group's tokens before top-k (the paper's B*S)
        return self.batch * self.seq

    def label(self) -> str:
        return f"{self.model}/{self.layout}/S={self.seq}/{self.routing}"


def add_case_args(ap, model: str, layout: str, seqs: str, routing: str) -> None:
    """The workload flags the op tools share, with each tool's defaults: --model, --seqs
    and --routing comma lists, one --layout (`cases` expands them)."""
    ap.add_argument("--model", default=model)
    ap.add_argument("--layout", default=layout)
    ap.add_argument("--seqs", default=seqs)
    ap.add_argument("--routing", default=routing)


def cases(args) -> list[OpCase]:
    """Every model x S x routing of `add_case_args`' flags, at the one layout."""
    return [OpCase(m, args.layout, int(s), r) for m in args.model.split(",")
            for s in args.seqs.split(",") for r in args.routing.split(",")]


def rank_inputs(case: OpCase, rank: int, device, dtype=torch.bfloat16, seed: int = 0) -> dict:
    """x [T, K], weight [E_local, N, K], counts, token_index for one rank of the group.

    Ranks are ordered TP fastest inside the TP x EP group; EP rank e owns experts
    [e*E/EP, (e+1)*E/EP), every TP rank holds a K/TP shard of them.
    """
    shape = SHAPES[case.model]
    tp, ep = LAYOUT_SIZES[case.layout]
    ep_rank = rank // tp
    k_rank = shape.ffn_per_rank(tp)
    e_local = shape.local_experts(ep)
    topk_idx = route(case.tokens, shape.experts, shape.topk, case.routing, seed)  # [M, k]
    skew = skew_ratio(expert_counts(topk_idx, shape.experts), case.tokens, shape.topk)
    mine = (topk_idx // e_local) == ep_rank
    flat_e = (topk_idx % e_local)[mine]
    flat_t = torch.arange(case.tokens)[:, None].expand_as(topk_idx)[mine]
    order = torch.argsort(flat_e * case.tokens + flat_t)
    token_index = flat_t[order]
    counts = torch.bincount(flat_e, minlength=e_local)
    g = torch.Generator(device=device).manual_seed(seed * 7919 + rank + 1)
    x = torch.randn(token_index.numel(), k_rank, generator=g, device=device, dtype=torch.float32)
    w = torch.randn(e_local, shape.hidden, k_rank, generator=g, device=device,
                    dtype=torch.float32) / k_rank ** 0.5
    return dict(x=x.to(dtype), weight=w.to(dtype), counts=counts,
                counts_list=counts.tolist(), token_index=token_index.to(device),
                tokens=case.tokens, topk=shape.topk, hidden=shape.hidden, ffn=k_rank,
                world=tp * ep, skew=skew)


def on_every_sm(launch):
    """A prepared launch's plan (`op.prepare`) with GEMM2 on the whole GPU: every SM's
    o_comp slots (GEMM2 alone, without GatherRS beside it)."""
    cache = launch.launch_plan.cache
    slots = cache.kernel.o_comp * cache.device.available_sms
    return dataclasses.replace(launch.launch_plan,
                               plan=launch.plan._replace(compute_slots=slots))


def op_kwargs(inp: dict, group) -> dict:
    """Keyword arguments of `gemm2_gather_rs` / `prepare` for `rank_inputs` output."""
    return dict(x=inp["x"], weight=inp["weight"], tokens_per_expert=inp["counts_list"],
                token_index=inp["token_index"], num_tokens=inp["tokens"], topk=inp["topk"],
                probs=None, group=group)
