"""GEMM2+GatherRS operator benchmark: planner C*, fixed C=3 / C=28, a sweep over C
(the oracle), the non-overlapped reference baseline, and the physical bound.

    torchrun --nproc-per-node 2 tools/bench_op.py --model qwen --layout TP2EP1 \
        --seqs 1024,4096,16384 --routing uniform,p90 --json out/op.json

Every policy is checked against the reference before timing. Samples are ABBA
interleaved over all policies of a workload; latency is the median over samples of the
maximum over ranks, with a 95% bootstrap CI.

`--cuda-graph` adds the op, torch's GEMM2 alone and the prepared reference, each
captured into a CUDA graph and replayed (checked against its eager output first): with
the host's work gone from all three, op / GEMM2 alone is the GPU's ratio.
`--lset 1,2,4,8` times the op at each L (C planned for it); with `--graph-sweep` the
C and L sweeps are captured too, and the regret they give carries no host noise.

`--confirm N`: the sweep's fastest C is the minimum of many noisy medians, so the
regret it gives is biased up (the winner's curse: the largest on two H200s, 28.6%, had a 95% CI
of 0.39-0.70 ms). With N > 0 a second, independent ABBA phase times the planner against
the sweep's fastest C alone (N samples each); the row's `confirm` holds that phase's
medians and regret, selection and measurement no longer sharing their noise.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from benchlib import (abba, add_run_args, env_info,  # noqa: E402
                      smoke_setup, summarize, without_samples, write_json)
from tune_tiles import tiles_from_json  # noqa: E402
from workloads import add_case_args, cases, on_every_sm, rank_inputs  # noqa: E402

from megatron_overlap.ops import OverlapConfig, gemm2_gather_rs  # noqa: E402
from megatron_overlap.ops import CapturedCall  # noqa: E402
from megatron_overlap.ops import default_session  # noqa: E402
from megatron_overlap.ops import grouped_mm  # noqa: E402
from megatron_overlap.planner import compute_slots  # noqa: E402

REFERENCE = OverlapConfig(backend="reference")


def policies_for(inp: dict, group, c_values, preset: str | None,
                 backend: str, tiles=None, graphs: bool = False, l_values=(),
                 graph_sweep: bool = False) -> tuple[dict, dict]:
    """The timed callables of one workload, and facts about them (`graphs`: with the
    captured policies of `captured_policies`; `l_values`: the op at each L, the planner
    choosing C for it; `graph_sweep`: the C and L sweeps captured too)."""
    cfg = OverlapConfig.from_env(backend=backend, preset=preset, tiles=tiles)
    args = (inp["x"], inp["weight"], inp["counts_list"], inp["token_index"], inp["tokens"],
            inp["topk"], None, group)

    def op(config, c=None):
        return lambda: gemm2_gather_rs(*args, comm_ctas=c, config=config)

    session = default_session(group, inp["x"].device)
    launch = session.prepare(*args[:7], config=cfg)
    plan = launch.plan
    md = inp["tokens"] // launch.world
    out = torch.empty(md, inp["hidden"], dtype=inp["x"].dtype, device=inp["x"].device)
    y = torch.randn(inp["x"].shape[0], inp["hidden"], device=inp["x"].device).to(inp["x"].dtype)
    counts_dev = launch.counts_dev
    w_t = inp["weight"].transpose(1, 2)
    lp = launch.launch_plan
    cache = lp.cache
    every_sm = on_every_sm(launch)
    pol = {
        "reference": op(REFERENCE),
        "planner": op(cfg),
        # the op with the last split left to the C CTAs (the paper's scheme); it plans
        # for that too (no helper term), so its C can differ
        "planner(no tail helpers)": op(dataclasses.replace(cfg, tail_helpers=False)),
        "gemm2_alone(torch)": lambda: grouped_mm(inp["x"], w_t, counts_dev, inp["counts_list"]),
        "gemm2_alone(ours,P=all)": lambda: session.gemm2_alone(
            launch, inp["x"], inp["weight"], y, every_sm),
        # one split: x is read once instead of once per split (what L costs GEMM2)
        "gemm2_alone(ours,P=all,L=1)": lambda: session.gemm2_alone(
            launch, inp["x"], inp["weight"], y, dataclasses.replace(every_sm, splits=1)),
        # The same work with the host's part done once, outside the timed region:
        # what the GPU spends (the whole-op rows above also pay planning, routing table,
        # copies and launches on the host, which a forward pays after every sync).
        "planner(prepared)": lambda: session.launch_kernels(launch, inp["x"], inp["weight"], out),
        "reference(prepared)": lambda: session.reference(launch, inp["x"], inp["weight"]),
        f"comm_alone(C={plan.comm_ctas})": lambda: session.comm_alone(launch, y, out),
    }
    for c in (3, 28):  # the public A100 COMET path and FLUX's Hopper default
        if compute_slots(c, cache.kernel, cache.device) > 0:
            pol[f"C={c}"] = op(cfg, c)
    for c in c_values:
        pol[f"sweep C={c}"] = op(cfg, c)
    for l in l_values:
        pol[f"L={l}"] = lambda l=l: gemm2_gather_rs(*args, splits=l, config=cfg)
    graph_checks = {}
    if graphs:
        pol_graph, graph_checks = captured_policies(inp, group, cfg, launch,
                                                    c_values if graph_sweep else (),
                                                    l_values if graph_sweep else ())
        pol.update(pol_graph)
    # at split_predictions' default candidates and at the L this run times
    by_splits = {**session.split_predictions(lp.request),
                 **session.split_predictions(lp.request, tuple(l_values))}
    facts = dict(world=launch.world, comm_ctas=plan.comm_ctas, compute_slots=plan.compute_slots,
                 splits=plan.splits, predicted=plan.curve, w_comp=plan.w_comp,
                 # the model that ranks L, at each L (compute waves): what the choice compared
                 predicted_by_splits=dict(sorted(by_splits.items())),
                 w_comm=plan.w_comm, rho=plan.rho,
                 resources=lp.family.resources)
    if graphs:
        facts["graphs"] = graph_checks
    return pol, facts


def captured_policies(inp: dict, group, cfg, launch, c_values=(),
                      l_values=()) -> tuple[dict, dict]:
    """The op, torch's GEMM2 alone and the prepared reference, each captured into a CUDA
    graph and replayed: the three without any host work, so their ratios are the GPU's.
    The op gets its counts as a CUDA tensor (what a capture needs; Megatron's
    tokens_per_expert); the reference its routing table prepared. `c_values` and
    `l_values` add the op captured at each C ("graph C=c") and each L ("graph L=l"):
    the planner's regret without the host's noise. {name: replay}, and each capture's
    check against its eager output (or why it failed)."""
    counts = torch.tensor(inp["counts_list"], device=inp["x"].device)
    if sum(inp["counts_list"]) != inp["x"].shape[0]:
        raise ValueError(f"the counts sum to {sum(inp['counts_list'])}, x has "
                         f"{inp['x'].shape[0]} rows")
    expected = counts.clone()
    w_t = inp["weight"].transpose(1, 2)
    session = default_session(group, inp["x"].device)

    def op(**choice):
        return lambda: gemm2_gather_rs(inp["x"], inp["weight"], counts, inp["token_index"],
                                       inp["tokens"], inp["topk"], None, group,
                                       **{"config": cfg, **choice})
    calls = {
        "planner(graph)": op(),
        "gemm2_alone(torch,graph)": lambda: grouped_mm(inp["x"], w_t, counts, None),
        "reference(prepared,graph)": lambda: session.reference(
            launch, inp["x"], inp["weight"], counts_on_device=True),
    }
    calls.update({f"graph C={c}": op(comm_ctas=c) for c in c_values})
    calls.update({f"graph L={l}": op(splits=l) for l in l_values})
    pol, checks = {}, {}
    for name, fn in calls.items():
        captured = CapturedCall(fn, inp["x"].device)
        checks[name] = captured.summary()
        if not torch.equal(counts, expected):  # (a later replay would read them)
            raise RuntimeError(f"{name}: its capture or replay changed the expert counts "
                               f"{expected.tolist()} to {counts.tolist()}")
        if captured.error is None:
            pol[name] = captured.replay
        elif dist.get_rank() == 0:
            print(f"{name}: not captured ({captured.error})", flush=True)
    return pol, checks


def confirm(pol: dict, oracle_c: int, planner_c: int, samples: int, warmup: int, group,
            label: str) -> dict:
    """The planner against the sweep's fastest C in a phase of their own (ABBA). Where
    that C is the planner's own, the regret is 0 by definition and the phase times one
    configuration twice: `spread` is then the timing noise, not a regret."""
    pair = {"planner": pol["planner"], f"C={oracle_c}": pol[f"sweep C={oracle_c}"]}
    med = {n: s["median"] for n, s in summarize(
        abba(pair, samples, warmup, group, progress=f"{label} confirm")).items()}
    planner, oracle = med["planner"], med[f"C={oracle_c}"]
    same = oracle_c == planner_c
    spread = (planner - oracle) / oracle
    return dict(oracle_c=oracle_c, samples=samples, planner_ms=planner, oracle_ms=oracle,
                same_config=same, spread=spread, regret=0.0 if same else spread)


def check_against_reference(inp, group, c_values, backend: str, tiles=None,
                            l_values=()) -> float:
    """The largest relative error against the reference path over C* (and the planned
    L), C = 3, the largest swept C and each L of `l_values`."""
    args = (inp["x"], inp["weight"], inp["counts_list"], inp["token_index"], inp["tokens"],
            inp["topk"], None, group)
    ref = gemm2_gather_rs(*args, config=REFERENCE).float()
    cfg = OverlapConfig.from_env(backend=backend, sync_errors=True, tiles=tiles)
    worst = 0.0
    choices = [dict(comm_ctas=c) for c in (None, 3, max(c_values))]
    for choice in choices + [dict(splits=l) for l in l_values]:
        out = gemm2_gather_rs(*args, config=cfg, **choice)
        worst = max(worst, float((out.float() - ref).norm() / ref.norm()))
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_args(ap, model="qwen", layout="TP2EP1", seqs="1024,4096,16384",
                  routing="uniform,p90")
    ap.add_argument("--cmax", type=int, default=48, help="largest C of the sweep")
    ap.add_argument("--cset", default="", help="comma list of C for the sweep instead")
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--preset", default=None, help="calibration preset name or JSON path")
    ap.add_argument("--confirm", type=int, default=0, metavar="N",
                    help="time the planner against the sweep's fastest C again, N samples")
    ap.add_argument("--lset", default="", help="comma list of L: the op at each (C planned)")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="also time the op, torch's GEMM2 alone and the prepared reference "
                         "captured into CUDA graphs (no host work in any of them; CUDA only)")
    ap.add_argument("--graph-sweep", action="store_true",
                    help="with --cuda-graph: the C and L sweeps captured too (the regret "
                         "without the host's noise)")
    add_run_args(ap)
    args = ap.parse_args()
    backend, device = smoke_setup(args)
    if args.cuda_graph and device != "cuda":
        ap.error("--cuda-graph needs CUDA")
    if args.graph_sweep and not args.cuda_graph:
        ap.error("--graph-sweep needs --cuda-graph")
    rank = dist.get_rank()
    group = dist.group.WORLD
    c_values = ([int(c) for c in args.cset.split(",")] if args.cset
                else list(range(1, args.cmax + 1)))
    l_values = [int(v) for v in args.lset.split(",")] if args.lset else []
    # (without --tiles: MEGATRON_OVERLAP_TILES's, else the defaults)
    tiles = tiles_from_json(args.tiles) or OverlapConfig.from_env().tiles
    results = []
    for case in cases(args):
        inp = rank_inputs(case, rank, device)
        err = check_against_reference(inp, group, c_values, backend, tiles, l_values)
        pol, facts = policies_for(inp, group, c_values, args.preset, backend, tiles,
                                  graphs=args.cuda_graph, l_values=l_values,
                                  graph_sweep=args.graph_sweep)
        per = abba(pol, args.samples, args.warmup, group, progress=case.label())
        stats = summarize(per)
        gemm_flops = 2 * inp["x"].shape[0] * inp["hidden"] * inp["ffn"]
        sweep = {int(n.split("=")[1]): s["median"] for n, s in stats.items()
                 if n.startswith("sweep")}
        oracle_c = min(sweep, key=sweep.get)
        row = dict(case=case.label(), model=case.model, layout=case.layout, seq=case.seq,
                   routing=case.routing, skew=inp["skew"], rel_err=err, gemm_flops=gemm_flops,
                   oracle_c=oracle_c, oracle_ms=sweep[oracle_c], **facts,
                   stats=without_samples(stats),
                   samples={n: s["samples"] for n, s in stats.items()})
        if args.confirm:
            row["confirm"] = confirm(pol, oracle_c, facts["comm_ctas"], args.confirm,
                                     args.warmup, group, case.label())
        results.append(row)
        if rank == 0:
            med = {n: s["median"] for n, s in stats.items()}
            print(f"{case.label():<28} err={err:.1e} C*={facts['comm_ctas']:>2} "
                  f"oracle C={oracle_c:>2} | ref {med['reference']:.3f} planner "
                  f"{med['planner']:.3f} C3 {med['C=3']:.3f} C28 {med.get('C=28', float('nan')):.3f} "
                  f"oracle {sweep[oracle_c]:.3f} gemm(torch) {med['gemm2_alone(torch)']:.3f}"
                  f" gemm(ours) {med['gemm2_alone(ours,P=all)']:.3f} ms"
                  + "".join(f" | {n} {med[n]:.3f}" for n in med if n.endswith("graph)")),
                  flush=True)
    if rank == 0:
        write_json(args.json, dict(env=env_info(), command=" ".join(sys.argv), results=results))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
