"""The operator against an fp64 reference over models x layouts x S x routing x kernels
(one GPU): a correctness sweep to run before timing anything new.

    python tools/check_op.py --models granite,qwen --layouts TP1EP1,TP2EP1 --seqs 4096 \
        --routing uniform,p90 --impls auto,triton,row_order

For each case it prints the relative error of the op (per GEMM2 kernel / y layout) and of
the reference backend against fp64, and how many output elements are not finite.
Exit status 1 if any op error exceeds --tol (bf16 operands: ~4e-3 expected).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from workloads import OpCase, rank_inputs  # noqa: E402

from megatron_overlap.ops import OverlapConfig, gemm2_gather_rs  # noqa: E402
from megatron_overlap.ops import GPU_TILES  # noqa: E402


def fp64_reference(inp: dict) -> torch.Tensor:
    """[M, N] fp64: every row's GEMM2 output summed into its token (one rank, no RS)."""
    x, w = inp["x"].double(), inp["weight"].double()
    ys, start = [], 0
    for e, n in enumerate(inp["counts_list"]):
        ys.append(x[start:start + n] @ w[e].t())  # [n, K] @ [K, N]
        start += n
    full = torch.zeros(inp["tokens"], w.shape[1], dtype=torch.float64, device=x.device)
    return full.index_add_(0, inp["token_index"].long(), torch.cat(ys))


def variants(names: list[str]) -> dict[str, OverlapConfig]:
    """impl names -> configs: a GEMM2 kernel ("auto", "triton", "gluon") or "row_order"
    (y in GEMM2's row order, the Triton kernel)."""
    out = {}
    for name in names:
        tiles = (dataclasses.replace(GPU_TILES, token_major=False, gemm_impl="triton")
                 if name == "row_order" else dataclasses.replace(GPU_TILES, gemm_impl=name))
        out[name] = OverlapConfig(backend="triton", sync_errors=True, tiles=tiles)
    out["reference"] = OverlapConfig(backend="reference")
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="granite,qwen,deepseek")
    ap.add_argument("--layouts", default="TP1EP1,TP2EP1,TP1EP2")
    ap.add_argument("--seqs", default="4096")
    ap.add_argument("--routing", default="uniform,p90")
    ap.add_argument("--impls", default="auto,triton,row_order")
    ap.add_argument("--tol", type=float, default=2e-2)
    args = ap.parse_args()
    configs = variants(args.impls.split(","))
    worst = 0.0
    for model in args.models.split(","):
        for layout in args.layouts.split(","):
            for seq in map(int, args.seqs.split(",")):
                for routing in args.routing.split(","):
                    case = OpCase(model, layout, seq, routing)
                    inp = rank_inputs(case, 0, "cuda")
                    ref = fp64_reference(inp)
                    row = []
                    for name, cfg in configs.items():
                        out = gemm2_gather_rs(inp["x"], inp["weight"], inp["counts_list"],
                                              inp["token_index"], inp["tokens"], inp["topk"],
                                              None, None, config=cfg)
                        err = rel_err(out, ref)
                        bad = int((~torch.isfinite(out)).sum())
                        if name != "reference":
                            worst = max(worst, err)
                        row.append(f"{name} {err:.1e}" + (f" ({bad} not finite)" if bad else ""))
                    print(f"check {case.label():32s} " + " | ".join(row), flush=True)
    print(f"check worst op error {worst:.2e} (tol {args.tol:.0e})")
    return int(worst > args.tol)


if __name__ == "__main__":
    sys.exit(main())
