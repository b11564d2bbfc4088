"""Experiment: the final local sum over ranks (`sum_partials_kernel`) in other shapes.

    python tools/try_sum_partials.py --json out/exp_sum_partials.json

After GatherRS every rank sums the `world` partial slots it received into its output
rows: out[Md, N] = sum_src recv[src] (fp32 accumulation, the op's output dtype). At
Qwen S = 16384 TP2EP1 that pass took 170 us of a ~2.5 ms call (2.4 TB/s;
docs/data/timeline15_auto_16384.json). One GPU, no peers: the pass reads only local
memory. Variants: the shipped kernel at other BLOCK / num_warps, and one with the rank
loop unrolled (WORLD a constexpr, so both loads are in flight together), optionally with
streaming cache hints. Every variant must give the shipped kernel's bits; times are
medians over interleaved rounds of back-to-back launches (CUDA events).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

import torch
import triton
import triton.language as tl

from megatron_overlap.kernels import gather_rs as grs


@triton.jit
def sum_partials_unrolled(recv_ptr, out_ptr, numel, slot_stride, WORLD: tl.constexpr,
                          BLOCK: tl.constexpr, STREAM: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for src in tl.static_range(WORLD):
        if STREAM:
            v = tl.load(recv_ptr + src * slot_stride + offs, mask=ok, other=0.0,
                        eviction_policy="evict_first")
        else:
            v = tl.load(recv_ptr + src * slot_stride + offs, mask=ok, other=0.0)
        acc += v.to(tl.float32)
    if STREAM:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok, cache_modifier=".cs")
    else:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def variants(recv, out, world):
    numel, stride = out.numel(), recv.stride(0)
    vs = {"shipped (4096, 8 warps)": lambda: grs.launch_sum_partials(recv, out, world)}
    for block in (1024, 2048, 4096, 8192):
        for warps in (4, 8, 16):
            grid = (triton.cdiv(numel, block),)
            vs[f"loop {block}/{warps}"] = (lambda b=block, w=warps, g=grid: grs.sum_partials_kernel[g](
                recv, out, numel, world, stride, BLOCK=b, num_warps=w))
            for stream in (False, True):
                vs[f"unrolled{' stream' if stream else ''} {block}/{warps}"] = (
                    lambda b=block, w=warps, g=grid, s=stream: sum_partials_unrolled[g](
                        recv, out, numel, stride, WORLD=world, BLOCK=b, STREAM=s, num_warps=w))
    return vs


def time_round(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps  # us per launch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="8192,32768", help="Md: output rows per rank")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    results = []
    for rows in map(int, args.rows.split(",")):
        recv = torch.randn(args.world, rows, args.hidden, device="cuda").to(torch.bfloat16)
        out = torch.empty(rows, args.hidden, dtype=torch.bfloat16, device="cuda")
        vs = variants(recv, out, args.world)
        want = None
        for name, fn in vs.items():  # compile, and the bits every variant must give
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            if want is None:
                want = out.clone()
            elif not torch.equal(out, want):
                print(f"{name}: WRONG BITS", file=sys.stderr)
                return 1
        per = {name: [] for name in vs}
        rng = random.Random(0)
        for _ in range(args.rounds):
            order = list(vs)
            rng.shuffle(order)
            for name in order + order[::-1]:
                per[name].append(time_round(vs[name], args.reps))
        gb = (args.world + 1) * rows * args.hidden * 2 / 1e9
        med = {name: statistics.median(v) for name, v in per.items()}
        for name, us in sorted(med.items(), key=lambda kv: kv[1]):
            print(f"Md={rows} N={args.hidden}  {name:28s} {us:8.1f} us  {gb / us * 1e6 / 1e3:5.2f} TB/s")
        results.append(dict(rows=rows, hidden=args.hidden, world=args.world, median_us=med,
                            samples_us=per))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command=" ".join(sys.argv), results=results,
                           gpu=torch.cuda.get_device_name()), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
