"""Prefill launcher: B x S forward passes of a Megatron-Core MoE model, stock or overlapped.

    torchrun --nproc-per-node 2 -m megatron_overlap.mcore.prefill --model qwen --tp 2 --ep 1 \
        --batch 4 --seq 4096 --abba --moe-overlap-backend triton

Without `--moe-overlap` the stock model runs; with it every MoE layer is an
OverlapMoELayer; `--abba` builds the overlapped model once and times both policies
ABBA-interleaved on the same weights (toggling the layers' overlap); `--cuda-graph`
adds a third, "graph": the overlapped forward captured into one CUDA graph per S and
replayed (the stock dropless layers sync the host and cannot be captured, so stock
stays eager). `--moe-fusions` runs both arms under Megatron's `--moe-permute-fusion
--moe-router-fusion`; `--baselines default,fused` times both flag sets in one schedule
(`baselines`: the second's arms are "stock-fused" / "overlap-fused"). `--impl te`
builds the model on Transformer Engine as Megatron-LM's default flags do (stock =
core-TE), `--fp8-recipe R` both arms in FP8 with TE's recipe R; `--train` times a
training step (forward with labels and the loss's backward, no optimizer) instead of
the inference forward. Latency: the median over iterations of the slowest rank's time
(95% bootstrap interval).
The B sequences are split over the attention data-parallel ranks (world / TP), so the
TP x EP group of every MoE layer sees M = B * S tokens in every layout.

CPU (gloo, tiny widths; Megatron's CUDA-only call sites need the test shims):
    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 -m megatron_overlap.mcore.prefill \
        --tiny --tp 1 --ep 2 --batch 2 --seq 16 --abba --preload tests/mcore_shims.py

`--hf PATH` loads a local Hugging Face checkpoint (load_hf_checkpoint) in place of random
weights; the decision lines then show the routing skew of its real router weights (each
MoE layer's busiest local expert against the mean, `decisions`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ..stats import bootstrap_ci
from ..ops import CapturedCall
from .args import add_moe_overlap_args, layer_policy_from_args, overlap_config_from_args
from .baselines import (BASELINES, add_baseline_args, arm, baselines_from_args,
                        check_moe_fusions_available, set_moe_fusions, use_arm)
from .host_costs import measure_host_costs
from .convert import fused_at_every_size, overlap_layers, set_overlap_enabled
from .models import CONFIGS, IMPLS, build_model
from .parallel import init_parallel, token_inputs


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_overlap.mcore.prefill",
                                description="Timed prefill of a Megatron-Core MoE model.")
    p.add_argument("--model", choices=sorted(CONFIGS), default="qwen")
    p.add_argument("--tp", type=int, default=1, help="tensor (and expert-tensor) parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size")
    p.add_argument("--layers", type=int, default=None, help="number of layers (default: published)")
    p.add_argument("--batch", type=int, default=4, help="B: sequences in the whole group")
    p.add_argument("--seq", type=int, default=4096, help="S: tokens per sequence")
    p.add_argument("--seqs", default=None, metavar="S1,S2,...",
                   help="several S on one model build (a sweep; an S that runs out of "
                        "memory is recorded as OOM); overrides --seq")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per policy")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per policy")
    p.add_argument("--seed", type=int, default=0, help="weights and token ids")
    p.add_argument("--impl", choices=IMPLS, default="local",
                   help="te: Transformer Engine throughout, as Megatron-LM's default "
                        "--transformer-impl transformer_engine builds it (stock = core-TE, "
                        "experts TEGroupedMLP); local: Megatron's local modules")
    p.add_argument("--experts", choices=("grouped", "sequential"), default="grouped",
                   help="grouped: GroupedGemmExperts (TEGroupedMLP with --impl te); "
                        "sequential: Megatron's SequentialMLP")
    p.add_argument("--tiny", action="store_true", help="CPU-sized widths (models.TINY)")
    p.add_argument("--hf", default=None, metavar="PATH",
                   help="weights and architecture from a local Hugging Face folder "
                        "(config.json + safetensors; load_hf_checkpoint) instead of random "
                        "ones; --model is then the folder's, --layers keeps the first ones")
    p.add_argument("--no-bias-swiglu-fusion", action="store_true",
                   help="eager SwiGLU, as Megatron-LM's flag (fused by default on CUDA)")
    p.add_argument("--fp8-recipe", choices=("tensorwise", "delayed", "blockwise"),
                   help="both arms in FP8 with this TE recipe (--impl te)")
    p.add_argument("--fp8-format", choices=("e4m3", "hybrid"), default="e4m3",
                   help="with --fp8-recipe: Megatron's --fp8-format (hybrid: e5m2 gradients)")
    p.add_argument("--train", action="store_true",
                   help="time a training step instead (forward with labels, the loss's "
                        "backward; train mode, gradients zeroed between steps, no optimizer)")
    p.add_argument("--host-costs", action="store_true",
                   help="after the timings, one more step per policy counting its host "
                        "syncs and host us per MoE layer call (host_costs)")
    p.add_argument("--abba", action="store_true",
                   help="time stock and overlapped ABBA-interleaved on the same weights")
    p.add_argument("--cuda-graph", action="store_true",
                   help="also time the overlapped forward captured into a CUDA graph "
                        "(policy 'graph'; CUDA; Megatron's inference RNG "
                        "tracker, whose fork a capture allows, for every policy)")
    p.add_argument("--json", default=None, metavar="FILE", help="results (rank 0)")
    p.add_argument("--preload", default=None, metavar="FILE.py|MODULE",
                   help="imported (its install() called) before Megatron builds anything")
    p.add_argument("--log-level", default="INFO", help="rank 0's level (decision lines at INFO)")
    add_baseline_args(p)
    add_moe_overlap_args(p)
    args = p.parse_args(argv)
    args.baseline_list = baselines_from_args(args)
    try:
        args.seq_list = ([int(v) for v in args.seqs.split(",")] if args.seqs else [args.seq])
    except ValueError:
        raise ValueError(f"--seqs must be comma-separated ints, got {args.seqs!r}") from None
    if any(v < 1 for v in args.seq_list):
        raise ValueError("--seqs values must be >= 1")
    for name in ("tp", "ep", "batch", "seq", "iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1")
    if args.warmup < 0:
        raise ValueError("--warmup must be >= 0")
    if args.hf and args.tiny:
        raise ValueError("--tiny builds random weights; not with --hf")
    if args.abba or args.cuda_graph:
        args.moe_overlap = True
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_once(forward, device, grad: bool = False) -> float:
    """Seconds of one `forward()` on the slowest rank (under no_grad unless `grad`)."""
    dist.barrier()
    _sync(device)
    t0 = time.perf_counter()
    with torch.set_grad_enabled(grad):
        forward()
    _sync(device)
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _schedule(policies: list[str], iters: int) -> list[str]:
    """ABBA order, A B B A A B B A ... (A B C C B A ... for three; iters samples of each):
    every policy runs as often first as last, so a drift of the machine favours none."""
    order = []
    for i in range(iters):
        order += policies if i % 2 == 0 else policies[::-1]
    return order


def decisions(model) -> list[dict]:
    """The latest launch decision of every OverlapMoELayer (fuse or not with its predicted
    times in us, C, L, P, predicted T) and the load of its local experts then (rows, the busiest expert's, their ratio to the mean)."""
    rows = []
    for layer in overlap_layers(model):
        plan = layer.last_plan
        row = dict(layer=layer.layer_number, backend=layer.overlap_config.backend)
        fusion = layer.last_fusion  # the planner's fuse-or-not answer and its two prices
        if fusion is not None:
            row.update(fuse=fusion.fuse, fused_us=round(fusion.fused_us, 1),
                       unfused_us=round(fusion.unfused_us, 1))
        if plan is not None:
            row.update(C=plan.comm_ctas, L=plan.splits, P=plan.compute_slots,
                       T=round(plan.predicted, 2), source=plan.source)
        if layer.last_rows is not None and len(layer.last_rows):
            counts = (layer.last_rows.tolist() if isinstance(layer.last_rows, torch.Tensor)
                      else [int(c) for c in layer.last_rows])
            total = sum(counts)
            row.update(rows=total, max_e=max(counts),
                       max_over_mean=round(max(counts) * len(counts) / total, 2) if total
                       else None)
        rows.append(row)
    return rows


def run(args) -> dict:
    """Build once, time every S; returns the result of the last S (identical on every
    rank). `run_all` returns one per S."""
    return run_all(args)[-1]


def _inference_rng_tracker(args, device) -> None:
    """Megatron's inference RNG tracker, installed before the model is built: its fork
    (the attention's dropout context) leaves the generator alone, where the training
    one's would reseed it inside a capture; and TE's attention keeps the tracker object
    it finds at construction, so it must be this one by then."""
    if args.train:
        raise ValueError("--cuda-graph times the inference forward; not with --train")
    if device.type != "cuda":
        raise ValueError("--cuda-graph needs CUDA")
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.cuda.manual_seed(args.seed)  # (its add() keeps no states: weights draw from here)


def run_all(args) -> list[dict]:
    device = init_parallel(args.tp, args.ep, args.seed, args.preload)
    if "fused" in args.baseline_list:
        check_moe_fusions_available()
    overlap, policy = overlap_config_from_args(args), layer_policy_from_args(args)
    overrides = {"bias_activation_fusion": False} if args.no_bias_swiglu_fusion else {}
    if args.fp8_recipe:
        overrides.update(fp8=args.fp8_format, fp8_recipe=args.fp8_recipe)
    if args.cuda_graph:
        _inference_rng_tracker(args, device)
    if args.hf:
        from .hf import load_hf_checkpoint

        model = load_hf_checkpoint(args.hf, args.tp, args.ep, overlap=overlap, policy=policy,
                                   impl=args.impl,
                                   num_layers=args.layers, experts=args.experts,
                                   **overrides).to(device)
        args.model = model.hf_arch  # (the report's name)
    else:
        model = build_model(args.model, args.tp, args.ep, args.layers, experts=args.experts,
                            overlap=overlap, policy=policy, tiny=args.tiny, impl=args.impl,
                            **overrides).to(device)
    model.train(args.train)
    set_moe_fusions(model, BASELINES[args.baseline_list[0]])
    results = []
    for seq in args.seq_list:
        try:
            results.append(_run_seq(args, model, seq, overlap, device))
        except torch.OutOfMemoryError:
            # an S that does not fit is a result (recorded as OOM), not a crash of the sweep
            torch.cuda.empty_cache()
            results.append(_header(args, seq, device) | dict(oom=True, policies={}))
    return results


def _header(args, seq: int, device) -> dict:
    return dict(model=args.model, tp=args.tp, ep=args.ep, world=dist.get_world_size(),
                batch=args.batch, seq=seq, tokens=args.batch * seq, impl=args.impl,
                experts=args.experts, baselines=args.baseline_list,
                moe_fusions=BASELINES[args.baseline_list[0]], tiny=args.tiny,
                device=str(device), cuda_graph=args.cuda_graph,
                mode="train" if args.train else "prefill", fp8=args.fp8_recipe,
                fp8_format=args.fp8_format if args.fp8_recipe else None,
                swiglu_fusion=device.type == "cuda" and not args.no_bias_swiglu_fusion)


def _training_step(model, tokens, positions):
    """One step without the optimizer: the loss's forward and backward, gradients freed."""
    def step():
        model.zero_grad(set_to_none=True)
        labels = torch.roll(tokens, -1, dims=1)
        model(tokens, positions, None, labels=labels).float().mean().backward()
    return step


def _run_seq(args, model, seq: int, overlap, device) -> dict:
    tokens, positions = token_inputs(  # (a checkpoint's ids: no padding rows)
        args.batch, seq, getattr(model, "hf_vocab_size", model.vocab_size), device, args.seed)
    primary = args.baseline_list[0]
    names = ["stock", "overlap"] if args.abba else ["overlap" if overlap else "stock"]
    arms = {arm(n, b, primary): (n, b) for b in args.baseline_list for n in names}
    policies = list(arms)
    work = (_training_step(model, tokens, positions) if args.train
            else lambda: model(tokens, positions, None))
    forwards = {p: work for p in policies}
    grad = args.train
    for policy in policies:  # warm-up: compilation, buffers, plan caches
        use_arm(model, arms[policy])
        for _ in range(args.warmup):
            _time_once(forwards[policy], device, grad)
    graph = None
    if args.cuda_graph:
        use_arm(model, ("overlap", primary))  # (captured under the primary's flags)
        graph = _captured_forward(model, tokens, positions, device)
        if graph.error is None:
            policies.append("graph")
            arms["graph"] = ("overlap", primary)
            forwards["graph"] = graph.replay
            for _ in range(args.warmup):
                _time_once(graph.replay, device)
    samples = {p: [] for p in policies}
    for policy in _schedule(policies, args.iters):
        use_arm(model, arms[policy])
        samples[policy].append(_time_once(forwards[policy], device, grad))
    result = _header(args, seq, device) | _timings(args, seq, samples)
    stock = result["policies"].get("stock")
    if graph is not None:
        result["graph"] = graph.summary()
        if stock and "graph" in samples:
            result["speedup_graph"] = stock["median_ms"] / result["policies"]["graph"]["median_ms"]
        graph.release()
    if args.host_costs:
        result["host_costs"] = _host_costs(model, arms, forwards, device, grad)
    if overlap and len(args.baseline_list) > 1:
        by_baseline = _decisions_by_baseline(args, model, work, device)
        result.update(decisions_by_baseline=by_baseline, decisions_rank0=by_baseline[primary])
    else:
        result["decisions_rank0"] = decisions(model) if overlap else []
    return result


def _timings(args, seq: int, samples: dict) -> dict:
    """Each policy's median, CI and samples; stock / overlap under the primary baseline
    (`speedup`) and under each (`speedups_by_baseline`)."""
    policies = {}
    for policy, values in samples.items():
        med = statistics.median(values)
        lo, hi = bootstrap_ci(values)
        policies[policy] = dict(median_ms=med * 1e3, ci95_ms=(lo * 1e3, hi * 1e3),
                                tokens_per_s=args.batch * seq / med,
                                samples_ms=[v * 1e3 for v in values])
    out = dict(policies=policies)
    if "stock" in policies and "overlap" in policies:
        primary = args.baseline_list[0]
        out["speedup"] = policies["stock"]["median_ms"] / policies["overlap"]["median_ms"]
        out["speedups_by_baseline"] = {
            b: (policies[arm("stock", b, primary)]["median_ms"]
                / policies[arm("overlap", b, primary)]["median_ms"])
            for b in args.baseline_list}
    return out


def _decisions_by_baseline(args, model, work, device) -> dict:
    """{baseline: decisions} after one more (untimed) overlapped call under each one's
    flags: the layers keep only their latest call's decision."""
    found = {}
    for baseline in args.baseline_list:
        use_arm(model, ("overlap", baseline))
        _time_once(work, device, args.train)
        found[baseline] = decisions(model)
    return found


def _host_costs(model, arms, forwards, device, grad: bool) -> dict:
    """{policy: HostCosts.as_dict()} of one more step of each eager policy."""
    out = {}
    for policy in (p for p in arms if p != "graph"):
        use_arm(model, arms[policy])
        _sync(device)
        with torch.set_grad_enabled(grad):
            out[policy] = measure_host_costs(model, forwards[policy]).as_dict()
        _sync(device)
    return out


def _captured_forward(model, tokens, positions, device) -> CapturedCall:
    """The overlapped forward on fixed tokens captured into one CUDA graph, checked
    against the eager forward with every layer fused (as the capture fuses them)."""
    set_overlap_enabled(model, True)
    with torch.no_grad(), fused_at_every_size(model):
        eager = model(tokens, positions, None)
    return CapturedCall(lambda: model(tokens, positions, None), device, reference=eager)


def report(result: dict) -> str:
    lines = [f"{result.get('mode', 'prefill')} {result['model']} TP{result['tp']}EP{result['ep']} (world "
             f"{result['world']}, {result['device']}), B*S = {result['batch']}x{result['seq']}"
             f" = {result['tokens']} tokens, {result.get('impl', 'local')} impl, "
             f"{result['experts']} experts"
             + (": OOM" if result.get("oom") else "")]
    for policy, r in result["policies"].items():
        lo, hi = r["ci95_ms"]
        lines.append(f"  {policy:<8} median {r['median_ms']:9.2f} ms  [95% CI {lo:.2f}, {hi:.2f}]"
                     f"  {r['tokens_per_s']:12.0f} tok/s")
    for baseline, x in result.get("speedups_by_baseline", {}).items():
        lines.append(f"  speedup stock/overlap ({baseline} MoE flags): {x:.3f}x")
    if "speedup_graph" in result:
        lines.append(f"  speedup stock/graph: {result['speedup_graph']:.3f}x (stock eager)")
    graph = result.get("graph")
    if graph:
        lines.append(f"  graph: replay equals the eager forward: {graph['equal']} (max rel. "
                     f"diff {graph['max_rel_diff']:.1e})" if graph["captured"]
                     else f"  graph: not captured ({graph['error']})")
    for policy, c in result.get("host_costs", {}).items():
        lines.append(f"  {policy:<8} host: {c['syncs_per_call']:.2f} syncs and "
                     f"{c['host_us_per_call']:.0f} us per MoE layer call ({c['calls']} calls), "
                     f"{c['step_syncs']} syncs in the step")
    for row in result.get("decisions_rank0", []):  # (none for an S that ran out of memory)
        load = (f", max_e {row['max_e']} of {row['rows']} rows ({row['max_over_mean']}x the "
                f"mean)" if row.get("max_over_mean") else "")
        if "C" in row:
            lines.append(f"  layer {row['layer']}: C={row['C']} L={row['L']} P={row['P']} "
                         f"T={row['T']} ({row['source']}){load}")
        else:
            lines.append(f"  layer {row['layer']}: {row['backend']} backend (no plan){load}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0")) if not dist.is_initialized() else dist.get_rank()
    logging.basicConfig(level=args.log_level if rank == 0 else logging.WARNING,
                        format="%(name)s: %(message)s")
    owned = not dist.is_initialized()  # a caller's process group stays the caller's
    results = run_all(args)
    if dist.get_rank() == 0:
        for result in results:
            print(report(result), flush=True)
        if args.json:  # one object for one S (the format report.py has always read)
            with open(args.json, "w") as f:
                json.dump(results[0] if len(results) == 1 else results, f, indent=1)
    if owned:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
