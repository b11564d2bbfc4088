"""GEMM2 alone, every SM: our kernels' tile variants against torch's grouped GEMM
(`torch._grouped_mm`, CUTLASS), each captured into a CUDA graph and replayed.

    torchrun --nproc-per-node 1 tools/bench_gemm2.py --model granite,qwen,deepseek \
        --layout TP1EP1 --seqs 4096,16384 --json out/gemm2.json

A variant is `impl:MxNxK:warps:stages` (impl triton, gluon or auto); the default list is
the shipped tile (the Gluon kernel where y is token-major) and Triton's kernel on it and
on 128 x 256 tiles of 8 warps. Each variant's
y is checked against torch's product (both bf16 out of an fp32 accumulator) before it
is timed; a variant that does not build or launch is reported, not fatal. The op's
own routing places y's rows (token-major where every token has its k rows here).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from benchlib import (abba, add_run_args, env_info, smoke_setup,  # noqa: E402
                      summarize, without_samples, write_json)
from workloads import OpCase, add_case_args, cases, on_every_sm, rank_inputs  # noqa: E402

from megatron_overlap.ops import OverlapConfig, launcher  # noqa: E402
from megatron_overlap.ops.capture import CapturedCall  # noqa: E402
from megatron_overlap.ops.config import (GPU_TILES, INTERPRET_TILES, TileConfig,  # noqa: E402
                                         load_tiles)
from megatron_overlap.ops.op import prepare  # noqa: E402
from megatron_overlap.ops.reference import grouped_mm  # noqa: E402

DEFAULT_VARIANTS = "auto:128x128x64:4:3,triton:128x128x64:4:3,triton:128x256x64:8:3"


def parse_variant(text: str, base: TileConfig) -> TileConfig:
    """`impl:MxNxK:warps:stages` as the tiles `base` has otherwise (ValueError naming
    the variant where it is malformed or TileConfig rejects it)."""
    try:
        impl, shape, warps, stages = text.split(":")
        m, n, k = (int(v) for v in shape.split("x"))
        return dataclasses.replace(base, block_m=m, block_n=n, block_k=k,
                                   gemm_warps=int(warps), gemm_stages=int(stages),
                                   gemm_impl=impl, gemm_maxnreg=None)
    except ValueError as err:
        raise ValueError(f"--variants: {text!r} is not impl:MxNxK:warps:stages ({err})") from None


def check_rows(y: torch.Tensor, expected: torch.Tensor, dest) -> float:
    """Relative error of GEMM2's y (token-major through `dest` where given) against the
    expected rows in expert order."""
    rows = y[dest.long()] if dest is not None else y
    ref = expected.float()
    return float((rows.float() - ref).norm() / ref.norm())


def gemm2_alone(inp, group, tiles: TileConfig, backend: str):
    """(call, dest, facts): the op's GEMM2 with `tiles`, prepared as the op prepares it
    (routing, plan), launched alone on every SM's o_comp slots; dest: y's row of each
    GEMM2 row where y is token-major."""
    launch = prepare(inp["x"], inp["weight"], inp["counts_list"], inp["token_index"],
                     inp["tokens"], inp["topk"], None, group,
                     config=OverlapConfig.from_env(backend=backend, tiles=tiles))
    lp = on_every_sm(launch)
    y = torch.empty(inp["x"].shape[0], inp["hidden"], dtype=inp["x"].dtype,
                    device=inp["x"].device)
    call = lambda: launcher.launch_gemm2_alone(  # noqa: E731
        launch.buffer, inp["x"], inp["weight"], launch.routing, lp, y)
    facts = dict(launch.launch_plan.family.resources, programs=lp.plan.compute_slots,
                 gemm_impl=lp.tiles.gemm_impl, placement_fits=lp.family.misfit is None)
    return call, launch.routing.dest, facts


def variant_policy(inp, group, tiles: TileConfig, backend: str, expected) -> tuple:
    """(replay, facts) of GEMM2 alone with `tiles`, its y checked against torch's first."""
    call, dest, facts = gemm2_alone(inp, group, tiles, backend)
    eager = call().clone()
    facts["error_vs_torch"] = check_rows(eager, expected, dest)
    if backend == "interpret":
        return call, facts
    captured = CapturedCall(call, inp["x"].device, reference=eager)
    if captured.error is not None:
        raise RuntimeError(captured.error)
    facts["graph_check"] = captured.summary()
    return captured.replay, facts


def workload(case: OpCase, variants: list[TileConfig], backend, device, group, samples):
    inp = rank_inputs(case, dist.get_rank(), device)
    counts = torch.tensor(inp["counts_list"], device=device)
    w_t = inp["weight"].transpose(1, 2)
    torch_gemm = lambda: grouped_mm(inp["x"], w_t, counts, None)  # noqa: E731
    expected = torch_gemm()
    pol, facts = {}, {}
    if backend == "interpret":
        pol["torch"] = torch_gemm
    else:
        pol["torch"] = CapturedCall(torch_gemm, device).replay
    for t in variants:
        name = variant_name(t)
        try:
            pol[name], facts[name] = variant_policy(inp, group, t, backend, expected)
        except Exception as err:  # noqa: BLE001 - a variant that does not build or run
            facts[name] = {"error": f"{type(err).__name__}: {err}"[:400]}
    stats = summarize(abba(pol, samples, 3, group, progress=str(case)))
    flops = 2 * inp["x"].shape[0] * inp["hidden"] * inp["ffn"]
    medians = {n: s["median"] for n, s in stats.items()}
    return dict(case=str(case), tflops={n: flops / ms / 1e9 for n, ms in medians.items()},
                over_torch={n: ms / medians["torch"] for n, ms in medians.items()},
                stats=without_samples(stats), facts=facts)


def variant_name(t: TileConfig) -> str:
    return f"{t.gemm_impl}:{t.block_m}x{t.block_n}x{t.block_k}:{t.gemm_warps}:{t.gemm_stages}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_args(ap, model="granite,qwen,deepseek", layout="TP1EP1", seqs="4096,16384",
                  routing="uniform")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--samples", type=int, default=10)
    add_run_args(ap)
    args = ap.parse_args()
    backend, device = smoke_setup(args)
    group = dist.group.WORLD
    # (GPU_TILES: the shared placement's register caps, what GEMM2 runs with in the op)
    base = INTERPRET_TILES if backend == "interpret" else (
        load_tiles(args.tiles) if args.tiles else GPU_TILES)
    variants = [parse_variant(v, base) for v in args.variants.split(",")]
    if backend == "interpret":  # the interpreter runs Triton's kernel on its small tiles
        variants = [base]
    runs = [workload(case, variants, backend, device, group, args.samples)
            for case in cases(args)]
    if dist.get_rank() == 0:
        for run in runs:
            print(run["case"])
            for name, ratio in run["over_torch"].items():
                print(f"  {name:<28} {run['stats'][name]['median'] * 1e3:9.1f} us "
                      f"{ratio:6.3f}x torch  {run['tflops'][name]:6.0f} TFLOP/s")
            for name, f in run["facts"].items():
                if "error" in f:
                    print(f"  {name:<28} FAILED {f['error']}")
                else:
                    print(f"  {name:<28} error vs torch {f['error_vs_torch']:.2e}, "
                          f"{f.get('programs')} programs, {f.get('gemm_impl')}")
        write_json(args.json, dict(env=env_info(), command=" ".join(sys.argv), runs=runs))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
