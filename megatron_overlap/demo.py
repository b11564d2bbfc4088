"""`make demo`: what a newcomer runs first.

1. The planner's decisions for the paper's three models over the evaluated layouts,
   sequence lengths and routings: the paper's model with its A100 preset, then what
   `gemm2_gather_rs` decides with the shipped calibration of this machine's GPU (H100,
   H200; H200's without a GPU), tail helpers on, L ranked as the op ranks it.
2. The overlapped MoE layer against the stock Megatron-Core layer:
   * with 2+ GPUs: a torchrun complete-model prefill of Qwen1.5-MoE-A2.7B, TP2EP1,
     B=4, S=4096, stock and --moe-overlap ABBA-interleaved on the same weights
     (latency, speedup, each layer's decision); on one GPU TP1EP1, with the overlapped
     forward also captured into a CUDA graph and replayed (`--cuda-graph`);
   * without GPUs: 2 CPU processes (gloo, the Triton interpreter), a tiny Qwen-shaped
     MoE layer at TP1EP2, stock vs OverlapMoELayer (decision, max difference, time).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from .optional import te_available
from .planner import Preset, get_preset, preset_for_device, ranking_calibration
from .planner.cache import PlanCache
from .routing import SKEW_TARGETS, expert_counts, route
from .shapes import BATCH, LAYOUTS, MODELS, SEQUENCE_LENGTHS

REPO = Path(__file__).resolve().parent.parent


def decision_rows(preset: Preset, layouts=tuple(LAYOUTS), routings=("uniform", "p90"),
                  seed: int = 0, as_op: bool = False):
    """One row per model x layout x S x routing: the counts of EP rank 0 and the plan.

    `as_op`: the decision `gemm2_gather_rs` makes with this preset (tail helpers on, the
    rows per token rank 0 holds, the comm tile of each L, L ranked as `prepare` ranks
    it); otherwise the paper's model at the model's default L."""
    paper = PlanCache(preset.kernel, preset.device, preset.calibration)
    for key, shape in MODELS.items():
        for layout in layouts:
            tp, ep = LAYOUTS[layout]
            k_rank, e_local = shape.ffn_per_rank(tp), shape.local_experts(ep)
            for s in SEQUENCE_LENGTHS:
                tokens = BATCH * s
                for routing in routings:
                    idx = route(tokens, shape.experts, shape.topk, routing, seed)
                    counts = expert_counts(idx, shape.experts)[:e_local].tolist()
                    args = (tokens, shape.hidden, k_rank, tp * ep)
                    if as_op:
                        d = op_decision(preset, *args, counts, shape.topk)
                    else:
                        d = paper.decide(*args, shape.default_splits, counts, topk=shape.topk)
                    yield dict(model=key, layout=layout, S=s, routing=routing,
                               counts=counts, plan=d)


def op_decision(preset: Preset, tokens: int, hidden: int, ffn: int, world: int, counts,
                topk: int):
    """The plan `gemm2_gather_rs` would make on the device `preset` describes (its
    o_comp / o_comm) in the partition placement (`PARTITION_TILES`), tail helpers on,
    from host counts. (The shared placement, the default on Hopper, plans C = G: one
    communication CTA beside GEMM2's on every SM.)"""
    from .ops.config import PARTITION_TILES as GPU_TILES
    from .ops.planning import rank_splits

    local_topk = round(4 * sum(counts) / tokens) / 4

    def decide(splits: int, ranking: bool):
        tm, tn = GPU_TILES.comm_shape(topk, -(-hidden // splits))
        kernel = dataclasses.replace(preset.kernel, tile_m=GPU_TILES.block_m,
                                     tile_n=GPU_TILES.block_n, comm_tile_m=tm,
                                     comm_tile_n=tn, tail_helpers=not ranking)
        calib = ranking_calibration(preset.calibration) if ranking else preset.calibration
        return PlanCache(kernel, preset.device, calib).decide(
            tokens, hidden, ffn, world, splits, counts, topk=topk, local_topk=local_topk)

    return decide(rank_splits(hidden, lambda s: decide(s, True).predicted), False)


def print_decision_table(preset: Preset, layouts=tuple(LAYOUTS), as_op: bool = False) -> None:
    what = ("the op's decisions, partition placement; the shared placement, the default "
            "on Hopper, takes C = G" if as_op else "the paper's model")
    print(f"Planner decisions ({what}), preset {preset.name} (G={preset.device.available_sms} SMs, "
          f"o_comp={preset.kernel.o_comp}, o_comm={preset.kernel.o_comm}, "
          f"C_max={preset.calibration.c_max}); B={BATCH}, counts of EP rank 0; skew targets "
          + ", ".join(f"{k}: R={v}" for k, v in SKEW_TARGETS.items()))
    header = f"{'model':<9}{'layout':<8}{'S':>6} {'routing':<8}{'W_comp':>7}{'W_comm':>7}" \
             f"{'L':>3}{'C*':>4}{'R':>4}{'P':>5}{'T(C*)':>9}{'T(3)':>9}{'T(3)/T*':>8}"
    print(header)
    print("-" * len(header))
    for row in decision_rows(preset, layouts, as_op=as_op):
        d = row["plan"]
        t3 = dict(d.curve).get(3, float("nan"))
        print(f"{row['model']:<9}{row['layout']:<8}{row['S']:>6} {row['routing']:<8}"
              f"{d.w_comp:>7}{d.w_comm:>7}{d.splits:>3}{d.comm_ctas:>4}{d.reservation:>4}"
              f"{d.compute_slots:>5}{d.predicted:>9.1f}{t3:>9.1f}{t3 / d.predicted:>8.2f}")
    print()


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def _torchrun(nproc: int, args: list[str], env: dict) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", *args]
    print("$ python", " ".join(cmd[1:]), flush=True)
    return subprocess.call(cmd, env=env, cwd=REPO)


def _gpu_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        return None


def demo_preset(gpu_name: str | None) -> Preset:
    """The calibration the op plans with on this machine's GPU (h100 on an H100, ...);
    h200's without a GPU or for a GPU nothing was calibrated on."""
    return (preset_for_device(gpu_name) if gpu_name else None) or get_preset("h200")


def run_demo(nproc: int = 2, planner_only: bool = False) -> int:
    print_decision_table(get_preset("a100-paper"))
    print_decision_table(demo_preset(_gpu_name()), layouts=("TP2EP1", "TP1EP2"), as_op=True)
    if planner_only:
        return 0
    # PYTHONWARNINGS: Megatron-Core warns about every optional package it misses (TE,
    # Apex, absl) once per process; the demo's own lines are what a newcomer should read.
    env = dict(os.environ, TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NCCL_NVLS_ENABLE="0",
               OMP_NUM_THREADS="1", PYTHONWARNINGS=os.environ.get("PYTHONWARNINGS", "ignore"))
    gpus = _gpus()
    if gpus >= 1:
        # two GPUs: the layers' reduce-scatter runs over NVLink; one GPU: TP1EP1, the
        # overlap of GEMM2 with the combine alone (no peer to push to)
        tp = 2 if gpus >= 2 else 1
        te_missing = te_available()  # core-TE is the stock a Megatron-LM user runs
        print(f"Complete-model prefill on {tp} GPU{'s' * (tp > 1)}, stock vs --moe-overlap "
              f"(ABBA), " + ("Transformer Engine spec (stock = core-TE):" if te_missing is None
                             else f"local spec (no Transformer Engine: {te_missing}):"),
              flush=True)
        impl = "local" if te_missing else "te"
        return _torchrun(tp, ["-m", "megatron_overlap.mcore.prefill", "--model", "qwen",
                              "--tp", str(tp), "--ep", "1", "--batch", "4", "--seq", "4096",
                              "--iters", "5", "--warmup", "2", "--abba", "--impl", impl]
                          # one GPU: the overlapped forward captured into a CUDA graph too
                          + (["--cuda-graph"] if tp == 1 else []), env)
    shims, bench = REPO / "tests" / "mcore_shims.py", REPO / "tools" / "bench_layer.py"
    if not (shims.exists() and bench.exists()):
        print("the CPU layer comparison runs from a source checkout (tests/, tools/)")
        return 0
    print(f"No GPU: {nproc} CPU processes (gloo, Triton interpreter), a tiny Qwen-shaped MoE "
          "layer at TP1EP2, stock Megatron-Core MoELayer vs OverlapMoELayer. It checks the "
          "outputs agree and shows the decision; interpreter times say nothing about GPU "
          "speed (docs/RESULTS.md has the H200 and H100 numbers):", flush=True)
    env["TRITON_INTERPRET"] = "1"
    return _torchrun(nproc, [str(bench), "--models", "qwen", "--tp", "1", "--ep", str(nproc),
                             "--seqs", "32", "--batch", str(nproc), "--tiny", "--samples", "3",
                             "--warmup", "1", "--backend", "interpret", "--preload",
                             str(shims)], env)
