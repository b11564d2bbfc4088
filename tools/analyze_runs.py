"""Analyses of recorded benchmark runs that docs/RESULTS.md quotes (CPU only, JSON in, text out).

The recorded runs are the golden files in tests/data/ (trimmed to what these analyses
read; tests/data/README.md says what each run measured, on what, with which planner);
`--data docs/data` reads the current full results instead.

    python tools/analyze_runs.py replay --runs h200x2-rhoref,h200x2-rhoref-p50
        [--k-epi 600 --topk-ref 4] [--tail-helpers] [--overlap-factor F] [--local-topk]
        [--choose-splits ranked|full]
    python tools/analyze_runs.py k-epi --runs h200x2-rhoref,h200x2-rhoref-p50
    python tools/analyze_runs.py bias --runs h200x2-kepi600,h200x2-kepi600-p50
    python tools/analyze_runs.py amdahl --data docs/data --layer layer_2xh200 --op op_2xh200
    python tools/analyze_runs.py fusion --prefill h200x2-nothreshold
    python tools/analyze_runs.py helpers --runs h200x2-tailhelpers,h200x2-tailhelpers-p50
    python tools/analyze_runs.py host-exposed --runs h200x2-tailhelpers,h200x2-fasthost
    python tools/analyze_runs.py fit-f --runs h200x2-tailhelpers,h200x2-tailhelpers-p50
    python tools/analyze_runs.py shared-curves --runs h200-shared,h200-shared-p50

replay: the planner's C* for each recorded workload under a calibration (the shipped
    one, optionally with K_epi / topk_ref replaced; `none` removes a term), timed by the
    run's own measurement at that C (the planner's run where C* is unchanged, else the
    nearest swept C), and its regret against the run's oracle. L stays as recorded.
    --tail-helpers models the helpers' last split, --overlap-factor sets f (rho of the
    splits under GEMM2), --local-topk charges a comm tile the k/EP rows a rank holds.
    --choose-splits ranked chooses L as the op does (the least predicted T over
    SPLIT_CANDIDATES under the calibration without overlap factor and tail helpers),
    `full` ranks L with the full model (the op's earlier choice); both then take C
    from the full model at that L and imply --tail-helpers and --local-topk. A workload
    whose L changes has no measurement: listed, and left out of the regret.
k-epi: least-squares fit of our GEMM2's time per compute wave, t = a + b K, over the
    runs' `gemm2_alone(ours,P=all)` rows at S >= 4096; K_epi = a / b.
bias: the same policy at two places in a round (`C=3` / `C=28` early, `sweep C=...`
    among the sweep): the ratio of their medians (1.0 without a position effect).
amdahl: the layer speedup an operator taking no time at all would give: stock layer
    time / (stock layer time - the reference operator's GPU time) at the same shapes.
fit-fusion: the step costs' host terms (H_op on one rank, then H_group) that decide the
    recorded workloads as measured, and the midpoint of the range that does.
fusion: complete-model prefill speedups (median over a workload's runs) beside the layer's
    fuse-or-not decision replayed on the planner (`planner.fusion`, the preset's step
    costs), and the decisions the measurement contradicts beyond `--noise`.
fit-f: the overlap factor f with the least mean replayed regret (grid 1.0-2.5, tail
    helpers, local top-k, recorded L) over the runs' sweeps.
host-exposed: per run, the host time a whole-op call exposes (whole op minus its
    prepared GPU work), ours and the reference's, median over the workloads.
helpers: what the tail helpers give, per model and layout: `planner(no tail helpers)` over
    `planner` (timed in the same rounds; the same C and L in the runs before the shipped
    planner, which plans the op without helpers its own C), geomean and range, S >= 4096 and below; and the
    whole-op / GPU-only speedups over the reference at S >= 4096.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
from report import load  # noqa: E402
from workloads import OpCase  # noqa: E402

# (these experiments and recorded runs are of the partition placement)
from megatron_overlap.ops.config import GPU_TILES as SHARED_TILES  # noqa: E402
from megatron_overlap.ops.config import PARTITION_TILES as GPU_TILES  # noqa: E402
from megatron_overlap.ops.planning import rank_splits  # noqa: E402
from megatron_overlap.planner import (DeviceSpec, KernelSpec, Workload,  # noqa: E402
                                      decide_fusion, get_preset, ranking_calibration)
from megatron_overlap.planner.model import plan, service_ratio, solve  # noqa: E402
from megatron_overlap.routing import route  # noqa: E402
from megatron_overlap.shapes import BATCH, LAYOUTS, MODELS  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "..", "tests", "data")


def _rows(runs: str, data: str) -> list[dict]:
    rows = []
    for tag in runs.split(","):
        rows += load(os.path.join(data, f"{tag}_*.json"))
    if not rows:
        raise SystemExit(f"no results for {runs!r} in {data}")
    return rows


def _sweep(r: dict) -> dict[int, float]:
    return {int(k.split("=")[1]): v["median"] for k, v in r["stats"].items()
            if k.startswith("sweep")}


def _kernel(hidden: int, topk: int, splits: int, tail_helpers: bool, tiles=GPU_TILES):
    comm_tm, comm_tn = tiles.comm_shape(topk, -(-hidden // splits))
    return KernelSpec(tiles.block_m, tiles.block_n, comm_tm, comm_tn, 2, 1, tail_helpers)


@functools.lru_cache(maxsize=None)
def _rank0_rows_per_token(model: str, layout: str, seq: int, routing: str) -> float:
    """T / M of rank 0 (whose decision a run records) in quarters, as the op computes it:
    the benchmark's seeded routing, counted without building the activations."""
    shape = MODELS[model]
    tp, ep = LAYOUTS[layout]
    case = OpCase(model, layout, seq, routing)
    topk_idx = route(case.tokens, shape.experts, shape.topk, routing, 0)
    rows = int((topk_idx < shape.local_experts(ep)).sum())  # EP rank 0's experts
    return round(4 * rows / case.tokens) / 4


def _local_topk(r: dict) -> float:
    return _rank0_rows_per_token(r["model"], r["layout"], r["seq"], r["routing"])


def _world(r: dict) -> int:
    """The run's group size: recorded by the later runs (one-GPU runs time rank 0's
    workload of a layout alone), else the layout's TP x EP."""
    tp, ep = LAYOUTS[r["layout"]]
    return r.get("world", tp * ep)


def replay_c(r: dict, calib, kernel_tiles=GPU_TILES, tail_helpers: bool = False,
             local_topk: bool = False) -> int:
    """C* for a recorded workload under `calib` (its recorded W_comp, W_comm and L);
    `local_topk`: the rows per token rank 0 holds (T / M, as the op computes it)."""
    shape = MODELS[r["model"]]
    tp, ep = LAYOUTS[r["layout"]]
    splits = r["splits"]
    kernel = _kernel(shape.hidden, shape.topk, splits, tail_helpers, kernel_tiles)
    w = Workload(BATCH * r["seq"], shape.hidden, shape.ffn_per_rank(tp), _world(r), splits, (1,),
                 topk=shape.topk, local_topk=_local_topk(r) if local_topk else None)
    rho = service_ratio(w, kernel, calib)
    c, _ = solve(r["w_comp"], r["w_comm"], rho, splits, kernel,
                 DeviceSpec("H200", 132), calib.c_max, calib.c_sat, calib.overlap_factor)
    return c


def replay_plan(r: dict, calib, splits: int, tail_helpers: bool):
    """The planner's Plan for a recorded workload at any L, rebuilt as the op plans it
    (PlanCache.decide_tiles): the recorded row tiles stand for counts spread over the
    local experts in multiples of TM; local top-k rank 0's T / M."""
    shape = MODELS[r["model"]]
    tp, ep = LAYOUTS[r["layout"]]
    tm, tn = GPU_TILES.block_m, GPU_TILES.block_n
    row_tiles = r["w_comp"] // math.ceil(math.ceil(shape.hidden / r["splits"]) / tn)
    experts = shape.local_experts(ep)
    base, extra = divmod(row_tiles, experts)
    counts = [(base + (e < extra)) * tm for e in range(experts)]
    w = Workload(BATCH * r["seq"], shape.hidden, shape.ffn_per_rank(tp), _world(r), splits,
                 counts, topk=shape.topk, local_topk=_local_topk(r))
    return plan(w, _kernel(shape.hidden, shape.topk, splits, tail_helpers),
                DeviceSpec("H200", 132), calib)


def choose_splits(r: dict, calib, how: str) -> tuple[int, int]:
    """(C, L): L of least predicted T (ties to fewer splits) under the ranking model
    (`ranked`: no overlap factor, no tail helpers, as the op) or the full one (`full`);
    C from the full model at that L."""
    ranking = calib if how == "full" else ranking_calibration(calib)
    splits = rank_splits(MODELS[r["model"]].hidden, lambda cand: replay_plan(
        r, ranking, cand, tail_helpers=how == "full").predicted)
    return replay_plan(r, calib, splits, tail_helpers=True).comm_ctas, splits


def _regret_at(r: dict, c: int) -> float:
    """A recorded workload's regret had its planner chosen C = c: timed by the planner's
    own run where c is the recorded C*, else by the nearest swept C (ties: the smaller)."""
    sweep, own = _sweep(r), r["stats"]["planner"]["median"]
    oracle = min(min(sweep.values()), own)
    t = own if c == r["comm_ctas"] else sweep[min(sweep, key=lambda s: (abs(s - c), s))]
    return t / oracle - 1


def fit_f(args) -> None:
    """The overlap factor f (tail helpers, local top-k, recorded L) with the least mean
    replayed regret over the runs' sweeps, on a grid: how the shipped f was chosen."""
    calib = get_preset(args.preset).calibration
    if args.k_epi is not None:
        calib = dataclasses.replace(calib, k_epi=None if args.k_epi == "none"
                                    else float(args.k_epi))
    rows = _rows(args.runs, args.data)
    scores = {}
    for f in [round(1.0 + 0.1 * i, 1) for i in range(16)]:
        cal = dataclasses.replace(calib, overlap_factor=f)
        regrets = [_regret_at(r, replay_c(r, cal, tail_helpers=True, local_topk=True))
                   for r in rows]
        scores[f] = (statistics.mean(regrets), max(regrets))
        print(f"  f = {f:.1f}: mean regret {100 * scores[f][0]:5.2f}%  max "
              f"{100 * scores[f][1]:5.1f}%")
    best = min(scores, key=lambda f: (scores[f][0], f))
    print(f"best f = {best:.1f} over {len(rows)} workloads of {args.runs} "
          f"(k_epi={calib.k_epi})")


def replay(args) -> None:
    calib = get_preset(args.preset).calibration
    for name in ("k_epi", "topk_ref"):
        value = getattr(args, name)
        if value is not None:
            value = None if value == "none" else (float(value) if name == "k_epi" else int(value))
            calib = dataclasses.replace(calib, **{name: value})
    if args.overlap_factor is not None:
        calib = dataclasses.replace(calib, overlap_factor=None if args.overlap_factor == "none"
                                    else float(args.overlap_factor))
    chosen = args.choose_splits != "recorded"
    helpers, local = args.tail_helpers or chosen, args.local_topk or chosen
    by, same, moved = {}, 0, []
    rows = _rows(args.runs, args.data)
    for r in rows:
        if chosen:
            c, splits = choose_splits(r, calib, args.choose_splits)
            if splits != r["splits"]:  # not measured at this L
                moved.append(f"    {r['case']}: C={r['comm_ctas']} L={r['splits']} -> "
                             f"C={c} L={splits}")
                continue
        else:
            c = replay_c(r, calib, tail_helpers=helpers, local_topk=local)
        same += c == r["comm_ctas"]
        by.setdefault((r["model"], r["layout"]), []).append(_regret_at(r, c))
    kept = sum(map(len, by.values()))
    print(f"calibration: k_epi={calib.k_epi} topk_ref={calib.topk_ref} overlap_factor="
          f"{calib.overlap_factor}; tail helpers {helpers}, local top-k {local}; "
          f"C* as recorded in {same} of {kept} workloads")
    if chosen:
        print(f"L chosen {args.choose_splits}: L as recorded in {kept} of {len(rows)} "
              f"workloads" + ("; not measured at their L, left out of the regret:"
                              if moved else ""))
        for line in moved:
            print(line)
    every = []
    for (model, layout), v in sorted(by.items()):
        every += v
        print(f"  {model:9s} {layout}  regret mean {100 * statistics.mean(v):5.1f}%  "
              f"max {100 * max(v):5.1f}%")
    if every:
        print(f"  all             mean {100 * statistics.mean(every):5.1f}%  "
              f"max {100 * max(every):5.1f}%")


def k_epi_fit(rows: list[dict], sms: int = 132, o_comp: int = 2) -> tuple[float, float, float]:
    """(a, b, rms): t_wave = a + b K over `gemm2_alone(ours,P=all)` at S >= 4096 (us)."""
    pts = []
    for r in rows:
        if r["seq"] < 4096 or "gemm2_alone(ours,P=all)" not in r["stats"]:
            continue
        k = MODELS[r["model"]].ffn_per_rank(LAYOUTS[r["layout"]][0])
        waves = math.ceil(r["w_comp"] * r["splits"] / (o_comp * sms))
        pts.append((k, r["stats"]["gemm2_alone(ours,P=all)"]["median"] * 1e3 / waves))
    mx, my = statistics.mean(p[0] for p in pts), statistics.mean(p[1] for p in pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    a = my - b * mx
    rms = math.sqrt(statistics.mean((y - a - b * x) ** 2 for x, y in pts))
    return a, b, rms


def bias(args) -> None:
    for c in (3, 28):
        ratios = [r["stats"][f"C={c}"]["median"] / r["stats"][f"sweep C={c}"]["median"]
                  for r in _rows(args.runs, args.data)
                  if f"C={c}" in r["stats"] and f"sweep C={c}" in r["stats"]]
        gm = math.exp(statistics.mean(map(math.log, ratios)))
        print(f"C={c} / sweep C={c}: geomean {gm:.3f}, min {min(ratios):.3f}, "
              f"max {max(ratios):.3f} over {len(ratios)} workloads")


def amdahl(args) -> None:
    ops = {(r["model"], r["layout"], r["seq"]): r for r in _rows(args.op, args.data)
           if r["routing"] == "uniform"}
    for r in _rows(args.layer, args.data):
        r["layout"] = f"TP{r['tp']}EP{r['ep']}"
        op = ops.get((r["model"], r["layout"], r["seq"]))
        if op is None:
            continue
        stock = r["stats"]["stock"]["median"]
        gpu = op["stats"]["reference(prepared)"]["median"]
        print(f"  {r['model']:9s} {r['layout']} S={r['seq']:5d}: stock layer {stock:.2f} ms, "
              f"reference operator {gpu:.2f} ms -> at most {stock / (stock - gpu):.2f}x")


def fusion_replay(r: dict, preset, stock_launches: int = 0):
    """The layer's fuse-or-not decision (`ops.fusion_decision`) for a recorded prefill
    workload, rebuilt on the planner as the op plans on Hopper: the shared placement's
    tiles with tail helpers, uniform routing, L ranked as `op.prepare` ranks it."""
    shape = MODELS[r["model"]]
    tp, ep = r["tp"], r["ep"]
    world, tokens, topk = tp * ep, r["tokens"], shape.topk
    local = shape.local_experts(ep)
    rows = tokens * topk * local // shape.experts
    ffn = shape.ffn_per_rank(tp)
    sms = preset.device.sms if r.get("sms") is None else r["sms"]
    device = DeviceSpec(preset.device.name, sms)
    token_major = ep == 1
    tiles = SHARED_TILES if token_major else dataclasses.replace(SHARED_TILES,
                                                                 token_major=False)

    def planned(splits: int, ranking: bool):
        comm_tm, comm_tn = tiles.comm_shape(topk, -(-shape.hidden // splits))
        kernel = KernelSpec(tiles.block_m, tiles.block_n, comm_tm, comm_tn, 2, 1,
                            not ranking, True)
        w = Workload.from_total(tokens=tokens, hidden=shape.hidden, ffn=ffn, world=world,
                                splits=splits, total_assignments=rows, local_experts=local)
        w = dataclasses.replace(w, topk=topk, local_topk=round(4 * rows / tokens) / 4)
        calib = ranking_calibration(preset.calibration) if ranking else preset.calibration
        return w, kernel, plan(w, kernel, device, calib)

    splits = rank_splits(shape.hidden, lambda cand: planned(cand, True)[2].predicted)
    w, kernel, chosen = planned(splits, False)
    return decide_fusion(w, chosen, kernel, device, preset.calibration, preset.step_costs,
                         element_bytes=2, stock_launches=stock_launches)


def _prefill_rows(args) -> list[dict]:
    rows = []
    for tag in args.prefill.split(","):
        for path in sorted(glob.glob(os.path.join(args.data, f"prefill_{tag}_*.json"))):
            with open(path) as f:
                data = json.load(f)
            rows += [r for r in (data if isinstance(data, list) else [data])
                     if r.get("speedup") and (
                         not args.overlapped_only
                         or any("C" in d for d in r.get("decisions_rank0", ())))]
    return rows


def fusion(args) -> None:
    """Per recorded workload (model, layout, S): the median measured speedup over its
    runs, the model's decision and predicted per-layer gain; the decisions the
    measurement contradicts beyond `--noise`."""
    preset = get_preset(args.preset)
    runs: dict = {}
    for r in _prefill_rows(args):
        runs.setdefault((r["model"], r["tp"], r["ep"], r["seq"]), []).append(r)
    wrong = 0
    for key in sorted(runs, key=lambda k: (k[0], k[3])):
        speedup = statistics.median(r["speedup"] for r in runs[key])
        d = fusion_replay(runs[key][0], preset)
        against = (speedup < 1 - args.noise) if d.fuse else (speedup > 1 + args.noise)
        wrong += against
        print(f"  {key[0]:9s} TP{key[1]}EP{key[2]} S={key[3]:5d}: measured "
              f"{speedup:.3f} over {len(runs[key])}, {'fuse ' if d.fuse else 'stock'} "
              f"(fused {d.fused_us:7.1f} us, unfused {d.unfused_us:7.1f} us)"
              f"{'  <- against the measurement' if against else ''}")
    print(f"{len(runs) - wrong} of {len(runs)} workloads decided as measured (within "
          f"{args.noise:.0%} of 1.0 either decision agrees)")


def fit_fusion(args) -> None:
    """The host terms of the step costs that decide the recorded workloads as measured:
    for each, the fused path's predicted saving with no host term; a workload measured
    faster (slower) fused beyond `--noise` bounds the host term from above (below).
    H_op is fitted on the one-rank workloads, then H_group on the others."""
    preset = get_preset(args.preset)
    bare = dataclasses.replace(preset, step_costs=dataclasses.replace(
        preset.step_costs, op_host_us=0.0, group_host_us=0.0))
    runs: dict = {}
    for r in _prefill_rows(args):
        runs.setdefault((r["model"], r["tp"], r["ep"], r["seq"]), []).append(r)
    fitted = 0.0
    for multi in (False, True):
        lo, hi = 0.0, math.inf
        for key, rs in runs.items():
            if (key[1] * key[2] > 1) != multi:
                continue
            d = fusion_replay(rs[0], bare)
            saving = d.unfused_us - d.fused_us - (fitted if multi else 0.0)
            speedup = statistics.median(r["speedup"] for r in rs)
            if speedup > 1 + args.noise:
                hi = min(hi, saving)
            elif speedup < 1 - args.noise:
                lo = max(lo, saving)
        name = "group_host_us" if multi else "op_host_us"
        if hi == math.inf and lo == 0.0:
            print(f"{name}: no workload of this kind")
            continue
        mid = (lo + hi) / 2 if hi < math.inf else lo
        print(f"{name}: every decision as measured for values in ({lo:.1f}, {hi:.1f}); "
              f"midpoint {mid:.1f}" if lo < hi else
              f"{name}: no value decides every workload as measured (need > {lo:.1f} and "
              f"< {hi:.1f})")
        if not multi:
            fitted = mid


def geomean(xs) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def helpers(args) -> None:
    by: dict = {}
    for r in _rows(args.runs, args.data):
        st = {k: v["median"] for k, v in r["stats"].items()}
        if "planner(no tail helpers)" not in st:
            continue
        d = by.setdefault((r["model"], r["layout"]), dict(big=[], small=[], op=[], gpu=[]))
        gain = st["planner(no tail helpers)"] / st["planner"]
        d["big" if r["seq"] >= 4096 else "small"].append(gain)
        if r["seq"] >= 4096:
            d["op"].append(st["reference"] / st["planner"])
            d["gpu"].append(st["reference(prepared)"] / st["planner(prepared)"])
    if not by:
        raise SystemExit(f"no run in {args.runs!r} timed the planner without tail helpers")
    every = []
    for (model, layout), d in sorted(by.items()):
        every += d["big"]
        small = (f"S < 4096 {geomean(d['small']):.3f}x ({min(d['small']):.2f}-"
                 f"{max(d['small']):.2f})" if d["small"] else "")
        print(f"  {model:9s} {layout}  helpers S >= 4096 {geomean(d['big']):.3f}x "
              f"({min(d['big']):.2f}-{max(d['big']):.2f})  {small}  vs reference "
              f"(S >= 4096): whole op {geomean(d['op']):.2f}x, GPU work only "
              f"{geomean(d['gpu']):.2f}x")
    print(f"  all: helpers S >= 4096 {geomean(every):.3f}x over {len(every)} workloads")


def host_exposed(args) -> None:
    """Per run: the host time a whole-op call exposes (its median minus the prepared GPU
    work's), ours and the reference's, median over the run's workloads."""
    for tag in args.runs.split(","):
        ours, ref = [], []
        for r in _rows(tag, args.data):
            st = r["stats"]
            if "planner(prepared)" not in st:
                continue
            ours.append(st["planner"]["median"] - st["planner(prepared)"]["median"])
            ref.append(st["reference"]["median"] - st["reference(prepared)"]["median"])
        if not ours:
            print(f"  {tag}: no prepared rows")
            continue
        o, f = statistics.median(ours), statistics.median(ref)
        print(f"  {tag:8s} ours {o:.3f} ms (range {min(ours):.3f}-{max(ours):.3f}), "
              f"reference {f:.3f} ms, ratio {o / f:.2f} over {len(ours)} workloads")


def shared_curves(args) -> None:
    """Shared-placement runs: how well the model's T(C), with rho scaled by s and a
    saturation C_sat, matches each measured sweep (both divided by their minimum; RMS of
    the log ratio over every swept C), and the C* it picks (the planner's rule: ties
    to the larger C)."""
    from megatron_overlap.ops.config import GPU_TILES as SHARED_TILES

    calib = get_preset(args.preset).calibration
    rows = _rows(args.runs, args.data)
    fits = []
    for c_sat in (None, 8, 16, 32, 64, 128):
        for scale in (0.3, 0.5, 1.0, 1.5, 2.0, 4.0):
            err, n, chosen = 0.0, 0, set()
            for r in rows:
                shape = MODELS[r["model"]]
                tp, _ = LAYOUTS[r["layout"]]
                splits = r["splits"]
                tm, tn = SHARED_TILES.comm_shape(shape.topk, -(-shape.hidden // splits))
                kernel = KernelSpec(128, 128, tm, tn, 2, 1, True, True)
                w = Workload(BATCH * r["seq"], shape.hidden, shape.ffn_per_rank(tp),
                             _world(r), splits, (1,), topk=shape.topk, local_topk=_local_topk(r))
                c, curve = solve(r["w_comp"], r["w_comm"], scale * service_ratio(w, kernel, calib),
                                 splits, kernel, DeviceSpec("H200", 132), calib.c_max, c_sat,
                                 calib.overlap_factor)
                curve, sweep = dict(curve), _sweep(r)
                chosen.add(c)
                t_min, p_min = min(sweep.values()), min(curve[c] for c in sweep)
                for c_, t in sweep.items():
                    err += math.log((t / t_min) / (curve[c_] / p_min)) ** 2
                    n += 1
            fits.append((math.sqrt(err / n), c_sat, scale, sorted(chosen)))
    print(f"{len(rows)} workloads; best fits first (RMS log error, C_sat, rho scale, C* chosen):")
    for rms, c_sat, scale, chosen in sorted(fits, key=lambda f: f[0])[:6]:
        print(f"  {rms:.3f}  C_sat={c_sat}  rho x {scale}  C* in {chosen}")
    shipped = next(f for f in fits if f[1] is None and f[2] == 1.0)
    print(f"  shipped model (no C_sat, rho x 1): {shipped[0]:.3f}, C* in {shipped[3]}")
    print(f"  C* over all {len(fits)} variants: {sorted(set().union(*map(set, (f[3] for f in fits))))}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("replay", "k-epi", "bias", "amdahl", "fusion", "fit-fusion",
                                     "helpers", "host-exposed", "fit-f", "shared-curves"))
    ap.add_argument("--runs", default="h200x2-kepi600,h200x2-kepi600-p50", help="run tags (file name prefixes)")
    ap.add_argument("--preset", default="h200")
    ap.add_argument("--k-epi", default=None, help="replace the calibration's (or 'none')")
    ap.add_argument("--tail-helpers", action="store_true",
                    help="replay: the model with tail helpers serving the last split")
    ap.add_argument("--topk-ref", default=None, help="replace the calibration's (or 'none')")
    ap.add_argument("--overlap-factor", default=None,
                    help="replay: f, the rho factor of splits served under GEMM2 (or 'none')")
    ap.add_argument("--local-topk", action="store_true",
                    help="replay: a comm tile moves the k/EP rows per token a rank holds")
    ap.add_argument("--choose-splits", choices=("recorded", "ranked", "full"),
                    default="recorded", help="replay: L as recorded, ranked as the op "
                    "does, or ranked by the full model (the last two imply --tail-helpers "
                    "--local-topk)")
    ap.add_argument("--layer", default="layer_2xh200")
    ap.add_argument("--op", default="op_2xh200")
    ap.add_argument("--prefill", default="h200x2-nothreshold",
                    help="prefill run tags, comma-separated (file name globs)")
    ap.add_argument("--noise", type=float, default=0.03,
                    help="fusion: speedups within this of 1.0 agree with either decision")
    ap.add_argument("--overlapped-only", action="store_true",
                    help="fusion: only the workloads where the overlap ran")
    ap.add_argument("--data", default=DATA)
    args = ap.parse_args()
    if args.what == "replay":
        replay(args)
    elif args.what == "k-epi":
        a, b, rms = k_epi_fit(_rows(args.runs, args.data))
        print(f"t_wave = {a:.2f} us + {b:.5f} us * K (rms {rms:.2f} us): K_epi = {a / b:.0f}")
    elif args.what == "bias":
        bias(args)
    elif args.what == "fusion":
        fusion(args)
    elif args.what == "fit-fusion":
        fit_fusion(args)
    elif args.what == "helpers":
        helpers(args)
    elif args.what == "host-exposed":
        host_exposed(args)
    elif args.what == "fit-f":
        fit_f(args)
    elif args.what == "shared-curves":
        shared_curves(args)
    else:
        amdahl(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
