"""The op's energy beside its parts alone, and the power roof it gives: is the one-GPU op
bound by the GPU's power cap rather than by its FLOPs or bytes?

    torchrun --nproc-per-node 1 tools/op_energy.py --model granite,qwen,deepseek \
        --layout TP1EP1 --seqs 4096,16384 --json out/op_energy.json --png out/op_energy.png

Why: on one H200 the prefill runs under the 700 W power cap in both arms, the overlapped
one at a 3-5% lower SM clock (docs/RESULTS.md, "Where the layer's gain goes"). The op
moves y through HBM twice (GEMM2 writes it, the combine reads it back) where GEMM2 alone
moves it once; at the cap those bytes cost time even where the HBM has room for them.

Per workload (rank 0's rows on one GPU), four arms, each run back to back for a window
of `--window-s` (NVML's energy counter resolves windows of about 3 s, not 0.3-0.6 s):
  op            the op, captured into a CUDA graph (its counts on the device)
  gemm2(torch)  torch's grouped GEMM alone, captured
  gemm2(ours)   our GEMM2 alone at the op's L on every SM, captured (else launched)
  gather_rs     GatherRS alone at the op's C on a given y, captured (else launched)
in ABBA order over `--rounds`; per arm the medians over rounds of ms per call (the
window's wall time over its calls: the GPU's, calls queued back to back), J per call,
mean W, SM MHz, the share of samples at the software power cap, and one call's
CUDA-event time (`event_ms`: where it is well below ms per call, the host fed the GPU
too slowly and the window is not the arm's).

The energy model, fitted on the three parts of every workload and never on the op:

    E = P_0 t + e_F F + e_B B

F: GEMM2's FLOPs, 2 T N K (0 for GatherRS); B: the HBM bytes of the arm's design, x read
once per split, W once, y written once and read back once by the combine, the output
written once (`arm_bytes`; L2 hits make the real traffic lower); P_0: the power drawn
whatever the work; e_F, e_B: J per FLOP and per HBM byte. Non-negative least squares on
relative errors (scipy.optimize.nnls); P_0 is told from the e's only by windows that draw
different powers (a GEMM2 at the cap, GatherRS below it): `cond`, the scaled system's
condition number, says how well. Per workload it then gives:
  * `op_energy_pred`: the op's energy predicted from its parts' fit at its measured time
    (how far the parts explain the whole);
  * the power roof, t >= (e_F F + e_B B) / (P_cap - P_0): the least time at the cap,
    for the op as built (y through HBM, x once per split) and for three designs:
      stored  any design that stores y: x once, W once, y's round trip, the output;
      blocks  y kept in L2 by blocks of B token bands x L column splits, each block's y
              at most an L2 (`--l2-mb`): every band re-reads every expert's W, every
              split re-reads x, so W B + x L + out, at the (B, L) with the fewest bytes
              (`l2_blocks`; B = 1 is column splits, L = 1 token bands). Bands alone move
              fewer bytes than `stored` only where W < 2 L2 (the W re-read per L2 of y
              against that L2's round trip), splits alone where x < 2 L2; assumes a
              block's y never reaches HBM and no tile is left part-empty;
      fused   y never leaving the chip and nothing re-read: x + W + out, a floor no
              known design reaches (a token's k rows come from k experts' weights);
  * `ratio_roof` (`_stored`, `_blocks`, `_fused`): the op / torch's GEMM2 ratio each roof
    leaves, both at the cap.

`--reassess JSON` runs the fit and the roofs again on a JSON this tool wrote (the bytes
recomputed from its workloads), without a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from bench_op import captured_policies  # noqa: E402
from benchlib import add_run_args, env_info, smoke_setup, time_once, write_json  # noqa: E402
from power import sampled  # noqa: E402
from roofline import op_bytes  # noqa: E402
from workloads import OpCase, add_case_args, cases, on_every_sm, rank_inputs  # noqa: E402

from megatron_overlap.ops import OverlapConfig, gemm2_gather_rs, launcher  # noqa: E402
from megatron_overlap.ops.capture import CapturedCall  # noqa: E402
from megatron_overlap.ops.op import prepare  # noqa: E402
from megatron_overlap.ops.reference import grouped_mm  # noqa: E402

ARMS = ("op", "gemm2(torch)", "gemm2(ours)", "gather_rs")
L2_BYTES = 50 * 2 ** 20  # an H100's or H200's L2 (`--l2-mb`)
TOP = 2.0  # the figure's axis ends here (op / torch's GEMM2)
ROOF_RATIOS = ("ratio", "ratio_roof", "ratio_roof_stored", "ratio_roof_blocks", "ratio_roof_fused")
PARTS = ARMS[1:]


def arm_bytes(sizes: dict, splits: int, l2_bytes: int = L2_BYTES) -> dict:
    """B of each arm (bytes) from `roofline.op_bytes`' x, w, y, out at L = `splits`, and
    of two designs not built: `stored` and `blocks` (module doc)."""
    x, w, y, out = sizes["x"], sizes["w"], sizes["y"], sizes["out"]
    if not l2_bytes > 0:
        raise ValueError(f"l2_bytes must be > 0, got {l2_bytes}")
    return {"op": splits * x + w + 2 * y + out, "gemm2(torch)": x + w + y,
            "gemm2(ours)": splits * x + w + y, "gather_rs": y + out,
            # the least any design moves that stores y (x once: no split re-reads it)
            "stored": x + w + 2 * y + out,
            "blocks": l2_blocks(sizes, l2_bytes)[0],
            "fused": x + w + out}  # (the op with y never leaving the chip)


def l2_blocks(sizes: dict, l2_bytes: int) -> tuple[int, int, int]:
    """(bytes, B, L) of the blocks design (module doc) with the fewest bytes: B token
    bands x L column splits, B L >= ceil(y / L2), W read B times and x L times."""
    x, w, y, out = sizes["x"], sizes["w"], sizes["y"], sizes["out"]
    blocks = math.ceil(y / l2_bytes)
    return min((w * b + x * math.ceil(blocks / b) + out, b, math.ceil(blocks / b))
               for b in range(1, blocks + 1))


def arm_flops(flops: int) -> dict:
    return {"op": flops, "gemm2(torch)": flops, "gemm2(ours)": flops, "gather_rs": 0,
            "stored": flops, "blocks": flops, "fused": flops}


def window_calls(ms_per_call: float, window_s: float) -> int:
    """Calls that fill a window of `window_s` at `ms_per_call`."""
    if not ms_per_call > 0 or not window_s > 0:
        raise ValueError(f"ms_per_call and window_s must be > 0, got {ms_per_call}, {window_s}")
    return max(1, math.ceil(window_s * 1e3 / ms_per_call))


def fit_energy(points: list[tuple[float, float, float, float]]) -> dict:
    """(P_0 W, e_F pJ/FLOP, e_B pJ/byte) of E = P_0 t + e_F F + e_B B from points (t s, F,
    B, E J), non-negative, least squares on relative errors; with the fit's rms and
    largest relative error."""
    import numpy as np
    from scipy.optimize import nnls

    if len(points) < 3:
        raise ValueError(f"the energy fit needs >= 3 points, got {len(points)}")
    a = np.array([[t, f * 1e-12, b * 1e-12] for t, f, b, _ in points])  # (W, J/pFLOP...)
    e = np.array([p[3] for p in points])
    if not (e > 0).all():
        raise ValueError("every point's energy must be > 0")
    scaled = a / e[:, None]
    coef, _ = nnls(scaled, np.ones(len(e)))
    rel = a @ coef / e - 1
    # (windows that all draw one power leave P_0 and the e's collinear: a large `cond`)
    return dict(p0_w=float(coef[0]), e_flop_pj=float(coef[1]), e_byte_pj=float(coef[2]),
                rms_rel=float(np.sqrt((rel ** 2).mean())), max_rel=float(np.abs(rel).max()),
                points=len(points), cond=float(np.linalg.cond(scaled)))


def energy_j(model: dict, t_s: float, flops: float, nbytes: float) -> float:
    return model["p0_w"] * t_s + (model["e_flop_pj"] * flops + model["e_byte_pj"] * nbytes) * 1e-12


def power_roof_ms(model: dict, flops: float, nbytes: float, cap_w: float) -> float:
    """The least time (ms) at which the dynamic energy fits under the cap: t >= (e_F F +
    e_B B) / (P_cap - P_0)."""
    if not cap_w > model["p0_w"]:
        raise ValueError(f"the power cap {cap_w} W must exceed P_0 = {model['p0_w']:.0f} W")
    return (model["e_flop_pj"] * flops + model["e_byte_pj"] * nbytes) * 1e-9 / (cap_w - model["p0_w"])


def assess(rows: list[dict], cap_w: float) -> dict:
    """The parts' fit over `rows` (each: arms {name: medians}, flops, bytes) and, per
    row, the op's predicted energy and its power roof (module doc)."""
    points = [(row["arms"][a]["ms_per_call"] * 1e-3, row["flops"][a], row["bytes"][a],
               row["arms"][a]["energy_j_per_call"]) for row in rows for a in PARTS
              if row["arms"][a].get("energy_j_per_call")]
    model = fit_energy(points)
    per = []
    for row in rows:
        op = row["arms"]["op"]
        roof = {k: power_roof_ms(model, row["flops"][k], row["bytes"][k], cap_w)
                for k in ("op", "gemm2(torch)", "stored", "blocks", "fused")}
        pred = energy_j(model, op["ms_per_call"] * 1e-3, row["flops"]["op"], row["bytes"]["op"])
        per.append(dict(case=row["case"], op_ms=op["ms_per_call"],
                        op_energy_j=op.get("energy_j_per_call"), op_energy_pred=pred,
                        roof_ms=roof, op_over_roof=op["ms_per_call"] / roof["op"],
                        ratio_roof=roof["op"] / roof["gemm2(torch)"],
                        ratio_roof_stored=roof["stored"] / roof["gemm2(torch)"],
                        ratio_roof_blocks=roof["blocks"] / roof["gemm2(torch)"],
                        ratio_roof_fused=roof["fused"] / roof["gemm2(torch)"],
                        ratio=op["ms_per_call"] / row["arms"]["gemm2(torch)"]["ms_per_call"]))
    return dict(model=model, cap_w=cap_w, workloads=per)


def arm_calls(inp: dict, group, cfg, device: str) -> tuple[dict, dict, object]:
    """({arm: callable}, {arm: how it runs}, the op's launch plan) of one workload."""
    x, weight = inp["x"], inp["weight"]
    op_args = (x, weight, inp["counts_list"], inp["token_index"], inp["tokens"], inp["topk"],
               None, group)
    launch = prepare(*op_args, config=cfg)
    lp, buf, routing = launch.launch_plan, launch.buffer, launch.routing
    every_sm = on_every_sm(launch)
    y_ours = torch.empty(x.shape[0], inp["hidden"], dtype=x.dtype, device=x.device)
    y = torch.randn(x.shape[0], inp["hidden"], device=x.device).to(x.dtype)
    out = torch.empty(inp["tokens"] // launch.world, inp["hidden"], dtype=x.dtype,
                      device=x.device)
    w_t = weight.transpose(1, 2)

    def ours():
        return launcher.launch_gemm2_alone(buf, x, weight, routing, every_sm, y_ours)

    def gather_rs():
        launcher.launch_comm_alone(buf, y, routing, lp, None, out)
        return out
    calls = {"op": lambda: gemm2_gather_rs(*op_args, config=cfg),
             "gemm2(torch)": lambda: grouped_mm(x, w_t, launch.counts_dev, inp["counts_list"]),
             "gemm2(ours)": ours, "gather_rs": gather_rs}
    if device != "cuda":
        return calls, dict.fromkeys(calls, "eager"), lp
    graphs, checks = captured_policies(inp, group, cfg, launch)
    for arm, name in (("op", "planner(graph)"), ("gemm2(torch)", "gemm2_alone(torch,graph)")):
        if name not in graphs:
            raise RuntimeError(f"{arm}: not captured ({checks[name]})")
        calls[arm] = graphs[name]
    how = {"op": "graph", "gemm2(torch)": "graph"}
    for arm in ("gemm2(ours)", "gather_rs"):
        captured = CapturedCall(calls[arm], x.device)
        if captured.error is None:
            calls[arm], how[arm] = captured.replay, "graph"
        else:
            how[arm] = f"eager ({captured.error[:120]})"
    return calls, how, lp


def _window(fn, calls: int, cuda: bool) -> dict:
    """One window of `calls` back-to-back calls under the power sampler."""
    def run():
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    t0 = time.perf_counter()
    got = sampled(run, calls=calls)
    got.setdefault("ms_per_call", (time.perf_counter() - t0) * 1e3 / calls)
    return got


def _median(windows: list[dict], key: str):
    values = [w[key] for w in windows if w.get(key) is not None]
    return statistics.median(values) if values else None


def measure(calls: dict, window_s: float, rounds: int, warmup: int, group=None) -> dict:
    """Per arm, the medians over `rounds` ABBA-ordered windows (module doc)."""
    cuda = torch.cuda.is_available()
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    event_ms = {a: statistics.median(time_once(fn, group) for _ in range(5))
                for a, fn in calls.items()}
    count = {a: window_calls(event_ms[a], window_s) for a in calls}
    windows = {a: [] for a in calls}
    names = list(calls)
    for r in range(rounds):
        for a in (names if r % 2 == 0 else names[::-1]):
            w = _window(calls[a], count[a], cuda)
            w["power_cap_share"] = w.get("clock_reasons", {}).get("SwPowerCap")
            windows[a].append(w)
    keys = ("ms_per_call", "energy_j_per_call", "power_w_from_energy", "sm_clock_mhz_mean",
            "power_cap_share", "power_limit_w", "temperature_c_max")
    return {a: dict({k: _median(windows[a], k) for k in keys}, event_ms=event_ms[a],
                    calls=count[a], windows=len(windows[a])) for a in calls}


def measure_case(case: OpCase, args, backend: str, device: str, group, l2: int) -> dict:
    """One workload's arms measured, with the FLOPs and bytes of each."""
    inp = rank_inputs(case, dist.get_rank(), device)
    cfg = OverlapConfig.from_env(backend=backend, preset=args.preset)
    calls, how, lp = arm_calls(inp, group, cfg, device)
    arms = measure(calls, args.window_s, args.rounds, args.warmup, group)
    flops = 2 * inp["x"].shape[0] * inp["hidden"] * inp["ffn"]
    sizes = op_bytes(dict(model=case.model, layout=case.layout, seq=case.seq,
                          batch=case.batch, gemm_flops=flops))
    for arm, text in how.items():
        arms[arm]["how"] = text
    return dict(case=case.label(), model=case.model, layout=case.layout, seq=case.seq,
                routing=case.routing, comm_ctas=lp.plan.comm_ctas, splits=lp.splits,
                batch=case.batch, arms=arms, flops=arm_flops(flops),
                bytes=arm_bytes(sizes, lp.splits, l2))


def table(rows: list[dict], assessed: dict) -> list[str]:
    """Markdown: per workload the arms' ms, J, W, MHz and cap share, then the roof."""
    out = ["| workload | arm | ms / call | J / call | W | SM MHz | at the cap |",
           "|---|---|---|---|---|---|---|"]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for row in rows:
        for arm in ARMS:
            a = row["arms"][arm]
            out.append(f"| {row['case']} | {arm} | {a['ms_per_call']:.3f} | "
                       f"{fmt(a['energy_j_per_call'], '.3f')} | "
                       f"{fmt(a['power_w_from_energy'], '.0f')} | "
                       f"{fmt(a['sm_clock_mhz_mean'], '.0f')} | "
                       f"{fmt(a['power_cap_share'], '.0%')} |")
    if assessed:
        m = assessed["model"]
        out += ["", f"Fit on the parts ({m['points']} points): P_0 = {m['p0_w']:.0f} W, e_F = "
                f"{m['e_flop_pj']:.3f} pJ/FLOP, e_B = {m['e_byte_pj']:.1f} pJ/byte, rms "
                f"{m['rms_rel']:.1%}, max {m['max_rel']:.1%}, cond {m['cond']:.0f}; cap {assessed['cap_w']:.0f} W.", "",
                "| workload | op ms | op J measured / from its parts | op's power roof ms "
                "| op / roof | op / torch GEMM2: measured / op's roof / stored / blocks / "
                "fused |", "|---|---|---|---|---|---|"]
        for w in assessed["workloads"]:
            roofs = " / ".join(f"{w[k]:.2f}" for k in ROOF_RATIOS[1:])
            out.append(f"| {w['case']} | {w['op_ms']:.3f} | {fmt(w['op_energy_j'], '.3f')} / "
                       f"{w['op_energy_pred']:.3f} | {w['roof_ms']['op']:.3f} | "
                       f"{w['op_over_roof']:.2f} | {w['ratio']:.2f} / {roofs} |")
    return out


def figure(assessed: dict, path: str) -> None:
    """Per workload, relative to torch's GEMM2 alone: the op measured, the op's power
    roof, and the roof with y on chip."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = assessed["workloads"]
    fig, ax = plt.subplots(figsize=(max(7, 1.5 * len(ws)), 4.5))
    labels = ("op, measured", "op's power roof (x once per split, y through HBM)",
              "roof of any design storing y (x once)", "roof of L2-sized blocks (bands x splits)",
              "roof with y on chip, nothing re-read")
    width = 0.8 / len(ROOF_RATIOS)
    for i, (key, label) in enumerate(zip(ROOF_RATIOS, labels)):
        xs = [j + width * (i - (len(ROOF_RATIOS) - 1) / 2) for j in range(len(ws))]
        ax.bar(xs, [min(w[key], TOP) for w in ws], width, label=label)
        for x, w in zip(xs, ws):  # a roof past the axis: its value
            if w[key] > TOP:
                ax.text(x, TOP, f"{w[key]:.1f}", ha="center", va="bottom", fontsize=6)
    ax.axhline(1.10, color="k", linestyle="--", linewidth=1, label="target 1.10x")
    # "model/layout/S=../routing" reads as two short lines: the model, then S
    ticks = [f"{w['case'].split('/')[0]}\n{w['case'].split('/')[2]}" for w in ws]
    ax.set_xticks(range(len(ws)), ticks, fontsize=8)
    ax.set_ylabel("time / torch's GEMM2 alone")
    ax.set_title(f"The op at the power cap ({assessed['cap_w']:.0f} W)")
    ax.set_ylim(0, TOP * 1.25)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def l2_bytes(args) -> int:
    """--l2-mb, else the GPU's L2 (torch's device properties), else `L2_BYTES`."""
    if args.l2_mb is not None:
        return int(args.l2_mb * 2 ** 20)
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).L2_cache_size
    return L2_BYTES


def reassess(data: dict, l2: int, cap_w: float | None) -> tuple[list[dict], dict]:
    """(rows, assessment) of a JSON this tool wrote (loaded), every arm's bytes and FLOPs
    recomputed from its workloads (a file from before a design was added lacks it)."""
    rows = data["results"]
    for row in rows:
        flops = row["flops"]["op"]
        sizes = op_bytes({k: row[k] for k in ("model", "layout", "seq", "batch") if k in row}
                         | {"gemm_flops": flops})
        row.update(flops=arm_flops(flops), bytes=arm_bytes(sizes, row["splits"], l2))
    cap = cap_w or data["assessed"]["cap_w"]
    return rows, assess(rows, cap)


def report(rows: list[dict], assessed: dict, args, l2: int, env: dict, command: str) -> None:
    print("\n".join(table(rows, assessed)))
    if not assessed:
        print("no energy fit: NVML's energy counter or the power cap is not available here")
    if args.png and assessed:
        figure(assessed, args.png)
    write_json(args.json, dict(env=env, command=command, l2_bytes=l2,
                               results=rows, assessed=assessed))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_args(ap, model="granite", layout="TP1EP1", seqs="4096", routing="uniform")
    ap.add_argument("--window-s", type=float, default=3.0, help="seconds of each window")
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds of windows per arm")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--preset", default=None)
    ap.add_argument("--cap-w", type=float, default=None,
                    help="the power cap (W); default NVML's enforced limit")
    ap.add_argument("--l2-mb", type=float, default=None,
                    help="the L2 of the blocks design (MiB); default the GPU's")
    ap.add_argument("--reassess", default="", help="a JSON of this tool: fit and roofs again")
    ap.add_argument("--png", default="", help="the roof figure here (rank 0)")
    add_run_args(ap)
    args = ap.parse_args()
    if not (args.window_s > 0 and args.rounds >= 1 and args.warmup >= 0
            and (args.cap_w is None or args.cap_w > 0)
            and (args.l2_mb is None or args.l2_mb > 0)):
        ap.error("--window-s, --cap-w and --l2-mb must be > 0, --rounds >= 1, --warmup >= 0")
    if args.reassess:  # no GPU, no process group
        with open(args.reassess) as f:  # (the measurement's command, then this one)
            data = json.load(f)
        command = f"{data['command'].split(' ; ')[0]} ; {' '.join(sys.argv)}"
        l2 = l2_bytes(args)
        report(*reassess(data, l2, args.cap_w), args, l2, data["env"], command)
        return 0
    backend, device = smoke_setup(args)
    if args.smoke:
        args.window_s = min(args.window_s, 0.02)
    l2 = l2_bytes(args)  # (the L2 every workload's blocks design and the JSON state)
    rows = [measure_case(case, args, backend, device, dist.group.WORLD, l2)
            for case in cases(args)]
    cap = args.cap_w or rows[0]["arms"]["op"].get("power_limit_w")
    measured = all(r["arms"][a]["energy_j_per_call"] for r in rows for a in ARMS)
    assessed = assess(rows, cap) if measured and cap else {}
    if dist.get_rank() == 0:
        report(rows, assessed, args, l2, env_info(), " ".join(sys.argv))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
