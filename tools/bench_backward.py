"""Backward of GEMM2 + combine + reduce-scatter: the op's against the stock-equivalent one.

    torchrun --nproc-per-node 1 tools/bench_backward.py --seqs 1024,4096,16384 --json out/bwd1.json
    torchrun --nproc-per-node 2 tools/bench_backward.py --layout TP2EP1 --json out/bwd2.json
    torchrun --nproc-per-node 2 tools/bench_backward.py --smoke   # CPU check (gloo, tiny shapes)

Policies, baseline first; each is the backward alone (forward graphs built once, outside
the samples; grads cleared inside, as a training step's zero_grad would):
    stock             the reduce-scatter's dual all-gather of dY, each row's token gradient
                      (the combine's backward), torch._grouped_mm dgrad and wgrad: what
                      stock (grouped GEMM + combine + NCCL reduce-scatter) computes
    stock(autograd)   the same through autograd of the stock forward (torch._grouped_mm,
                      index_add combine, reduce-scatter whose backward is an all-gather)
    ours              gemm2_gather_rs's backward (ops/op.py, ops/grouped.py)
    ours(loop wgrad)  the op's previous backward: its weight gradient by a loop over experts
Every policy's gradients are checked against stock's before timing. Method as
bench_op.py: ABBA-interleaved samples, median of the maximum-rank latency, 95% bootstrap
CI. TFLOP/s counts the two GEMMs (4 T N K); GB/s their operands' bytes plus the all-gather's.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from benchlib import abba, add_run_args, env_info, smoke_setup, summarize, without_samples, write_json  # noqa: E402,E501
from workloads import SHAPES  # noqa: E402

from megatron_overlap.ops import OverlapConfig, gemm2_gather_rs, grouped_mm, grouped_wgrad  # noqa: E402,E501
from megatron_overlap.routing import route, skew_ratio, expert_counts  # noqa: E402
from megatron_overlap.shapes import BATCH, MoEShape  # noqa: E402

# (torch 2.13 names them *_single; 2.11, the device's, *_tensor)
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: hidden 36 and FC width 20: bf16 rows of 72 and 40 bytes, torch._grouped_mm's padded path
SMOKE_SHAPES = dict(SHAPES, **{"tiny-unaligned": MoEShape("tiny-unaligned", 36, 20, 6, 2, 1)})


@dataclass(frozen=True)
class BackwardCase:
    model: str  # key of SMOKE_SHAPES (the published models, tiny ones for --smoke)
    tp: int
    ep: int
    seq: int
    routing: str = "uniform"
    batch: int = BATCH

    def label(self) -> str:
        return f"{self.model}/TP{self.tp}EP{self.ep}/S={self.seq}/{self.routing}"

    def __post_init__(self):
        if self.model not in SMOKE_SHAPES:
            raise ValueError(f"model must be one of {sorted(SMOKE_SHAPES)}, got {self.model!r}")


def layout(text: str, world: int) -> tuple[int, int]:
    m = re.fullmatch(r"TP(\d+)EP(\d+)", text or f"TP{world}EP1")
    if not m or int(m[1]) * int(m[2]) != world:
        raise SystemExit(f"--layout {text!r} must be TP<a>EP<b> with a * b = {world} ranks")
    return int(m[1]), int(m[2])


def rank_inputs(case: BackwardCase, rank: int, device, dtype) -> dict:
    """x [T, K], weight [E_local, N, K], counts, token_index and dY [M / D, N] of a rank."""
    shape = SMOKE_SHAPES[case.model]
    tokens = case.batch * case.seq
    e_local, k = shape.local_experts(case.ep), shape.ffn_per_rank(case.tp)
    topk_idx = route(tokens, shape.experts, shape.topk, case.routing, 0)  # [M, k]
    mine = (topk_idx // e_local) == rank // case.tp
    flat_e = (topk_idx % e_local)[mine]
    flat_t = torch.arange(tokens)[:, None].expand_as(topk_idx)[mine]
    order = torch.argsort(flat_e * tokens + flat_t)
    g = torch.Generator(device=device).manual_seed(rank + 1)
    rows = int(mine.sum())

    def rand(*size, scale=1.0):
        return (torch.randn(*size, generator=g, device=device) * scale).to(dtype)

    counts = torch.bincount(flat_e, minlength=e_local)
    return dict(x=rand(rows, k), weight=rand(e_local, shape.hidden, k, scale=k ** -0.5),
                counts=counts.tolist(), counts_dev=counts.to(device),
                token_index=flat_t[order].to(device), tokens=tokens, topk=shape.topk,
                grad=rand(tokens // (case.tp * case.ep), shape.hidden),
                skew=skew_ratio(expert_counts(topk_idx, shape.experts), tokens, shape.topk))


def _rows_gradient(inp: dict, group, world: int) -> torch.Tensor:
    full = inp["grad"]
    if world > 1:  # the reduce-scatter's dual
        full = full.new_empty(full.shape[0] * world, full.shape[1])
        all_gather(full, inp["grad"], group=group)
    return full[inp["token_index"].long()]  # [T, N]: the combine's backward


class _ReduceScatter(torch.autograd.Function):
    """Megatron's reduce-scatter to the sequence-parallel region: backward all-gathers."""

    @staticmethod
    def forward(ctx, full, group, world):
        ctx.group, ctx.world = group, world
        out = full.new_empty(full.shape[0] // world, full.shape[1])
        reduce_scatter(out, full.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        full = grad.new_empty(grad.shape[0] * ctx.world, grad.shape[1])
        all_gather(full, grad.contiguous(), group=ctx.group)
        return full, None, None


def _graph(forward, inp: dict):
    """The backward of forward(x, weight) over fresh leaves, as a callable returning
    (dx, dW): the graph is built once and kept (retain_graph) for every sample."""
    x = inp["x"].clone().requires_grad_(True)
    w = inp["weight"].clone().requires_grad_(True)
    out = forward(x, w)

    def backward():
        x.grad = w.grad = None
        out.backward(inp["grad"], retain_graph=True)
        return x.grad, w.grad
    return backward


def _torch_takes(stock) -> bool:
    """Whether torch._grouped_mm runs the stock products on these operands (one call; every
    rank has the same dtype and layout, so every rank answers alike)."""
    try:
        stock()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def policies(inp: dict, group, world: int, backend: str) -> dict:
    """{name: callable returning (dx, dW)}; stock first."""
    offs = inp["counts_dev"].to(torch.int32).cumsum(0, dtype=torch.int32)
    counts, counts_dev = inp["counts"], inp["counts_dev"]

    def stock():
        rows = _rows_gradient(inp, group, world)
        return (torch._grouped_mm(rows, inp["weight"], offs=offs),
                torch._grouped_mm(rows.t(), inp["x"], offs=offs))

    def loop_wgrad():
        rows = _rows_gradient(inp, group, world)
        dw, start = torch.zeros_like(inp["weight"]), 0
        for e, n in enumerate(counts):
            if n:
                torch.matmul(rows[start:start + n].t(), inp["x"][start:start + n], out=dw[e])
            start += n
        return grouped_mm(rows, inp["weight"], counts_dev, counts), dw

    def stock_forward(x, w):
        y = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
        full = y.new_zeros(inp["tokens"], y.shape[1]).index_add(0, inp["token_index"], y)
        return _ReduceScatter.apply(full, group, world) if world > 1 else full

    config = OverlapConfig.from_env(backend=backend)
    ours = _graph(lambda x, w: gemm2_gather_rs(x, w, counts, inp["token_index"], inp["tokens"],
                                               inp["topk"], None, group, config=config), inp)
    pol = {}
    # torch's grouped kernel, where torch takes these operands as they are (it raises at a
    # layout breaking its 16-byte rule, or where this build has no grouped kernel for the
    # device); else stock is not defined
    if _torch_takes(stock):
        pol["stock"] = stock
        pol["stock(autograd)"] = _graph(stock_forward, inp)
    else:  # the same products through ops/grouped.py (pads, or loops)
        pol["stock"] = lambda: (lambda r: (grouped_mm(r, inp["weight"], counts_dev, counts),
                                           grouped_wgrad(r, inp["x"], counts_dev, counts)))(
            _rows_gradient(inp, group, world))
    pol["ours"] = ours
    pol["ours(loop wgrad)"] = loop_wgrad
    return pol


def check(pol: dict) -> dict:
    """Each policy's largest relative error (dx, dW) against stock's."""
    want = [t.float() for t in pol["stock"]()]
    errs = {}
    for name, fn in pol.items():
        got = fn()
        errs[name] = max(float((g.float() - r).norm() / max(float(r.norm()), 1e-30))
                         for g, r in zip(got, want))
    return errs


def run_case(case: BackwardCase, args, backend: str, device, group, world: int) -> dict:
    rank = dist.get_rank()
    dtype = getattr(torch, args.dtype)
    inp = rank_inputs(case, rank, device, dtype)
    shape = SMOKE_SHAPES[case.model]
    k = inp["x"].shape[1]
    # the Triton backends need 16-byte rows of x; the backward is the same code either way
    fwd = backend if k * inp["x"].element_size() % 16 == 0 else "reference"
    pol = policies(inp, group, world, fwd)
    errs = check(pol)
    bad = {n: e for n, e in errs.items() if e > args.tolerance}
    if bad:
        raise SystemExit(f"{case.label()}: gradients off stock's: {bad}")
    stats = summarize(abba(pol, args.samples, args.warmup, group, progress=case.label()))
    t, n, item = inp["x"].shape[0], shape.hidden, inp["x"].element_size()
    flops = 4 * t * n * k
    gathered = inp["tokens"] * n * item * (world - 1) // world
    nbytes = item * (2 * t * n + 2 * t * k + 2 * inp["weight"].shape[0] * n * k) + gathered
    base = stats["stock"]["median"]
    return dict(case=case.label(), model=case.model, tp=case.tp, ep=case.ep, seq=case.seq,
                routing=case.routing, rows=t, hidden=n, ffn=k, experts=inp["weight"].shape[0],
                dtype=args.dtype, forward_backend=fwd, skew=inp["skew"], rel_err=errs,
                flops=flops, bytes=nbytes, stats=without_samples(stats),
                speedup_over_stock={p: base / s["median"] for p, s in stats.items()},
                tflops={p: flops / s["median"] / 1e9 for p, s in stats.items()},
                gbps={p: nbytes / s["median"] / 1e6 for p, s in stats.items()},
                samples={p: s["samples"] for p, s in stats.items()})


def _median(stats: dict, name: str) -> str:
    return f"{stats[name]['median']:.3f}" if name in stats else "-"


def table(rows: list) -> str:
    head = ("| case | T x N x K | stock ms | ours ms | ours / stock speedup | ours TFLOP/s "
            "| ours GB/s | stock(autograd) ms | ours(loop wgrad) ms |\n"
            "|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        s = r["stats"]
        lines.append(f"| {r['case']} | {r['rows']} x {r['hidden']} x {r['ffn']} | "
                     f"{s['stock']['median']:.3f} | {s['ours']['median']:.3f} "
                     f"[{s['ours']['ci_low']:.3f}, {s['ours']['ci_high']:.3f}] | "
                     f"{r['speedup_over_stock']['ours']:.2f}x | {r['tflops']['ours']:.1f} | "
                     f"{r['gbps']['ours']:.0f} | {_median(s, 'stock(autograd)')} | "
                     f"{_median(s, 'ours(loop wgrad)')} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="granite,qwen,deepseek")
    ap.add_argument("--layout", default="", help="TP<a>EP<b> over the ranks (default TP<D>EP1)")
    ap.add_argument("--seqs", default="1024,4096,16384")
    ap.add_argument("--routing", default="uniform,p90")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--tolerance", type=float, default=2e-2,
                    help="largest relative gradient error against stock before timing")
    add_run_args(ap)
    args = ap.parse_args()
    backend, device = smoke_setup(args)
    if args.smoke:
        args.model, args.routing = "tiny,tiny-unaligned", "uniform"
    world, group = dist.get_world_size(), dist.group.WORLD
    tp, ep = layout(args.layout, world)
    rows = [run_case(BackwardCase(m, tp, ep, int(s), r), args, backend, device, group, world)
            for m in args.model.split(",") for s in args.seqs.split(",")
            for r in args.routing.split(",")]
    if dist.get_rank() == 0:
        env = env_info()
        print(f"{env.get('gpu', 'CPU')} x {world}, torch {env['torch']}, "
              f"triton {env.get('triton', '-')}, {args.dtype}; median [95% CI] of the "
              f"max-rank latency, {args.samples} ABBA samples")
        print(table(rows), flush=True)
        write_json(args.json, dict(env=env, command=" ".join(sys.argv), results=rows))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
