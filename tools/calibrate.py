"""One-time calibration of the planner for a device and kernel family (paper III-C).

    torchrun --nproc-per-node 2 tools/calibrate.py --name h200 --json out/h200.json

(`tools/device_run.sh calibrate` names the file after the GPU: h100, h200.) The host terms
of the fuse-or-not model's step costs are not measured here: they are carried from the
device's shipped file, and a new device's are fitted on prefill sweeps
(`tools/fit_fusion.py fit`).

At a fixed large C on one reference workload it times
  * GEMM2 alone on P(C) programs: t_comp, the time of one cumulative compute wave;
  * the overlapped operator at that C and a fixed L: T_meas;
  * GatherRS alone (flags preset, no waiting) for C = 1..64, fitted (weighted least
    squares on relative error) as t(C) = t0 + t_comm * L * ceil(W_comm/C): t_comm is one
    communication wave, t0 the part more CTAs never remove (bandwidth, barrier, final
    sum), restated as the planner's C_sat = t_comm * L * W_comm / t0 (recorded; in the
    preset only with --with-c-sat).
  * GEMM2 alone at K/2 (same tiles and waves): with the time at K, the per-wave part
    that does not scale with K, K_epi (t = b (K + K_epi)), and the case's top-k as
    topk_ref: the planner then scales rho with (K_ref + K_epi)/(K + K_epi) and with the
    rows a communication tile moves, (k + 1)/(topk_ref + 1).
  * the overlapped operator (tail helpers on) at the op's split count for the case and a
    sweep of C: the overlap factor f, the one number the model cannot get from either
    kernel alone (the splits served while GEMM2 runs cost f rho), is the f whose model
    T(C) (in compute waves, plus one constant for launch, barrier and final sum) fits
    the measured curve best (least squares on relative error). On H200 this one-case
    f (1.34) planned worse than f = 1.7 fitted on sweeps over all three models
    (two H200s: 5.4% mean regret against 1.6%-1.7%; docs/RESULTS.md, "Calibration"),
    which the shipped file keeps.
rho_ref = t_comm / t_comp, the contention-free ratio. Also recorded, not shipped: the
paper's in-overlap fit (the rho for which the model's T(C_cal) equals T_meas). On H200
that fit is 3x larger, because it charges communication for the slowdown GEMM2 suffers
when the two share the GPU, and it drives C* to 32-56 where the measured optimum is
12-32 (two H200s, Qwen TP2EP1 S = 4096, the partition placement). C_max is the smallest C within 3% of the
fastest GatherRS alone.
o_comp / o_comm come from the compiled kernels' registers and shared memory. Never per
shape: once per device and kernel family.

    torchrun --nproc-per-node 1 tools/calibrate.py --fp8 block --json out/h200.json

`--fp8 tensor|block` adds the FP8 kernel family of that scaling kind to a calibration
(`--base`, default the shipped one of this device; one GPU suffices). Only GEMM2's side
changes with its operands: GatherRS reads the same bf16 y. So GEMM2 alone is timed on
the bf16 operands and on the same operands quantized as TE's recipe quantizes them
(`ops.quantize_fp8_operands`), side by side, and at K/2 on FP8 operands (K_epi); the FP8
family's rho_ref is the base's rho at this K and tile times t_bf16 / t_fp8 (the same
communication wave over the FP8 compute wave), its fuse-or-not wave the base's times
t_fp8 / t_bf16, the rest of its terms (C_max, f, the roofline) the base's.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from benchlib import abba, add_run_args, env_info, smoke_setup, write_json  # noqa: E402
from tune_tiles import phase_launch, tiles_from_json  # noqa: E402
from workloads import OpCase, rank_inputs  # noqa: E402

from megatron_overlap.ops import (OverlapConfig, default_session,  # noqa: E402
                                  quantize_fp8_operands)
from megatron_overlap.planner import (Calibration, DeviceSpec, Fp8Family,  # noqa: E402
                                      KernelSpec, Preset, Workload, get_preset, makespan,
                                      plan, preset_for_device)


def phase_timer(inp, group, c: int, phases, splits: int, backend: str, tiles=None):
    cfg = OverlapConfig.from_env(backend=backend, tiles=tiles)
    session = default_session(group, inp["x"].device)
    launch = session.prepare(
        inp["x"], inp["weight"], inp["counts_list"], inp["token_index"], inp["tokens"],
        inp["topk"], comm_ctas=c, splits=splits, config=cfg, scales=inp.get("scales"))
    out_dtype = torch.bfloat16 if "scales" in inp else inp["x"].dtype  # (FP8: bf16 out)
    out = torch.empty(inp["tokens"] // launch.world, inp["hidden"], dtype=out_dtype,
                      device=inp["x"].device)
    y = torch.randn(inp["x"].shape[0], inp["hidden"], device=inp["x"].device).to(out_dtype)
    return phase_launch(session, launch, inp, phases, out, y), launch


def model_curve(launch, inp, calib) -> dict[int, float]:
    """{C: T(C)} in compute waves under `calib` for a prepared launch's workload, L and
    kernel (tail helpers as the launch runs them)."""
    cache = launch.launch_plan.cache
    w = Workload(inp["tokens"], inp["hidden"], inp["ffn"], launch.world,
                 launch.launch_plan.splits, inp["counts_list"], topk=inp["topk"],
                 local_topk=round(4 * inp["x"].shape[0] / inp["tokens"]) / 4)
    return dict(plan(w, cache.kernel, cache.device, calib).curve)


def solve_rho(t_waves: float, w_comp: int, w_comm: int, p: int, c: int, splits: int,
              c_sat: float | None = None) -> float:
    """The rho for which the model's T(c) equals `t_waves` (bisection; T grows with rho)."""
    lo, hi = 0.0, 1.0
    while makespan(w_comp, w_comm, p, c, splits, hi, c_sat) < t_waves and hi < 1e6:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        if makespan(w_comp, w_comm, p, c, splits, mid, c_sat) < t_waves:
            lo = mid
        else:
            hi = mid
    return max(hi, 1e-6)


def fit_saturation(times: dict[int, float], w_comm: int, splits: int):
    """(t0, t_wave, C_sat): t(C) = t0 + t_wave * L * ceil(W/C), least squares on relative
    error; C_sat = t_wave * L * W / t0 restates the intercept in the planner's terms,
    q = rho * (ceil(W/C) + W/C_sat) (None when there is no positive intercept)."""
    pts = [(splits * math.ceil(w_comm / c), t) for c, t in times.items()]
    wts = [1.0 / t ** 2 for _, t in pts]
    sw = sum(wts)
    mx = sum(w * x for w, (x, _) in zip(wts, pts)) / sw
    my = sum(w * y for w, (_, y) in zip(wts, pts)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, (x, _) in zip(wts, pts))
    slope = sum(w * (x - mx) * (y - my) for w, (x, y) in zip(wts, pts)) / sxx if sxx else 0.0
    if slope <= 0:
        raise RuntimeError(f"GatherRS times do not fall with C: {times}")
    t0 = my - slope * mx
    return t0, slope, (slope * splits * w_comm / t0 if t0 > 1e-6 * my else None)


F_GRID = tuple(1 + i / 50 for i in range(151))  # the overlap factors fitted over: 1 to 4


def fit_overlap_factor(times: dict[int, float], t_comp: float, curve_for,
                       grid=F_GRID) -> tuple[float, float, float]:
    """(f, t0, rms relative error): the f on `grid` whose model curve, t0 + t_comp *
    T(C; f), fits the measured overlapped times best; `curve_for(f)` gives {C: T(C)} in
    compute waves. t0 (>= 0) is the part no C changes (host launch work, barrier, sum)."""
    best = None
    for f in grid:
        model = curve_for(f)
        cs = [c for c in times if c in model]  # C past the curve's C_max: not modelled
        if not cs:
            continue
        xs = [t_comp * model[c] for c in cs]
        ys = [times[c] for c in cs]
        wts = [1.0 / y ** 2 for y in ys]
        t0 = max(0.0, sum(w * (y - x) for w, x, y in zip(wts, xs, ys)) / sum(wts))
        err = math.sqrt(sum(w * (x + t0 - y) ** 2 for w, x, y in zip(wts, xs, ys)) / len(ys))
        if best is None or err < best[2]:
            best = (f, t0, err)
    if best is None:
        raise ValueError(f"no measured C ({sorted(times)}) lies on the model's curve (C up "
                         f"to the calibration's C_max): nothing to fit the overlap factor to")
    return best


def fit_k_epi(k1: int, t1: float, k2: int, t2: float) -> float | None:
    """K_epi of t = b (K + K_epi) through two (K, time per compute wave) points: the part
    of a wave that does not shrink with K, in units of K. None unless time grows with K."""
    if (t1 - t2) * (k1 - k2) <= 0:
        return None
    return max(0.0, (t2 * k1 - t1 * k2) / (t1 - t2))


def half_k(inp: dict, step: int = 8) -> dict:
    """The case at half the reduction dim (rounded down to `step`, 16-byte rows of the
    operands the kernel reads: 8 bf16, 16 FP8): same tiles and waves."""
    k_half = inp["ffn"] // 2 // step * step
    if k_half == 0:
        raise SystemExit(f"calibrate: K = {inp['ffn']} has no half in multiples of {step}")
    return dict(inp, ffn=k_half, x=inp["x"][:, :k_half].contiguous(),
                weight=inp["weight"][..., :k_half].contiguous())


def quantized(inp: dict, kind: str) -> dict:
    x, weight, scales = quantize_fp8_operands(inp["x"], inp["weight"], inp["counts_list"], kind)
    return dict(inp, x=x, weight=weight, scales=scales)


def fp8_family(base: Preset, k: int, bf16_tile: tuple[int, int], fp8_tile: tuple[int, int],
               t_bf16: float, t_fp8: float, k_epi: float | None) -> Fp8Family:
    """The FP8 family of `base` from one compute wave of each family at K = `k` (any
    unit, the same for both): rho is the same communication wave over the FP8 compute
    wave, the fuse-or-not wave the base's scaled by t_fp8 / t_bf16."""
    b = base.calibration
    epi = b.k_epi or 0.0
    to_here = (b.k_ref + epi) / (k + epi) * (b.tm_ref * b.tn_ref) / (bf16_tile[0] * bf16_tile[1])
    calib = dataclasses.replace(b, rho_ref=round(b.rho_ref * to_here * t_bf16 / t_fp8, 4),
                                k_ref=k, tm_ref=fp8_tile[0], tn_ref=fp8_tile[1],
                                k_epi=None if k_epi is None else round(k_epi, 1))
    wave_us = (None if base.step_costs is None else
               round(base.step_costs.wave_us / to_here * t_fp8 / t_bf16, 3))
    return Fp8Family(calib, wave_us)


def calibrate_fp8(args, inp: dict, group, backend: str, tiles) -> dict:
    """--fp8 KIND: the base calibration with the FP8 family of that kind added (module
    docstring); the JSON payload."""
    base = get_preset(args.base) if args.base else preset_for_device(
        torch.cuda.get_device_name() if backend == "triton" else "")
    if base is None:
        raise SystemExit("calibrate --fp8: no shipped calibration for this device; make "
                         "the bf16 one first (without --fp8) and pass it as --base")
    fp8_inp, fp8_half = quantized(inp, args.fp8), quantized(half_k(inp, 16), args.fp8)
    fns, launches = {}, {}
    for name, case_inp in (("bf16", inp), ("fp8", fp8_inp), ("fp8 K/2", fp8_half)):
        fns[name], launches[name] = phase_timer(case_inp, group, args.c_cal, ("gemm2",),
                                                args.splits, backend, tiles)
    med = {n: statistics.median(v) for n, v in
           abba(fns, args.samples, args.warmup, group, progress="calibrate --fp8").items()}
    waves = {n: math.ceil(args.splits * h.plan.w_comp / h.plan.compute_slots)
             for n, h in launches.items()}
    wave = {n: med[n] / waves[n] for n in med}
    kernels = {n: launches[n].launch_plan.cache.kernel for n in ("bf16", "fp8")}
    k_epi = fit_k_epi(inp["ffn"], med["fp8"], fp8_half["ffn"], med["fp8 K/2"])
    family = fp8_family(base, inp["ffn"], *((kernels[n].tile_m, kernels[n].tile_n)
                                            for n in ("bf16", "fp8")),
                        wave["bf16"], wave["fp8"], k_epi)
    preset = dataclasses.replace(base, fp8={**base.fp8, args.fp8: family})
    if dist.get_rank() == 0:
        print(f"calibrate --fp8 {args.fp8}: GEMM2 wave {wave['bf16'] * 1e3:.2f} us bf16, "
              f"{wave['fp8'] * 1e3:.2f} us FP8 ({waves['bf16']} / {waves['fp8']} waves); "
              f"K_epi={k_epi}; rho_ref {base.calibration.rho_ref} -> "
              f"{family.calibration.rho_ref} at K={inp['ffn']}; fuse-or-not wave "
              f"{family.wave_us} us")
    return dict(preset=preset.to_json(), measured=dict(
        case=OpCase(args.model, args.layout, args.seq, "uniform").label(), fp8=args.fp8,
        base=base.name, k=inp["ffn"], ms=med, waves=waves, wave_us={n: w * 1e3 for n, w in wave.items()},
        k_epi=k_epi, resources={n: h.launch_plan.family.resources
                                for n, h in launches.items()}),
        env=env_info(), command=" ".join(sys.argv))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen")
    ap.add_argument("--layout", default="TP2EP1")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--c-cal", type=int, default=32, help="the fixed large C")
    ap.add_argument("--c-sweep", type=int, default=64)
    ap.add_argument("--splits", type=int, default=2)
    ap.add_argument("--overlap-splits", type=int, default=4,
                    help="L of the overlapped sweep that fits f (the op's L for the case)")
    ap.add_argument("--overlap-cset", default="4,6,8,12,16,20,24,28,32,40,48")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls of each side first")
    ap.add_argument("--name", default="h200")
    ap.add_argument("--fp8", choices=("tensor", "block"),
                    help="add the FP8 family of this scaling kind to --base (module docstring)")
    ap.add_argument("--base", help="--fp8: the calibration to extend, a preset name or JSON "
                                   "(default: the shipped one of this device)")
    ap.add_argument("--with-c-sat", action="store_true",
                    help="ship the fitted C_sat in the preset (it is always recorded); off "
                         "by default: on H200 it moved no decision (docs/RESULTS.md)")
    add_run_args(ap)
    args = ap.parse_args()
    backend, device = smoke_setup(args)
    rank = dist.get_rank()
    group = dist.group.WORLD
    case = OpCase(args.model, args.layout, args.seq, "uniform")
    inp = rank_inputs(case, rank, device)

    tiles = tiles_from_json(args.tiles)
    if tiles is None and backend == "triton":
        # rho_ref is defined for the partition's CTAs (the shipped file was measured so);
        # the shared placement's C* does not rest on it (it takes C = G)
        from megatron_overlap.ops import PARTITION_TILES

        tiles = PARTITION_TILES
    if args.fp8:
        payload = calibrate_fp8(args, inp, group, backend, tiles)
        if rank == 0:
            write_json(args.json, payload)
        dist.destroy_process_group()
        return 0
    comp_fn, launch = phase_timer(inp, group, args.c_cal, ("gemm2",), args.splits, backend, tiles)
    # the same GEMM2 at half the reduction dim: same tiles and waves, so the two times
    # give the per-wave cost that does not scale with K (K_epi)
    half = half_k(inp)
    k_half = half["ffn"]
    comp_half_fn, _ = phase_timer(half, group, args.c_cal, ("gemm2",), args.splits, backend,
                                  tiles)
    comm_fn, _ = phase_timer(inp, group, args.c_cal, ("comm",), args.splits, backend, tiles)
    sweep = {c: phase_timer(inp, group, c, ("comm",), args.splits, backend, tiles)[0]
             for c in range(1, args.c_sweep + 1)}
    # the overlapped kernels of a launch prepared once: the host's planning, routing
    # table and launches are not waves of either kernel and stay out of rho
    overlap, _ = phase_timer(inp, group, args.c_cal, ("gemm2", "comm"), args.splits, backend,
                             tiles)
    # the overlapped operator, tail helpers on, over C at the op's L: fits f
    cset = [int(c) for c in args.overlap_cset.split(",")]
    over = {c: phase_timer(inp, group, c, ("gemm2", "comm"), args.overlap_splits, backend,
                           tiles) for c in cset}
    pol = {"comp": comp_fn, "comp K/2": comp_half_fn, "comm": comm_fn, "overlap": overlap,
           **{f"comm C={c}": f for c, f in sweep.items()},
           **{f"overlap C={c}": f for c, (f, _) in over.items()}}
    per = abba(pol, args.samples, args.warmup, group, progress="calibrate")
    med = {n: statistics.median(v) for n, v in per.items()}

    plan, cache = launch.plan, launch.launch_plan.cache
    kernel = cache.kernel
    comp_waves = math.ceil(args.splits * plan.w_comp / plan.compute_slots)
    t_comp = med["comp"] / comp_waves
    k_epi = fit_k_epi(inp["ffn"], med["comp"], k_half, med["comp K/2"])
    comm_waves = args.splits * math.ceil(plan.w_comm / args.c_cal)
    # Saturation: C_max = the smallest C within 3% of the fastest communication time
    # (beyond it, more CTAs only take SMs from GEMM2).
    times = {c: med[f"comm C={c}"] for c in sweep}
    best = min(times.values())
    c_max = min(c for c, t in times.items() if t <= best * 1.03)
    per_wave = {c: t / (args.splits * math.ceil(plan.w_comm / c)) for c, t in times.items()}
    try:
        t0, t_comm, c_sat = fit_saturation(times, plan.w_comm, args.splits)
    except RuntimeError as err:  # e.g. the interpreter, where CTAs run one after another
        print(f"calibrate: {err}; using the single point at C={args.c_cal} and no C_sat")
        t0, t_comm, c_sat = 0.0, med["comm"] / comm_waves, None
    rho_alone = t_comm / t_comp
    t_waves = med["overlap"] / t_comp  # the overlapped run in compute waves
    rho_overlap_fit = solve_rho(t_waves, plan.w_comp, plan.w_comm, plan.compute_slots,
                                args.c_cal, args.splits, c_sat)
    rho_ref = rho_alone
    calib = Calibration(rho_ref, inp["ffn"], kernel.tile_m, kernel.tile_n, launch.world,
                        c_max, kernel.comm_tile_m, kernel.comm_tile_n,
                        c_sat if args.with_c_sat else None,
                        None if k_epi is None else round(k_epi, 1), inp["topk"])
    try:
        f_fit, f_t0, f_rms = fit_overlap_factor(
            {c: med[f"overlap C={c}"] for c in cset}, t_comp,
            lambda f: model_curve(over[cset[0]][1], inp,
                                  dataclasses.replace(calib, overlap_factor=f)))
        calib = dataclasses.replace(calib, overlap_factor=round(f_fit, 2))
    except ValueError as err:  # (e.g. the interpreter, whose fastest C is 1: C_max = 1)
        print(f"calibrate: {err}; the calibration gets no overlap factor")
        f_fit = f_t0 = f_rms = None
    shipped = preset_for_device(cache.device.name)
    preset = Preset(
        name=args.name,
        kernel=KernelSpec(kernel.tile_m, kernel.tile_n, kernel.comm_tile_m, kernel.comm_tile_n,
                          kernel.o_comp, kernel.o_comm),
        device=DeviceSpec(cache.device.name, cache.device.sms),
        calibration=calib,
        default_splits=args.splits,
        # the fuse-or-not time scales: the wave measured here, the rest kept from the
        # shipped calibration (checked on the fuse-or-not grid, not measured here)
        step_costs=(dataclasses.replace(shipped.step_costs, wave_us=round(t_comp * 1e3, 3))
                    if shipped is not None and shipped.step_costs is not None else None),
    )
    payload = dict(preset=preset.to_json(), measured=dict(
        case=case.label(), c_cal=args.c_cal, comp_ms=med["comp"], comp_waves=comp_waves,
        comp_half_k_ms=med["comp K/2"], k_half=k_half, k_epi=k_epi,
        t_comp_wave_us=t_comp * 1e3, comm_ms=med["comm"], comm_waves=comm_waves,
        t_comm_wave_us=t_comm * 1e3, t_comm_wave_single_point_us=med["comm"] / comm_waves * 1e3,
        comm_intercept_us=t0 * 1e3, c_sat=c_sat,
        w_comp=plan.w_comp, w_comm=plan.w_comm, overlap_ms=med["overlap"],
        overlap_waves=t_waves, rho_alone=rho_alone, rho_overlap_fit=rho_overlap_fit,
        overlap_factor_fit=dict(f=f_fit, t0_us=None if f_t0 is None else f_t0 * 1e3,
                                rms_rel_err=f_rms,
                                splits=args.overlap_splits,
                                sweep_ms={c: med[f"overlap C={c}"] for c in cset}),
        compute_slots=plan.compute_slots, comm_sweep_ms=times,
        comm_per_wave_us={c: v * 1e3 for c, v in per_wave.items()},
        resources=launch.launch_plan.family.resources), env=env_info(),
        command=" ".join(sys.argv))
    if rank == 0:
        print(f"rho_ref={rho_ref:.3f} (GatherRS alone: t_comm/wave {t_comm * 1e3:.2f} us + "
              f"{t0 * 1e3:.1f} us, C_sat={c_sat}; the overlapped run, {med['overlap']:.3f} ms = "
              f"{t_waves:.1f} compute waves, fits rho={rho_overlap_fit:.3f}; "
              f"t_comp/wave {t_comp * 1e3:.2f} us over {comp_waves} waves; K_epi={k_epi}; "
              + ("no overlap factor" if f_fit is None else
                 f"overlap factor f={f_fit:.2f} (+{f_t0 * 1e3:.0f} us, rms {f_rms:.1%})")
              + "), "
              f"C_max={c_max}, o_comp={kernel.o_comp}, o_comm={kernel.o_comm}, "
              f"resources={payload['measured']['resources']}")
        print("comm alone vs C (ms):", {c: round(t, 4) for c, t in times.items()})
        if f_fit is not None and f_fit <= F_GRID[0]:
            # (measured on one H100: the one-case curve sits below the model's even at f = 1;
            # the shared placement, the default, ranks only L with it: docs/RESULTS.md)
            print(f"calibrate: the overlap factor is at its grid's floor, f = {F_GRID[0]}: "
                  "the measured overlapped curve is below the model's at every f; check the "
                  "planner's regret with tools/bench_op.py --cuda-graph --graph-sweep before "
                  "trusting C* of the partition placement")
        if launch.world == 1:
            print("calibrate: one rank (D_ref = 1): the pushes to peers were not timed; "
                  "run it on two GPUs where they are lent")
        write_json(args.json, payload)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
