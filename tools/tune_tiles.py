"""Choose the kernels' tile shapes once per device (not per shape): GEMM2 alone on the
whole GPU and GatherRS alone at fixed C, for candidate shapes, with compiled resources.

    torchrun --nproc-per-node 2 tools/tune_tiles.py --json out/tiles.json

It tunes the partition placement (32-warp GatherRS CTAs on SMs of their own, whose
SM-time at C = 32 it compares) and writes `"placement": "partition"`; the shared
placement's item shape (GPU_TILES) was chosen overlapped (docs/RESULTS.md, "Kernel
choices measured").
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from benchlib import (abba, env_info, smoke_setup,  # noqa: E402
                      summarize, without_samples, write_json)
from workloads import OpCase, on_every_sm, rank_inputs  # noqa: E402

from megatron_overlap.ops import (INTERPRET_TILES, PARTITION_TILES,  # noqa: E402
                                  OverlapConfig, TileConfig, default_session, grouped_mm,
                                  load_tiles)

GEMM_CANDIDATES = [(128, 128, 64, 4, 3, False), (128, 128, 64, 4, 3, True),
                   (128, 128, 64, 8, 3, False), (128, 128, 64, 8, 3, True),
                   (128, 256, 64, 8, 3, False), (128, 256, 64, 8, 3, True),
                   (64, 128, 64, 4, 4, False), (64, 128, 64, 4, 4, True),
                   (128, 128, 128, 8, 3, False), (128, 128, 64, 4, 2, False)]
# (rows gathered per item, TNc, warps, slot loop, item pipeline stages):
# rows = tokens x pow2(top-k). 32 warps fill the register file, so a GatherRS CTA never
# shares its SM (R(C) = C); the pipelined ones gather into shared memory instead.
COMM_CANDIDATES = [(256, 1024, 32, True, 1), (128, 1024, 32, True, 1),
                   (64, 1024, 32, True, 2), (64, 512, 32, True, 3), (64, 512, 32, True, 4),
                   (32, 1024, 32, True, 3), (32, 1024, 32, True, 4), (32, 512, 32, True, 6),
                   (128, 512, 32, True, 2), (64, 512, 16, True, 4)]


def phase_launch(session, launch, inp, phases, out, y, launch_plan=None):
    """A prepared launch's `phases` ("gemm2", "comm" or both) as a callable: one side alone
    writes into `y` (GEMM2) or reads it (GatherRS, every split ready)."""
    lp = launch_plan or launch.launch_plan
    if tuple(phases) == ("gemm2",):
        return lambda: session.gemm2_alone(launch, inp["x"], inp["weight"], y, lp)
    if tuple(phases) == ("comm",):
        return lambda: session.comm_alone(launch, y, out, lp)
    return lambda: session.launch_kernels(launch, inp["x"], inp["weight"], out, lp)


def phase(inp, group, tiles, backend, c, phases, all_sms=True):
    session = default_session(group, inp["x"].device)
    launch = session.prepare(
        inp["x"], inp["weight"], inp["counts_list"], inp["token_index"], inp["tokens"],
        inp["topk"], comm_ctas=c, config=OverlapConfig.from_env(backend=backend, tiles=tiles))
    cache = launch.launch_plan.cache
    launch_plan = launch.launch_plan
    if phases == ("gemm2",) and all_sms:
        launch_plan = on_every_sm(launch)
    out = torch.empty(inp["tokens"] // launch.world, inp["hidden"], dtype=inp["x"].dtype,
                      device=inp["x"].device)
    y = torch.randn(inp["x"].shape[0], inp["hidden"], device=inp["x"].device).to(inp["x"].dtype)
    fn = phase_launch(session, launch, inp, phases, out, y, launch_plan)
    return fn, dict(launch.launch_plan.family.resources,
                    o_comp=cache.kernel.o_comp, o_comm=cache.kernel.o_comm,
                    comm_tile=(cache.kernel.comm_tile_m, cache.kernel.comm_tile_n))


def gemm_name(t: TileConfig) -> str:
    return (f"gemm2 {t.block_m}x{t.block_n}x{t.block_k} w{t.gemm_warps} s{t.gemm_stages}"
            + (" flat" if t.gemm_flatten else ""))


def choose(stats, info, gemm, comm) -> dict:
    """The fastest GEMM2 alone; the GatherRS with the least SM-time at C=32
    (its time x the SMs its 32 CTAs reserve, ceil(32 / o_comm))."""
    def med(name):
        return stats[name]["median"] if name in stats else float("inf")

    g = min(gemm, key=lambda t: med(gemm_name(t)))

    def sm_time(t):
        name = f"{comm_name(t)} C=32"
        return med(name) * -(-32 // info.get(name, {}).get("o_comm", 1))

    c = min(comm, key=sm_time)
    return {"gemm": [g.block_m, g.block_n, g.block_k, g.gemm_warps, g.gemm_stages,
                     g.gemm_flatten],
            "comm": [c.comm_rows, c.comm_tn, c.comm_warps, c.comm_slot_loop, c.comm_stages,
                     c.token_major], "placement": c.placement}


def comm_name(t: TileConfig) -> str:
    return (f"comm rows{t.comm_rows} tn{t.comm_tn} w{t.comm_warps} s{t.comm_stages} "
            + ("slots" if t.comm_slot_loop else "block"))


def tiles_from_json(path: str | None):
    """A TileConfig from `best` of a tune_tiles JSON (None: the defaults)."""
    return load_tiles(path) if path else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen")
    ap.add_argument("--layout", default="TP2EP1")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--json", default="")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--comm-only", action="store_true", help="keep the GEMM2 tiles")
    ap.add_argument("--cset", default="16,32", help="C values for the GatherRS candidates")
    args = ap.parse_args()
    cset = [int(c) for c in args.cset.split(",")]
    backend, device = smoke_setup(args)
    rank = dist.get_rank()
    group = dist.group.WORLD
    inp = rank_inputs(OpCase(args.model, args.layout, args.seq, "uniform"), rank, device)
    base = INTERPRET_TILES if backend == "interpret" else PARTITION_TILES
    gemm = [dataclasses.replace(base, block_m=m, block_n=n, block_k=k, gemm_warps=w,
                                gemm_stages=s, gemm_flatten=f)
            for m, n, k, w, s, f in GEMM_CANDIDATES]
    comm = [dataclasses.replace(base, comm_rows=r, comm_tn=tn, comm_warps=w, comm_slot_loop=sl,
                                comm_stages=st)
            for r, tn, w, sl, st in COMM_CANDIDATES]
    if args.comm_only:
        gemm = [base]
    if backend == "interpret":
        gemm, comm = gemm[:1], comm[:2]
    pol, info = {}, {}
    counts_dev = torch.tensor(inp["counts_list"], device=device)
    w_t = inp["weight"].transpose(1, 2)
    pol["torch._grouped_mm"] = lambda: grouped_mm(inp["x"], w_t, counts_dev, inp["counts_list"])
    # What the memory system gives a gather of these rows on every SM (torch), and a
    # plain copy of y: the ceilings a GatherRS CTA count is compared with.
    y_all = torch.randn(inp["x"].shape[0], inp["hidden"], device=device).to(inp["x"].dtype)
    # each token's rows of y, -1 padded [M, k]: a prepared call's combine table
    table = default_session(group, device).prepare(
        inp["x"], inp["weight"], inp["counts_list"], inp["token_index"], inp["tokens"],
        inp["topk"], config=OverlapConfig.from_env(backend=backend, tiles=base)).table.long()
    safe = table.clamp(min=0)
    pol["torch gather-sum (all SMs)"] = lambda: y_all[safe].float().sum(1)
    pol["torch copy of y (all SMs)"] = lambda: y_all.clone()
    for t in gemm:
        name = gemm_name(t)
        try:
            pol[name], info[name] = phase(inp, group, t, backend, 16, ("gemm2",))
        except Exception as err:  # noqa: BLE001 - a candidate that does not compile
            info[name] = {"error": repr(err)[:300]}
    for t in comm:
        for c in sorted(set(cset) | {32}):
            name = f"{comm_name(t)} C={c}"
            try:
                pol[name], info[name] = phase(inp, group, t, backend, c, ("comm",))
            except Exception as err:  # noqa: BLE001
                info[name] = {"error": repr(err)[:300]}
    stats = summarize(abba(pol, args.samples, 3, group, progress="tiles"))
    flops = 2 * inp["x"].shape[0] * inp["hidden"] * inp["ffn"]
    # y has one row per token-expert assignment; a combine reads each once
    read_bytes = inp["x"].shape[0] * inp["hidden"] * inp["x"].element_size()
    best = choose(stats, info, gemm, comm)
    if rank == 0:
        print("chosen:", best)
        for name, s in stats.items():
            ms = s["median"]
            rate = (f"{read_bytes / ms / 1e6:.0f} GB/s gathered"
                    if name.startswith(("comm", "torch gather", "torch copy"))
                    else f"{flops / ms / 1e9:.0f} TFLOP/s")
            print(f"{name:<42} {ms:8.3f} ms  {rate:>18}  {info.get(name, '')}")
        for name, i in info.items():
            if "error" in i:
                print(f"{name:<42} FAILED {i['error']}")
        write_json(args.json, dict(env=env_info(), command=" ".join(sys.argv), best=best,
                                   info=info,
                                   stats=without_samples(stats)))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
