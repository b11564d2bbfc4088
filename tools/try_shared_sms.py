"""Experiment: GatherRS CTAs beside GEMM2's on every SM, against SMs set aside for them.

    python tools/try_shared_sms.py --json out/exp_shared_sms.json        # one GPU
    python tools/try_shared_sms.py --smoke                               # CPU, interpreter

The op partitions the GPU (the paper's scheme): C communication CTAs of 32 warps take
R(C) SMs whole and GEMM2 runs on the G - R(C) others. What bounds the overlapped
operator now is GEMM2 on those fewer SMs (docs/RESULTS.md, "What limits us now"), while
the communication side is latency-bound loads that use little of an SM. Here instead
GEMM2 gets all G SMs (P = o_comp G) and one small GatherRS CTA (4 warps, a few rows per
item) sits beside its two CTAs on each SM, in the registers and shared memory they
leave: with the Gluon GEMM2 capped at `--gemm-maxnreg` registers (2 x 256 threads x 104
= 53248 of 65536) a 4-warp GatherRS CTA of <= 96 registers fits (12288). Whether each
arm's CTAs fit is computed from the compiled binaries and printed.

Per case (model/layout/S, uniform routing, rank 0's workload): every variant's output
equals the partition's bit for bit (output poisoned first). ABBA-interleaved, per
variant: GEMM2 alone on all SMs, GatherRS alone (flags preset), the overlapped
kernels (host work done once), with and without tail helpers; torch's GEMM2 alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from benchlib import abba, env_info, summarize, without_samples, write_json  # noqa: E402
from workloads import OpCase, rank_inputs  # noqa: E402

from megatron_overlap.ops import OverlapConfig, gemm2_gather_rs  # noqa: E402
from megatron_overlap.ops.config import GPU_TILES, INTERPRET_TILES  # noqa: E402
from megatron_overlap.ops.op import plan_cache_of, prepare  # noqa: E402

R = dataclasses.replace
CASES = ["qwen/TP2EP1/16384", "qwen/TP2EP1/4096", "deepseek/TP2EP1/16384",
         "granite/TP2EP1/16384", "qwen/TP1EP2/16384", "deepseek/TP1EP2/4096"]
REGS, SMEM, THREADS = 65536, 233472, 2048  # per H200 SM (228 KB shared, 1 KB per CTA reserved)


def cta_footprint(res: dict, warps: int) -> tuple[int, int]:
    """(registers, shared bytes) one resident CTA takes: registers go per warp in units
    of 256, shared memory with the 1 KB the driver reserves per CTA."""
    per_warp = -(-res["registers"] * 32 // 256) * 256
    return warps * per_warp, res["shared"] + 1024


def fits(buf, key, gemm_ctas: int) -> dict:
    """Whether `gemm_ctas` GEMM2 CTAs and one GatherRS CTA fit on one SM together."""
    res = getattr(buf, "resources_of", {}).get(key)
    if not res:
        return dict(fits=None)
    g_regs, g_smem = cta_footprint(res["gemm2"], res["gemm2"]["warps"])
    c_regs, c_smem = cta_footprint(res["gather_rs"], res["gather_rs"]["warps"])
    regs, smem = gemm_ctas * g_regs + c_regs, gemm_ctas * g_smem + c_smem
    return dict(fits=regs <= REGS and smem <= SMEM, regs=regs, smem=smem, **res)


def arms(inp, variants: dict, cset, backend, sms_override=None):
    args = (inp["x"], inp["weight"], inp["counts_list"], inp["token_index"], inp["tokens"],
            inp["topk"], None, None)
    out = torch.empty(inp["tokens"], inp["hidden"], dtype=inp["x"].dtype, device=inp["x"].device)
    y = torch.randn(inp["x"].shape[0], inp["hidden"], device=out.device).to(out.dtype)
    pol, facts, checks, bufs = {}, {}, {}, []
    for name, t in variants.items():
        cfg = OverlapConfig(tiles=t, backend=backend)
        launch = prepare(*args, config=cfg)
        buf, cache = launch.buffer, plan_cache_of(launch)
        bufs.append(buf)
        sms = sms_override or cache.device.available_sms
        all_sms = launch.plan._replace(compute_slots=cache.kernel.o_comp * sms)

        def run(plan, _l=launch, _b=buf, **kw):
            kwargs = {**_l.kwargs, **kw}
            return lambda: _b.launch(inp["x"], inp["weight"], _l.counts_dev, _l.table, None,
                                     out, plan=plan, **kwargs)

        pol[f"{name} | gemm2 alone"] = run(all_sms, phases=("gemm2",))
        if name == "partition":
            pol[f"{name} | overlap planner C={launch.plan.comm_ctas}"] = run(launch.plan)
            pol[f"{name} | whole op"] = lambda _c=cfg: gemm2_gather_rs(*args, config=_c)
            checks[name] = run(launch.plan)
        else:
            for c in cset:
                plan = all_sms._replace(comm_ctas=c, reservation=0)
                pol[f"{name} | comm alone C={c}"] = run(plan, phases=("comm",), y=y)
                pol[f"{name} | overlap C={c} H={sms}"] = run(plan, helpers=sms)
                pol[f"{name} | overlap C={c} H=0"] = run(plan, helpers=0)
            checks[name] = run(all_sms._replace(comm_ctas=cset[-1], reservation=0), helpers=sms)
        slots = 1 << (inp["topk"] - 1).bit_length()
        family = (launch.kwargs["tiles"], launch.kwargs["comm_tm"], launch.kwargs["comm_tn"], slots)
        facts[name] = dict(planner_c=launch.plan.comm_ctas, splits=launch.plan.splits,
                           o_comp=cache.kernel.o_comp,
                           comm_tile=(launch.kwargs["comm_tm"], launch.kwargs["comm_tn"]),
                           **fits(buf, family, cache.kernel.o_comp))
    if backend == "triton":
        from megatron_overlap.ops.reference import grouped_mm

        w_t = inp["weight"].transpose(1, 2)
        counts = torch.tensor(inp["counts_list"], device=out.device, dtype=torch.int32)
        pol["torch gemm2 alone"] = lambda: grouped_mm(inp["x"], w_t, counts, inp["counts_list"])
    return pol, facts, checks, out, bufs


def drop_failing(pol: dict, bufs, device, repeats: int = 1, sync: bool = True) -> dict:
    """Run every policy `repeats` times (the warm-up), synchronized after each call unless
    not `sync`, and checked: one that times out (or fails) is reported and left out of
    the timing instead of stopping the run."""
    from megatron_overlap.ops.buffer import OverlapTimeoutError

    failed = {}
    for name in list(pol):
        try:
            for _ in range(repeats):
                pol[name]()
                if device == "cuda" and sync:
                    torch.cuda.synchronize()
            if device == "cuda":
                torch.cuda.synchronize()
            for b in bufs:
                b.check()
                # (direct launches do not record a pending check: read the sticky word)
                if int(b.error[0]):
                    raise OverlapTimeoutError(f"error word {int(b.error[0]):#x}")
        except (OverlapTimeoutError, RuntimeError, ValueError) as err:
            failed[name] = f"{type(err).__name__}: {str(err)[:300]}"
            print(f"  FAILED {name}: {failed[name]}")
            del pol[name]
            for b in {id(b): b for b in bufs}.values():
                b.reset()
    return failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--cset", default="132", help="GatherRS CTAs of the shared arm")
    ap.add_argument("--comm", default="32x512,32x1024,16x1024",
                    help="rows x columns per item, one shared arm each (comma list)")
    ap.add_argument("--gemm", default="triton,gluon",
                    help="GEMM2 kernels of the shared arms (gluon: TP layouts only)")
    ap.add_argument("--gluon-maxnreg", type=int, default=104,
                    help="register cap of the Gluon GEMM2 in a shared arm, and of GatherRS beside it")
    ap.add_argument("--gluon-comm-maxnreg", type=int, default=96)
    ap.add_argument("--gemm-maxnreg", type=int, default=0,
                    help="register cap of the shared arm's Triton GEMM2 (0: its own)")
    ap.add_argument("--comm-maxnreg", type=int, default=160)
    ap.add_argument("--ep-gemm-maxnreg", type=int, default=200,
                    help="the same caps where y stays in row order (EP: GEMM2 228 registers)")
    ap.add_argument("--ep-comm-maxnreg", type=int, default=112)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--probe-unsynced", action="store_true",
                    help="also run each policy 3 times back to back without a sync")
    ap.add_argument("--json", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU check: interpreter, tiny shape")
    args = ap.parse_args()
    items = [tuple(int(v) for v in c.split("x")) for c in args.comm.split(",") if c]
    backend, device, base, sms = "triton", "cuda", GPU_TILES, None
    if args.smoke:
        backend, device, base, sms = "interpret", "cpu", INTERPRET_TILES, 4
        args.cases, args.cset, args.samples, args.warmup = "tiny/TP2EP1/16,tiny/TP1EP2/16", "2,4", 2, 1
        items = [(8, 16)]
    elif not torch.cuda.is_available():
        print("try_shared_sms: needs a CUDA GPU (or --smoke)")
        return 2
    cset = [int(c) for c in args.cset.split(",")]
    results = []
    for spec in args.cases.split(","):
        model, layout, seq = spec.split("/")
        inp = rank_inputs(OpCase(model, layout, int(seq), "uniform"), 0, device)
        token_major = inp["x"].shape[0] == inp["tokens"] * inp["topk"]
        gemm_cap = args.gemm_maxnreg if token_major else args.ep_gemm_maxnreg
        comm_cap = args.comm_maxnreg if token_major else args.ep_comm_maxnreg
        variants = {"partition": base}
        for gemm in ([base.gemm_impl] if args.smoke else args.gemm.split(",")):
            if gemm == "gluon" and not token_major:
                continue
            caps = ((args.gluon_maxnreg, args.gluon_comm_maxnreg) if gemm == "gluon"
                    else (gemm_cap or None, comm_cap))
            for rows, tn in items:
                variants[f"shared {gemm} {rows}x{tn}"] = R(
                    base, comm_warps=4, comm_rows=rows, comm_tn=tn, gemm_impl=gemm,
                    comm_maxnreg=None if args.smoke else caps[1],
                    gemm_maxnreg=None if args.smoke else caps[0])
        ref = gemm2_gather_rs(inp["x"], inp["weight"], inp["counts_list"], inp["token_index"],
                              inp["tokens"], inp["topk"], None, None,
                              config=OverlapConfig(backend="reference")).float()
        pol, facts, checks, out, bufs = arms(inp, variants, cset, backend, sms)
        first = None
        for name, check in checks.items():
            out.fill_(float("nan"))  # poisoned: every element must be written
            if drop_failing({name: check}, bufs, device):
                facts[name].update(bitwise_as_partition=False, unwritten=-1, rel_err=float("nan"))
                continue
            got = out.clone()
            first = got if first is None else first
            facts[name].update(bitwise_as_partition=bool(torch.equal(got, first)),
                               unwritten=int(torch.isnan(got).sum()),
                               rel_err=float((got.float() - ref).norm() / ref.norm()))
        print(spec, {n: {k: f.get(k) for k in ("fits", "regs", "smem", "gemm2", "gather_rs",
                                               "bitwise_as_partition", "unwritten")}
                     for n, f in facts.items()}, flush=True)
        failed = drop_failing(pol, bufs, device, repeats=args.warmup)
        if args.probe_unsynced:  # the same calls back to back, no sync between them
            unsynced = drop_failing(dict(pol), bufs, device, repeats=3, sync=False)
            print(f"  unsynced repeats failed: {sorted(unsynced)}", flush=True)
            failed.update({f"unsynced {k}": v for k, v in unsynced.items()})
        try:  # (warmed up above, synchronized: each timed call is synchronized too)
            stats = summarize(abba(pol, args.samples, 0, None, progress=spec))
            for b in bufs:
                b.check()
        except Exception as err:  # noqa: BLE001 - a time-out in one case, not the run
            print(f"  FAILED timing {spec}: {type(err).__name__}: {str(err)[:300]}")
            results.append(dict(case=spec, facts=facts, failed=failed, timing_error=str(err)))
            for b in {id(b): b for b in bufs}.values():
                b.reset()
            continue
        results.append(dict(case=spec, facts=facts, failed=failed, stats=without_samples(stats)))
        report(spec, facts, stats)
    write_json(args.json, dict(env=env_info(), command=" ".join(sys.argv), results=results))
    return 0


def report(spec, facts, stats) -> None:
    print(f"\n{spec}")
    for name, f in facts.items():
        print(f"  {name}: C*={f['planner_c']} L={f['splits']} o_comp={f['o_comp']} "
              f"comm tile={f['comm_tile']} fits={f.get('fits')} regs={f.get('regs')} "
              f"smem={f.get('smem')} bitwise={f['bitwise_as_partition']} "
              f"unwritten={f['unwritten']} rel_err={f['rel_err']:.2e}")
    for key, s in stats.items():
        print(f"  {key:44} {s['median']:8.3f} ms  [{s['ci_low']:.3f}, {s['ci_high']:.3f}]")


if __name__ == "__main__":
    sys.exit(main())
