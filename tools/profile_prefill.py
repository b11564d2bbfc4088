"""Where a prefill's time goes, stock and overlapped: GPU time inside and outside the MoE layers.

    torchrun --nproc-per-node 1 tools/profile_prefill.py --model qwen --seq 16384 \
        --json out/profile_prefill_qwen.json

The layer benchmark times one MoE layer alone; a prefill runs it between attention
blocks, and on one H200 the prefill saved less than the layer benchmark predicts
(Qwen S = 16384: 91 ms predicted over 24 layers, 38 ms seen). This profiles one whole
forward per arm (after a warm-up of each) and attributes every GPU kernel to the MoE
layer whose host range launched it (the profiler's correlation ids link each kernel to
its launch) or to "the rest": per arm, the kernel time and the span (first kernel start
to last kernel end) of each MoE layer, and the kernel time of the rest of the model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from bench_layer import add_fuse_arg, layer_policy  # noqa: E402
from benchlib import env_info, write_json  # noqa: E402
from power import sampled  # noqa: E402
from profile_layer import kind_of  # noqa: E402

from megatron_overlap.mcore import prefill  # noqa: E402
from megatron_overlap.mcore.convert import set_overlap_enabled  # noqa: E402
from megatron_overlap.mcore.layer import OverlapMoELayer  # noqa: E402
from megatron_overlap.mcore.models import build_model  # noqa: E402
from megatron_overlap.ops import OverlapConfig  # noqa: E402

MARK = "megatron_overlap.moe_layer"


def attribute(trace: dict, top: int = 12) -> dict:
    """{"layers": [{"kernel_ms", "span_ms"} per marked MoE layer range, in order],
    "rest_kernel_ms", "wall_ms", "rest_kinds" (ms by `profile_layer.KINDS`), "rest_top"
    (the `top` kernels of the rest by total ms)} of one profiled forward."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    marks = sorted((e for e in events if e.get("name") == MARK
                    and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    # (Triton's launcher and the op's event calls go through the driver API)
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "correlation" in e.get("args", {})}
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not marks or not kernels:
        raise ValueError(f"found {len(marks)} marked MoE layers and {len(kernels)} GPU "
                         "events (was CUDA profiled?)")
    layers = [dict(kernel_us=0.0, first=None, last=None) for _ in marks]
    rest, rest_kinds, rest_names = 0.0, {}, {}
    for k in kernels:
        launched = launches.get(k.get("args", {}).get("correlation"))
        owner = None
        if launched is not None:
            for i, m in enumerate(marks):
                if m["ts"] <= launched <= m["ts"] + m["dur"]:
                    owner = layers[i]
                    break
        if owner is None:
            rest += k["dur"]
            kind = kind_of(k["name"])
            rest_kinds[kind] = rest_kinds.get(kind, 0.0) + k["dur"]
            rest_names[k["name"]] = rest_names.get(k["name"], 0.0) + k["dur"]
            continue
        owner["kernel_us"] += k["dur"]
        owner["first"] = k["ts"] if owner["first"] is None else min(owner["first"], k["ts"])
        end = k["ts"] + k["dur"]
        owner["last"] = end if owner["last"] is None else max(owner["last"], end)
    wall = max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)
    return dict(
        layers=[dict(kernel_ms=l["kernel_us"] / 1e3,
                     span_ms=0.0 if l["first"] is None else (l["last"] - l["first"]) / 1e3)
                for l in layers],
        rest_kernel_ms=rest / 1e3, wall_ms=wall / 1e3,
        rest_kinds={k: v / 1e3 for k, v in sorted(rest_kinds.items(), key=lambda kv: -kv[1])},
        rest_top={n[:100]: v / 1e3 for n, v in sorted(rest_names.items(),
                                                     key=lambda kv: -kv[1])[:top]})


def _mark_moe_layers(model) -> None:
    """Wrap every OverlapMoELayer's forward in a profiler range named MARK."""
    for layer in (m for m in model.modules() if isinstance(m, OverlapMoELayer)):
        forward = layer.forward

        def marked(*args, _forward=forward, **kwargs):
            with torch.profiler.record_function(MARK):
                return _forward(*args, **kwargs)
        layer.forward = marked


def profile_forward(model, tokens, positions, cprofile: bool = False,
                    sampled_forwards: int = 3) -> dict:
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        with torch.no_grad():
            model(tokens, positions, None)
        torch.cuda.synchronize()
    clocks = _clocks()  # right after the forward, while the GPU still runs at its load

    def forwards():
        for _ in range(sampled_forwards):
            model(tokens, positions, None)
        torch.cuda.synchronize()
    clocks["during_unprofiled_forward"] = sampled(forwards, calls=sampled_forwards,
                                                   unit="forward")
    clocks["host"] = host_timing(lambda: model(tokens, positions, None))
    if cprofile:
        clocks["cprofile"] = cprofile_forward(lambda: model(tokens, positions, None))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return attribute(json.load(f)) | clocks


def host_syncs(fn):
    """(fn(), the host syncs during it), counted as `--host-costs` counts them
    (megatron_overlap.mcore.host_costs)."""
    from megatron_overlap.mcore.host_costs import host_syncs as counted

    return counted(fn)


def host_timing(forward) -> dict:
    """One unprofiled forward (no_grad): when the host returned from it (`host_ms`: the
    launches queued, every host sync inside waited out) and when the GPU finished
    (`total_ms`); and a second one's host syncs (`host_syncs`). host_ms close to
    total_ms: the host or its syncs bound the forward; far below: the GPU does."""
    import time

    torch.cuda.synchronize()
    with torch.no_grad():
        t0 = time.perf_counter()
        forward()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        _, syncs = host_syncs(forward)
    torch.cuda.synchronize()
    return dict(host_ms=(t1 - t0) * 1e3, total_ms=(t2 - t0) * 1e3, host_syncs=syncs)


def cprofile_forward(forward, top: int = 30) -> dict:
    """One forward (no_grad) under cProfile: the `top` functions by own time and by
    cumulative time (ms, inflated alike by the profiler), where the host's time goes;
    a host sync's wait shows as the own time of the call that waited."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    torch.cuda.synchronize()
    with torch.no_grad():
        prof.enable()
        forward()
        prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats

    def rows(key):
        return [dict(fn=f"{os.path.basename(f)}:{line}:{name}", calls=v[1],
                     own_ms=round(v[2] * 1e3, 3), cum_ms=round(v[3] * 1e3, 3))
                for (f, line, name), v in sorted(stats.items(), key=key)[:top]]
    return dict(by_own=rows(lambda kv: -kv[1][2]), by_cum=rows(lambda kv: -kv[1][3]))


def _clocks() -> dict:
    """The SM clock (MHz) and power draw (mW) now, through NVML (nvidia-ml-py)."""
    try:
        return dict(sm_clock_mhz=torch.cuda.clock_rate(), power_mw=torch.cuda.power_draw())
    except Exception as e:  # noqa: BLE001 - no NVML: the profile stands without them
        return dict(clocks_error=str(e)[:100])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen")
    ap.add_argument("--seqs", default="4096,16384")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    add_fuse_arg(ap, default="auto")  # the product's prefill: the planner decides
    ap.add_argument("--host-counts", action="store_true",
                    help="LayerPolicy(host_counts=True): the layers wait for their counts")
    ap.add_argument("--cprofile", action="store_true",
                    help="also one forward per arm under cProfile (the host's functions)")
    ap.add_argument("--sampled-forwards", type=int, default=3,
                    help="unprofiled forwards in the window whose clock, clock reasons and "
                         "energy are sampled (NVML's energy counter does not resolve windows "
                         "under about a second: make it that long)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.sampled_forwards < 1:
        ap.error(f"--sampled-forwards must be >= 1, got {args.sampled_forwards}")
    setup = argparse.Namespace(tp=1, ep=1, seed=0, preload=None, batch=args.batch)
    device = prefill._setup(setup)
    model = build_model(args.model, 1, 1, overlap=OverlapConfig.from_env(),
                        policy=layer_policy(args, host_counts=args.host_counts)).to(
        device).eval()
    _mark_moe_layers(model)
    results = []
    for seq in map(int, args.seqs.split(",")):
        tokens, positions = prefill._inputs(setup, seq, model.vocab_size, device)
        row = dict(model=args.model, seq=seq, batch=args.batch)
        for arm in ("stock", "overlap"):
            set_overlap_enabled(model, arm == "overlap")
            with torch.no_grad():
                for _ in range(args.warmup):
                    model(tokens, positions, None)
            row[arm] = profile_forward(model, tokens, positions, args.cprofile,
                                       args.sampled_forwards)
        results.append(row)
        if dist.get_rank() == 0:
            _print(row)
    if dist.get_rank() == 0:
        write_json(args.json, dict(env=env_info(), command=" ".join(sys.argv), results=results))
    return 0


def _print(row: dict) -> None:
    st, ov = row["stock"], row["overlap"]
    print(f"== {row['model']} S={row['seq']} B={row['batch']}: GPU wall stock "
          f"{st['wall_ms']:.1f} ms, overlap {ov['wall_ms']:.1f} ms")
    for name, key in (("MoE kernel time", "kernel_ms"), ("MoE span", "span_ms")):
        a = sum(l[key] for l in st["layers"])
        b = sum(l[key] for l in ov["layers"])
        print(f"  {name} over {len(st['layers'])} layers: stock {a:.1f}, overlap {b:.1f}, "
              f"saved {a - b:.1f} ms")
    print(f"  the rest's kernel time: stock {st['rest_kernel_ms']:.1f}, overlap "
          f"{ov['rest_kernel_ms']:.1f} ms; SM clock after the forward {st.get('sm_clock_mhz')}"
          f" / {ov.get('sm_clock_mhz')} MHz, power {st.get('power_mw')} / {ov.get('power_mw')}"
          " mW")
    for arm in ("stock", "overlap"):
        h = row[arm].get("host", {})
        if h:
            print(f"  {arm}: unprofiled forward {h['total_ms']:.1f} ms, the host back from it "
                  f"at {h['host_ms']:.1f} ms, {h['host_syncs']} host syncs")
        for r in row[arm].get("cprofile", {}).get("by_cum", [])[:25]:
            print(f"    {arm} cProfile cum {r['cum_ms']:9.2f} own {r['own_ms']:8.2f} ms "
                  f"{r['calls']:6d}x {r['fn'][:90]}")
        for r in row[arm].get("cprofile", {}).get("by_own", [])[:25]:
            print(f"    {arm} cProfile own {r['own_ms']:8.2f} ms {r['calls']:6d}x {r['fn'][:90]}")
        d = row[arm].get("during_unprofiled_forward", {})
        if d:
            print(f"  {arm}: during a forward SM clock mean {d['sm_clock_mhz_mean']:.0f} MHz "
                  f"(min {d['sm_clock_mhz_min']}), power mean {d['power_mw_mean'] / 1e3:.0f} W, "
                  f"{d['samples']} samples")
            if "energy_j_per_forward" in d:
                print(f"  {arm}: {d['ms_per_forward']:.1f} ms and "
                      f"{d['energy_j_per_forward']:.1f} J a forward ({d['forwards']} "
                      f"forwards), {d['power_w_from_energy']:.0f} W from the energy counter")
            if "clock_reasons" in d:
                set_ = {k: v for k, v in d["clock_reasons"].items() if v}
                print(f"  {arm}: clock event reasons (share of samples) "
                      + (", ".join(f"{k} {v:.0%}" for k, v in set_.items()) or "none")
                      + f", temperature max {d['temperature_c_max']} C")
    for kind, ms in st["rest_kinds"].items():
        print(f"    rest {kind:<34} {ms:8.2f} -> {ov['rest_kinds'].get(kind, 0.0):8.2f} ms")
    for name, ms in st["rest_top"].items():
        print(f"      {ms:8.2f} -> {ov['rest_top'].get(name, 0.0):8.2f} {name[:80]}")
    for i, (a, b) in enumerate(zip(st["layers"], ov["layers"])):
        print(f"    MoE layer {i}: span {a['span_ms']:.2f} -> {b['span_ms']:.2f}, kernels "
              f"{a['kernel_ms']:.2f} -> {b['kernel_ms']:.2f} ms")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
