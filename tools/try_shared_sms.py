"""Experiment: GatherRS CTAs beside GEMM2's on every SM, against SMs set aside for them.

    python tools/try_shared_sms.py --json out/exp_shared_sms.json        # one GPU
    python tools/try_shared_sms.py --smoke                               # CPU, interpreter

The partition placement (the paper's scheme, `PARTITION_TILES`): C communication CTAs
of 32 warps take R(C) SMs whole and GEMM2 runs on the G - R(C) others. What bounded the
overlapped operator there is GEMM2 on those fewer SMs (docs/RESULTS.md, "What limits us
now"), while the communication side is latency-bound loads that use little of an SM.
The shared placement (`TileConfig.placement = "shared"`, the default `GPU_TILES` since
session 8): GEMM2 keeps all G SMs (P = o_comp G) and one 4-warp GatherRS CTA sits beside
its two CTAs on each SM, in the registers (capped) and shared memory they leave; the
GatherRS binaries ask for the largest shared-memory carveout, without which an SM
running one takes no GEMM2 CTA (a time-out: `docs/data/exp_shared_sms_s8_deadlock.json`).

Per case (model/layout/S, uniform routing, rank 0's workload): every arm's output equals
the partition's bit for bit (output poisoned first). Each policy is warmed up and
checked on its own, synchronized (a time-out is reported and the policy left out), then
ABBA-interleaved: GEMM2 alone on all SMs, the overlapped kernels at the planner's C and
(shared arms) at each C of --cset, GatherRS alone (flags preset), the whole op, and
torch's GEMM2 alone. The shared placement launches GEMM2 first; its "comm first" arm
runs the same plan with GatherRS launched first (the partition's order), --splits
adds shared arms at other L than the ranked one, --helpers arms with m tail
helpers per SM instead of one (the exposed last split served with more loads in flight),
and --last-cols arms whose last split is narrowed to about that many columns (the
others wider: less communication left after GEMM2 without more splits).
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
from megatron_overlap.ops.config import GPU_TILES, INTERPRET_TILES, PARTITION_TILES  # noqa: E402
from megatron_overlap.ops.op import prepare  # noqa: E402
from megatron_overlap.ops.planning import plan_cache_of  # noqa: E402

R = dataclasses.replace
CASES = ["qwen/TP2EP1/16384", "qwen/TP2EP1/4096", "deepseek/TP2EP1/16384",
         "granite/TP2EP1/16384", "qwen/TP1EP2/16384", "deepseek/TP1EP2/4096"]


def narrow_last_width(hidden: int, splits: int, last_cols: int, block_n: int) -> int | None:
    """The split width sw (a multiple of `block_n`) that leaves the last of `splits`
    splits about `last_cols` columns, or None where none does (L = 1, or too wide)."""
    if splits < 2 or last_cols >= -(-hidden // splits):
        return None
    width = -(-(hidden - last_cols) // ((splits - 1) * block_n)) * block_n
    return width if 0 < hidden - (splits - 1) * width <= width else None


def arms(inp, variants: dict, cset, backend, helper_mults=(), last_cols=()):
    args = (inp["x"], inp["weight"], inp["counts_list"], inp["token_index"], inp["tokens"],
            inp["topk"], None, None)
    out = torch.empty(inp["tokens"], inp["hidden"], dtype=inp["x"].dtype, device=inp["x"].device)
    y = torch.randn(inp["x"].shape[0], inp["hidden"], device=out.device).to(out.dtype)
    pol, facts, checks, bufs = {}, {}, {}, []
    for name, (t, splits) in variants.items():
        cfg = OverlapConfig(tiles=t, backend=backend, splits=splits)
        launch = prepare(*args, config=cfg)
        buf, cache = launch.buffer, plan_cache_of(launch)
        if buf not in bufs:  # (the arms share one buffer per device)
            bufs.append(buf)
        all_sms = launch.plan._replace(compute_slots=cache.kernel.o_comp * cache.device.available_sms)

        def run(lau, plan=None, _b=buf, **kw):
            kwargs = {**lau.kwargs, **kw}
            return lambda: _b.launch(inp["x"], inp["weight"], lau.counts_dev, lau.table, None,
                                     out, plan=plan or lau.plan, **kwargs)

        pol[f"{name} | gemm2 alone"] = run(launch, all_sms, phases=("gemm2",))
        pol[f"{name} | overlap planner C={launch.plan.comm_ctas}"] = run(launch)
        pol[f"{name} | comm alone C={launch.plan.comm_ctas}"] = run(launch, phases=("comm",), y=y)
        pol[f"{name} | whole op"] = lambda _c=cfg: gemm2_gather_rs(*args, config=_c)
        checks[name] = run(launch)
        if cache.kernel.shared_sms and splits is None:  # the launch order, same plan
            pol[f"{name} | overlap planner C={launch.plan.comm_ctas} comm first"] = run(
                launch, comm_first=True)
            checks[f"{name} comm first"] = run(launch, comm_first=True)
            facts[f"{name} comm first"] = dict(plan_of=name)
        for lc in last_cols if cache.kernel.shared_sms else ():
            # splits 0..L-2 wider, the last narrower: less of GatherRS left after GEMM2
            width = narrow_last_width(inp["hidden"], launch.plan.splits, lc,
                                      launch.kwargs["tiles"].block_n)
            if width is None:
                continue
            last = inp["hidden"] - (launch.plan.splits - 1) * width
            label = f"{name} last={last}"
            pol[f"{name} | overlap planner C={launch.plan.comm_ctas} last split {last} cols"] = \
                run(launch, width=width)
            checks[label] = run(launch, width=width)
            facts[label] = dict(plan_of=name, width=width, last=last)
        for m in helper_mults if cache.kernel.shared_sms and launch.kwargs["helpers"] else ():
            # m tail-helper CTAs per SM that GEMM2 leaves (the binary's registers fit up
            # to four beside the communication CTA): more loads in flight for the
            # exposed last split
            h = m * launch.kwargs["helpers"]
            label = f"{name} H={m}xG"
            pol[f"{name} | overlap planner C={launch.plan.comm_ctas} H={m}xG"] = run(
                launch, helpers=h)
            checks[label] = run(launch, helpers=h)
            facts[label] = dict(plan_of=name, helpers=h)
        if cache.kernel.shared_sms:
            for c in cset:
                pol[f"{name} | overlap C={c}"] = run(prepare(*args, comm_ctas=c, config=cfg))
        facts.setdefault(name, {}).update(planner_c=launch.plan.comm_ctas, splits=launch.plan.splits,
                           o_comp=cache.kernel.o_comp, shared_sms=cache.kernel.shared_sms,
                           helpers=launch.kwargs["helpers"],
                           comm_tile=(launch.kwargs["comm_tm"], launch.kwargs["comm_tn"]),
                           resources=dict(buf.resources_of.get(
                               (launch.kwargs["tiles"], launch.kwargs["comm_tm"],
                                launch.kwargs["comm_tn"], 1 << (inp["topk"] - 1).bit_length()),
                               {})))
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
    from megatron_overlap.ops import OverlapTimeoutError

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
            for b in bufs:
                b.reset()
    return failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--cset", default="66", help="more C for the shared arms (<= G)")
    ap.add_argument("--comm", default="16x1024",
                    help="more shared arms: rows x columns per item (comma list)")
    ap.add_argument("--splits", default="",
                    help="more shared arms: L instead of the ranked one (comma list)")
    ap.add_argument("--helpers", default="",
                    help="more shared arms: tail helpers per SM GEMM2 leaves (comma list; "
                         "the op launches 1)")
    ap.add_argument("--last-cols", default="",
                    help="more shared arms: the last split narrowed to about this many "
                         "columns, the others wider (comma list)")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--probe-unsynced", action="store_true",
                    help="also run each policy 3 times back to back without a sync")
    ap.add_argument("--json", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU check: interpreter, tiny shape")
    args = ap.parse_args()
    items = [tuple(int(v) for v in c.split("x")) for c in args.comm.split(",") if c]
    backend, device, shared, partition = "triton", "cuda", GPU_TILES, PARTITION_TILES
    if args.smoke:
        backend, device = "interpret", "cpu"
        shared, partition = R(INTERPRET_TILES, placement="shared"), INTERPRET_TILES
        if args.cases == ",".join(CASES):
            args.cases = "tiny/TP2EP1/16,tiny/TP1EP2/16"
        args.cset, args.samples, args.warmup = "4", 2, 1
        items = [(8, 16)] if args.comm else []
    elif not torch.cuda.is_available():
        print("try_shared_sms: needs a CUDA GPU (or --smoke)")
        return 2
    cset = [int(c) for c in args.cset.split(",") if c]
    helper_mults = [int(m) for m in args.helpers.split(",") if m]
    last_cols = [int(c) for c in args.last_cols.split(",") if c]
    results = []
    for spec in args.cases.split(","):
        model, layout, seq = spec.split("/")
        inp = rank_inputs(OpCase(model, layout, int(seq), "uniform"), 0, device)
        variants = {"partition": (partition, None), "shared": (shared, None)}
        for rows, tn in items:
            variants[f"shared {rows}x{tn}"] = (R(shared, comm_rows=rows, comm_tn=tn), None)
        for splits in (int(v) for v in args.splits.split(",") if v):
            variants[f"shared L={splits}"] = (shared, splits)
        ref = gemm2_gather_rs(inp["x"], inp["weight"], inp["counts_list"], inp["token_index"],
                              inp["tokens"], inp["topk"], None, None,
                              config=OverlapConfig(backend="reference")).float()
        pol, facts, checks, out, bufs = arms(inp, variants, cset, backend, helper_mults,
                                             last_cols)
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
            for b in bufs:
                b.reset()
            continue
        results.append(dict(case=spec, facts=facts, failed=failed, stats=without_samples(stats)))
        report(spec, facts, stats)
    write_json(args.json, dict(env=env_info(), command=" ".join(sys.argv), results=results))
    return 0


def report(spec, facts, stats) -> None:
    print(f"\n{spec}")
    for name, f in facts.items():
        if "plan_of" in f:
            how = (f"{f['helpers']} tail helpers" if "helpers" in f
                   else f"split width {f['width']}, last split {f['last']} columns"
                   if "width" in f else "GatherRS launched before GEMM2")
            print(f"  {name}: {f['plan_of']}'s plan, {how} "
                  f"bitwise={f['bitwise_as_partition']} unwritten={f['unwritten']}")
            continue
        res = {k: (v.get("registers"), v.get("shared")) for k, v in f["resources"].items()}
        print(f"  {name}: C*={f['planner_c']} L={f['splits']} shared={f['shared_sms']} "
              f"H={f['helpers']} comm tile={f['comm_tile']} (registers, shared) {res} "
              f"bitwise={f['bitwise_as_partition']} unwritten={f['unwritten']} "
              f"rel_err={f['rel_err']:.2e}")
    for key, s in stats.items():
        print(f"  {key:44} {s['median']:8.3f} ms  [{s['ci_low']:.3f}, {s['ci_high']:.3f}]")


if __name__ == "__main__":
    sys.exit(main())
