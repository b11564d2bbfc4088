"""MoE layer benchmark: one Megatron-Core MoE layer (router, allgather dispatch, FC1,
activation, FC2, combine, reduce-scatter; shared experts where the model has them),
stock vs overlapped on the same weights, ABBA-interleaved.

    torchrun --nproc-per-node 2 tools/bench_layer.py --models granite,qwen,deepseek \
        --tp 2 --ep 1 --seqs 4096,16384 --json out/layer_TP2EP1.json

Stock = Megatron's MoELayer whose experts run FC1/FC2 through torch._grouped_mm
(GroupedGemmExperts: megatron-core 0.19 has no non-TE grouped experts) followed by its
unpermute and NCCL reduce-scatter; ours = OverlapMoELayer (planner-chosen C, L).
Inputs are random hidden states [S/TP, B/DP, H] (sequence parallel when TP > 1), which
route near-uniformly, or with `--input-layer L` the input of layer L's MoE layer in a
prefill of random tokens, whose routing is as skewed as the prefill's there. Each row
records the input's expert load (max_e / mean over the TP x EP group). `--cuda-graph`
adds "graph": the overlapped layer captured into one CUDA graph and replayed, its replay
checked against the eager fused layer (stock stays eager: it syncs the host).
`--moe-fusions` runs both arms under Megatron's `--moe-permute-fusion --moe-router-fusion`;
`--baselines default,fused` times both flag sets in one schedule (the second's arms
suffixed "-fused"; `speedups_by_baseline`: stock / overlap under each). `--backward` times
forward + backward in training mode instead (the hidden states and every parameter with
gradients, the same random dL/dy each call; `grad_agreement`: the two arms' input
gradients).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from benchlib import abba, env_info, summarize, write_json  # noqa: E402

from megatron_overlap.mcore import (BASELINES, LayerPolicy, OverlapMoELayer,  # noqa: E402
                                    add_baseline_args, baselines_from_args, build_model,
                                    check_moe_fusions_available, fused_at_every_size,
                                    init_parallel, model_config, set_moe_fusions,
                                    set_overlap_enabled, token_inputs)
from megatron_overlap.ops import CapturedCall, OverlapConfig  # noqa: E402


class _Captured(Exception):
    """Raised by the capture hook: the forward has reached the benchmarked layer."""


def _first_moe_layer(model_name: str) -> int:
    return 2 if model_name == "deepseek" else 1  # DeepSeek's first layer is dense


def build_case(model_name, tp, ep, seq, batch, args, device, impl: str = "local"):
    """(an OverlapMoELayer of `model_name`, the hidden states it is timed on), eval mode.

    `args.input_layer` 0: the model's first MoE layer on random hidden states [S/TP, B/DP,
    H] (they route near-uniformly). L >= 1: the MoE layer of transformer layer L on the
    input it gets in a prefill of random tokens (the model built L layers deep; the
    forward stops there), whose routing is as skewed as the prefill's at that depth.
    """
    from megatron.core import parallel_state as ps

    input_layer = args.input_layer
    if input_layer and input_layer < _first_moe_layer(model_name):
        raise ValueError(f"--input-layer {input_layer}: layer {input_layer} of {model_name} "
                         f"is dense (its first MoE layer is {_first_moe_layer(model_name)})")
    if input_layer > (depth := model_config(model_name, tp, ep, tiny=args.tiny,
                                            impl=impl)[0].num_layers):
        raise ValueError(f"--input-layer {input_layer}: {model_name} has {depth} layers")
    depth = input_layer or _first_moe_layer(model_name)
    config = OverlapConfig.from_env(backend=args.backend)
    overrides = {"bias_activation_fusion": False} if args.no_bias_swiglu_fusion else {}
    if getattr(args, "fp8_recipe", None):
        overrides.update(fp8=getattr(args, "fp8_format", "e4m3"), fp8_recipe=args.fp8_recipe)
    model = build_model(model_name, tp, ep, depth, overlap=config, policy=layer_policy(args),
                        tiny=args.tiny, impl=impl, **overrides).to(device).eval()
    layer = [m for m in model.modules() if isinstance(m, OverlapMoELayer)][-1]
    if not input_layer:
        dp = ps.get_data_parallel_world_size()
        s_local = seq // tp if layer.config.sequence_parallel else seq
        gen = torch.Generator(device=device).manual_seed(1234 + ps.get_data_parallel_rank())
        hidden = torch.randn(s_local, batch // dp, layer.config.hidden_size, generator=gen,
                             device=device, dtype=torch.float32).to(layer.config.params_dtype)
        return layer, hidden
    captured = []

    def capture(module, inputs):
        captured.append(inputs[0].detach().clone())
        raise _Captured

    tokens, positions = token_inputs(batch, seq, model.vocab_size, device)
    handle = layer.register_forward_pre_hook(capture)
    set_overlap_enabled(model, False)  # the layers before it run stock (they are not timed)
    try:
        with torch.no_grad():
            model(tokens, positions, None)
    except _Captured:
        pass
    finally:
        handle.remove()
        set_overlap_enabled(model, True)
    if not captured:
        raise RuntimeError(f"the forward never reached MoE layer {input_layer}")
    return layer, captured[0]


def add_input_layer_arg(ap) -> None:
    ap.add_argument("--input-layer", type=int, default=0, metavar="L",
                    help="time the MoE layer of transformer layer L on its input in a "
                         "prefill of random tokens (skewed routing, as in the prefill); "
                         "0 (default): the first MoE layer on random hidden states")


def add_fuse_arg(ap, default: str = "always") -> None:
    """The layer's fuse-or-not policy (LayerPolicy.fuse). The layer tools default to
    "always": the fused layer at every size (what it can give); the prefill tools to
    "auto", the product's (the planner decides per size)."""
    ap.add_argument("--fuse", choices=("auto", "always"), default=default,
                    help=f"LayerPolicy.fuse (default: {default})")


def layer_policy(args, **fields) -> LayerPolicy:
    """The layers' LayerPolicy from the `--fuse` flag (and `fields`); FP8 layers fused
    where `--fp8-recipe` asks for them, blockwise included (the tool times what it is
    asked)."""
    recipe = getattr(args, "fp8_recipe", None)
    return LayerPolicy(fuse=args.fuse, fp8=bool(recipe), fp8_blockwise=recipe == "blockwise",
                       **fields)


def in_fp8(layer):
    """The FP8 context Megatron's TransformerBlock enters around a layer of an FP8 config
    (TE's autocast with the config's recipe; a null context without FP8): a layer called
    by itself runs as inside the model."""
    from megatron.core.fp8_utils import get_fp8_context

    return get_fp8_context(layer.config)


def routing_skew(layer, hidden) -> dict:
    """The benchmarked input's expert load over the layer's TP x EP group (what one
    dispatch gathers): rows of the busiest expert, the mean, and their ratio."""
    with torch.no_grad():
        _, routing_map = layer.router(hidden)
    counts = routing_map.sum(0).to(torch.int64)
    group = layer.token_dispatcher.tp_ep_group
    if group is not None and group.size() > 1:
        dist.all_reduce(counts, group=group)
    mean = float(counts.float().mean())
    return dict(max_e=int(counts.max()), mean=mean, max_over_mean=float(counts.max()) / mean)


def _policy(impl: str, primary: str, name: str) -> str:
    return name if impl == primary else f"{name}-{impl}"


def arm(name: str, baseline: str, primary: str) -> str:
    """A policy's name under a baseline, as the prefill launcher names its arms: `name`
    under the primary baseline, else suffixed with its baseline ("stock-fused")."""
    return name if baseline == primary else f"{name}-{baseline}"


def _build_arms(model_name, tp, ep, seq, batch, args, device) -> dict:
    """{impl: (layer, hidden)} for every --impls entry; the later ones route as the first
    (its router weights copied), on the same hidden states."""
    cases = {}
    for impl in args.impls:
        layer, hidden = build_case(model_name, tp, ep, seq, batch, args, device, impl)
        if cases:
            first_layer, first_hidden = next(iter(cases.values()))
            with torch.no_grad():
                layer.router.weight.copy_(first_layer.router.weight)
            hidden = first_hidden
        cases[impl] = (layer, hidden)
    return cases


def _agreement(layer, hidden, fused: bool) -> tuple[float, float]:
    """(relative error, max |diff|) of the overlapped layer's output against stock's,
    both under Megatron's MoE fusions or both without."""
    set_moe_fusions(layer, fused)
    with torch.no_grad(), in_fp8(layer):  # outputs agree before anything is timed
        layer.overlap_enabled = False
        ref = layer(hidden)[0].float()
        layer.overlap_enabled = True
        out = layer(hidden)[0].float()
    return float((out - ref).norm() / ref.norm()), float((out - ref).abs().max())


def _input_gradients(layer, hidden, grad, fused: bool) -> tuple[float, float]:
    """(relative error, max |diff|) of the overlapped layer's dL/dhidden against stock's."""
    set_moe_fusions(layer, fused)
    found = []
    for overlap in (False, True):
        layer.overlap_enabled = overlap
        x = hidden.detach().requires_grad_(True)
        with in_fp8(layer):
            out = layer(x)[0]
        out.backward(grad)
        found.append(x.grad.float())
    ref, got = found
    return float((got - ref).norm() / ref.norm()), float((got - ref).abs().max())


def _step(layer, hidden, overlap: bool, fused: bool, grad):
    """One arm's timed call: the forward without gradients, or with `grad` (training
    mode) forward + backward."""
    def fn():
        layer.overlap_enabled = overlap
        set_moe_fusions(layer, fused)
        if grad is None:
            with torch.no_grad(), in_fp8(layer):
                layer(hidden)
            return
        with in_fp8(layer):
            out = layer(hidden)[0]
        out.backward(grad)
    return fn


def layer_case(model_name, tp, ep, seq, batch, args, device):
    """Stock and overlapped layer of every implementation and baseline, timed ABBA in one
    schedule. Policies of the first --impls entry are "stock" / "overlap", the others'
    carry the implementation's name ("stock-local"), those of a later --baselines entry
    its name too ("stock-fused"); speedups are over the first's stock."""
    cases = _build_arms(model_name, tp, ep, seq, batch, args, device)
    primary, first = args.impls[0], args.baseline_list[0]
    backward = getattr(args, "backward", False)
    policies, checks, grad_checks = {}, {}, {}
    for impl, (layer, hidden) in cases.items():
        grad = None
        if backward:
            layer.train()
            gen = torch.Generator(device=hidden.device).manual_seed(99)
            grad = torch.randn(hidden.shape, generator=gen, device=hidden.device).to(hidden.dtype)
            grad_checks[impl] = _input_gradients(layer, hidden, grad, BASELINES[first])
            hidden = hidden.detach().requires_grad_(True)
        for b in args.baseline_list:
            checks[arm(impl, b, first)] = _agreement(layer, hidden, BASELINES[b])
            for name in ("stock", "overlap"):
                policies[arm(_policy(impl, primary, name), b, first)] = _step(
                    layer, hidden, name == "overlap", BASELINES[b], grad)
    layer, hidden = cases[primary]
    set_moe_fusions(layer, BASELINES[first])
    err, max_diff = checks[primary]
    skew = routing_skew(layer, hidden)
    graph = _captured_layer(layer, hidden, device) if args.cuda_graph else None
    if graph is not None and graph.error is None:
        policies["graph"] = graph.replay
    per = abba(policies, args.samples, args.warmup, progress=f"layer {model_name}")
    stats = summarize(per)
    plan = layer.last_plan
    base = stats["stock"]["median"]
    extra = {"speedups": {k: base / v["median"] for k, v in stats.items() if k != "stock"},
             "speedups_by_baseline": {b: stats[arm("stock", b, first)]["median"]
                                      / stats[arm("overlap", b, first)]["median"]
                                      for b in args.baseline_list},
             "agreement": {impl: dict(rel_err=e, max_abs_diff=d) for impl, (e, d) in checks.items()},
             "grad_agreement": {impl: dict(rel_err=e, max_abs_diff=d)
                                for impl, (e, d) in grad_checks.items()}}
    if graph is not None:
        extra["graph"] = graph.summary()
        if "graph" in stats:
            extra["speedup_graph"] = base / stats["graph"]["median"]
        graph.release()
    return dict(model=model_name, tp=tp, ep=ep, seq=seq, batch=batch, impls=args.impls,
                fp8=getattr(args, "fp8_recipe", None),
                fp8_format=getattr(args, "fp8_format", None) if getattr(args, "fp8_recipe", None) else None,
                mode="forward+backward" if backward else "forward",
                baselines=args.baseline_list, moe_fusions=BASELINES[first],
                rel_err=err, max_abs_diff=max_diff, input_layer=args.input_layer, routing=skew,
                decision=None if plan is None else dict(C=plan.comm_ctas, L=plan.splits,
                                                        P=plan.compute_slots),
                stats={k: {a: b for a, b in v.items() if a != "samples"}
                       for k, v in stats.items()},
                samples={k: v["samples"] for k, v in stats.items()},
                speedup=base / stats["overlap"]["median"], **extra)


def _captured_layer(layer, hidden, device) -> CapturedCall:
    """The overlapped layer on `hidden` captured into one CUDA graph (stock Megatron's
    dropless layer syncs the host inside its forward and cannot be captured), checked
    against the eager layer with the fused op at every size, as the capture runs it."""
    with torch.no_grad(), fused_at_every_size(layer):
        eager = layer(hidden)[0]
    return CapturedCall(lambda: layer(hidden)[0], device, reference=eager)


def summary_line(r: dict, name: str, args) -> str:
    st, primary = r["stats"], r["impls"][0]
    arms = ", ".join(f"{k} {v['median']:.3f} ms" for k, v in st.items())
    ratios = ", ".join(f"{k} {v:.2f}x" for k, v in r["speedups"].items())
    flags = ", ".join(f"{k} MoE flags {v:.2f}x" for k, v in r["speedups_by_baseline"].items())
    line = (f"layer {name} TP{args.tp}EP{args.ep} S={r['seq']}: {arms}; over stock-{primary}: "
            f"{ratios}; stock / overlap: {flags}; rel. err {r['rel_err']:.1e}, "
            f"max |diff| {r['max_abs_diff']:.2e}, "
            f"decision {r['decision']}, max_e/mean {r['routing']['max_over_mean']:.2f}")
    if "graph" in st:
        line += f", graph replay = eager: {r['graph']['equal']}"
    if r.get("graph", {}).get("error"):
        line += f", capture failed: {r['graph']['error']}"
    return line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="granite,qwen,deepseek")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--seqs", default="4096,16384")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--impls", default="local", metavar="te,local",
                    help="implementations timed side by side, the first the baseline: te "
                         "(Transformer Engine spec, TEGroupedMLP: stock = core-TE), local "
                         "(GroupedGemmExperts over torch._grouped_mm)")
    add_fuse_arg(ap)
    add_baseline_args(ap)
    ap.add_argument("--tiny", action="store_true")
    add_input_layer_arg(ap)
    ap.add_argument("--no-bias-swiglu-fusion", action="store_true",
                    help="eager SwiGLU (Megatron's flag of that name; fused by default on CUDA)")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="also time the overlapped layer captured into a CUDA graph and "
                         "replayed ('graph'; needs CUDA, inference, every expert local)")
    ap.add_argument("--fp8-recipe", choices=("tensorwise", "delayed", "blockwise"),
                    help="the layers in FP8 (e4m3) with this TE recipe inside Megatron's FP8 "
                         "context, both arms (--impls te; the overlapped arm opted in as "
                         "--moe-overlap-fp8 does)")
    ap.add_argument("--fp8-format", choices=("e4m3", "hybrid"), default="e4m3",
                    help="with --fp8-recipe: Megatron's --fp8-format (hybrid: e5m2 gradients)")
    ap.add_argument("--backward", action="store_true",
                    help="time forward + backward in training mode (default: the forward "
                         "without gradients)")
    ap.add_argument("--preload", default=None)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.backward and args.cuda_graph:
        ap.error("--cuda-graph: the captured layer is the forward (inference)")
    args.impls = args.impls.split(",")
    if args.fp8_recipe and args.impls != ["te"]:
        ap.error("--fp8-recipe: FP8 experts are TE's (--impls te)")
    if args.fp8_recipe and args.cuda_graph:
        ap.error("--cuda-graph: TE's FP8 experts split the rows on the host (no capture)")
    if len(set(args.impls)) < len(args.impls):
        ap.error(f"--impls: distinct entries, got {','.join(args.impls)}")
    try:
        for impl in args.impls:  # (model_config names the implementations it takes)
            model_config("qwen", tiny=True, impl=impl)
    except ValueError as e:
        ap.error(f"--impls: {e}")
    try:
        args.baseline_list = baselines_from_args(args)
    except ValueError as e:
        ap.error(str(e))
    device = init_parallel(args.tp, args.ep, seed=0, preload=args.preload)
    if "fused" in args.baseline_list:
        check_moe_fusions_available()
    if args.cuda_graph and device.type != "cuda":
        ap.error("--cuda-graph needs CUDA")
    results = []
    for name in args.models.split(","):
        for seq in map(int, args.seqs.split(",")):
            r = layer_case(name, args.tp, args.ep, seq, args.batch, args, device)
            torch.cuda.empty_cache()  # this case's model is gone; hand its memory back
            results.append(r)
            if dist.get_rank() == 0:
                print(summary_line(r, name, args), flush=True)
    if dist.get_rank() == 0:
        write_json(args.json, dict(env=env_info(), command=" ".join(sys.argv), results=results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
