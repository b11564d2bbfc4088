"""The op's routing stage alone on one GPU: `Router.route` (the combine table, the
token-major inverse and the device offsets from the counts) per workload, against the
pure-torch `combine_table`, CUDA-graph replays, medians; and its first pass alone
(`defer_slots`: what the op queues before GEMM2 where GEMM2 counts its rows' places,
`TileConfig.gemm_places_from_marks`, the second pass going to GatherRS's stream), where
the code has it.

    python tools/bench_routing.py --models granite,qwen,deepseek --layout TP1EP1 \
        --seqs 4096,16384

Every table is checked against `combine_table` before timing.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
from workloads import OpCase, rank_inputs  # noqa: E402

from megatron_overlap.kernels.routing_table import combine_table  # noqa: E402
from megatron_overlap.ops.routing import Router  # noqa: E402


def graph_ms(fn) -> float:
    """Median ms of `fn` replayed from a CUDA graph (warmed up eagerly first)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="granite,qwen,deepseek")
    ap.add_argument("--layout", default="TP1EP1")
    ap.add_argument("--seqs", default="4096,16384")
    args = ap.parse_args()
    router = Router.get(torch.device("cuda"))
    error = torch.zeros(1, dtype=torch.int32, device="cuda")
    for model in args.models.split(","):
        for seq in map(int, args.seqs.split(",")):
            inp = rank_inputs(OpCase(model, args.layout, seq, "uniform"), 0, "cuda")
            tokens, topk, rows = inp["tokens"], inp["topk"], inp["token_index"].numel()
            counts = inp["counts"].to("cuda", torch.int32)
            token_major = rows == tokens * topk
            dest = torch.empty(rows, dtype=torch.int32, device="cuda") if token_major else None

            def route():
                return router.route(inp["token_index"], counts, error, 128, tokens, topk, dest)
            want = combine_table(inp["token_index"].long(), tokens, topk)
            got = route().table
            torch.cuda.synchronize()
            if not torch.equal(got, want) or int(error.item()):
                raise RuntimeError(f"{model} S={seq}: the routing table differs from "
                                   f"combine_table (error word {int(error.item()):#x})")
            ms = graph_ms(route)
            try:  # (an older code's Router.route has no defer_slots)
                first = graph_ms(lambda: router.route(inp["token_index"], counts, error, 128,
                                                      tokens, topk, dest, defer_slots=True))
            except TypeError:
                first = None
            try:
                ref = graph_ms(lambda: combine_table(inp["token_index"], tokens, topk))
            except RuntimeError:  # (not capturable in this torch: timed eagerly)
                ref = triton.testing.do_bench(
                    lambda: combine_table(inp["token_index"], tokens, topk),
                    return_mode="median")
            print(f"routing {model}/{args.layout}/S={seq} rows={rows} experts={counts.numel()} "
                  f"route {ms * 1e3:.1f} us"
                  + ("" if first is None else f" (first pass: {first * 1e3:.1f} us)")
                  + f" | combine_table {ref * 1e3:.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
