"""Regenerate the tables and plots behind docs/RESULTS.md from the benchmark JSON files.

    python tools/report.py --data docs/data --out build/report

Reads op_*.json (tools/bench_op.py), layer_*.json (tools/bench_layer.py),
prefill_*.json and train_*.json
(megatron_overlap.mcore.prefill --json, --train --json; one section per run, the file
name less its `_{model}_{layout}.json`); writes
OUT/results_tables.md (every workload's row; RESULTS.md copies the summaries) and PNG
plots (RESULTS.md keeps a few under docs/figures/). Regret is measured: T(C*) is the planner's own
timed run, T_oracle the fastest point of the C sweep timed in the same ABBA rounds.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from report_model import geomean, load, model_sections  # noqa: E402


def op_rows(rows):
    out = []
    for r in rows:
        if "stats" not in r:  # (a file under the op_ prefix that bench_op did not write)
            continue
        st = {k: v["median"] for k, v in r["stats"].items()}
        ci = {k: (v["ci_low"], v["ci_high"]) for k, v in r["stats"].items()}
        sweep = {int(k.split("=")[1]): v for k, v in st.items() if k.startswith("sweep")}
        # the planner's own C can fall outside the swept set: it is a measured point too
        oracle = min(min(sweep.values()), st["planner"])
        comm = next((v for k, v in st.items() if k.startswith("comm_alone")), float("nan"))
        gemm = st.get("gemm2_alone(torch)", float("nan"))
        out.append(dict(
            case=r["case"], model=r["model"], layout=r["layout"], seq=r["seq"],
            routing=r["routing"], skew=r.get("skew"), c_star=r["comm_ctas"], L=r["splits"],
            oracle_c=min(sweep, key=sweep.get), ref=st["reference"], ours=st["planner"],
            ours_ci=ci["planner"], ref_ci=ci["reference"], c3=st.get("C=3"),
            c28=st.get("C=28"), oracle=oracle, gemm=gemm,
            gemm_ours=st.get("gemm2_alone(ours,P=all)"), comm=comm,
            bound=max(gemm, comm), regret=(st["planner"] - oracle) / oracle,
            tflops=r["gemm_flops"] / st["planner"] / 1e9, sweep=sweep,
            ours_prep=st.get("planner(prepared)"), ref_prep=st.get("reference(prepared)"),
            no_helpers=st.get("planner(no tail helpers)"),
            ours_graph=st.get("planner(graph)"), gemm_graph=st.get("gemm2_alone(torch,graph)"),
            ref_graph=st.get("reference(prepared,graph)"),
            graph_sweep={k[len("graph "):]: v for k, v in st.items() if k.startswith("graph ")},
            graphs_equal=all(c.get("equal") for c in r.get("graphs", {}).values()),
            confirmed=confirmed_regret(r), retimed=retiming_spread(r),
            predicted=dict((c, t) for c, t in r["predicted"]), file=r["_file"]))
    return out


def confirmed_regret(r) -> float | None:
    """Regret of bench_op's confirmation phase (`--confirm`): (T(C*) - T(C_o)) / T(C_o),
    both timed in rounds of their own, C_o the sweep's fastest C. Where C_o is the
    planner's own C, T(C*) = T_oracle by definition and the regret is 0: the phase then
    times one configuration twice, and what it measures is the timing noise
    (`retiming_spread`), not the planner (older runs stored it as regret)."""
    c = r.get("confirm")
    if not c:
        return None
    return 0.0 if c["oracle_c"] == r["comm_ctas"] else c["regret"]


def retiming_spread(r) -> float | None:
    """|T1 - T2| / T2 of one configuration timed twice (the confirmation phase where the
    sweep's fastest C is the planner's): the noise the regrets above sit in."""
    c = r.get("confirm")
    if not c or c["oracle_c"] != r["comm_ctas"]:
        return None
    return abs(c.get("spread", c["regret"]))


def op_table(rows) -> str:
    """Per-workload rows; `bound` = max(torch GEMM2 alone, GatherRS alone at C*), the
    physical bound of an overlap of the two (ours / bound says how far from it we are)."""
    lines = ["| workload | R | C* | L | oracle C | reference ms | ours ms [95% CI] | "
             "C=3 ms | C=28 ms | oracle ms | GEMM2 alone (torch) ms | bound ms | "
             "speedup vs ref | vs GEMM2 alone | vs bound | regret |", "|" + "---|" * 16]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['skew']:.2f} | {r['c_star']} | {r['L']} | {r['oracle_c']} | "
            f"{r['ref']:.3f} | {r['ours']:.3f} [{r['ours_ci'][0]:.3f}, {r['ours_ci'][1]:.3f}] | "
            f"{r['c3']:.3f} | {(r['c28'] or float('nan')):.3f} | {r['oracle']:.3f} | "
            f"{r['gemm']:.3f} | {r['bound']:.3f} | {r['ref'] / r['ours']:.2f}x | "
            f"{r['ours'] / r['gemm']:.2f}x | {r['ours'] / r['bound']:.2f}x | "
            f"{100 * r['regret']:.1f}% |")
    return "\n".join(lines)


def summary(rows) -> str:
    lines = ["| model | layout | geomean speedup vs reference (all S) | (S >= 4096) | "
             "GPU work only (S >= 4096) | vs C=3 | mean regret | max regret | "
             "tail helpers (S >= 4096) | confirmed regret (mean / max) | "
             "same C timed twice (largest spread) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def ratio(sel, num, den):  # geomean of num / den where the run timed both
        pairs = [(r[num], r[den]) for r in sel if r.get(num) and r.get(den)]
        return f"{geomean([a / b for a, b in pairs]):.2f}x" if pairs else "-"

    keys = sorted({(r["model"], r["layout"]) for r in rows})
    for m, lay in keys:
        sel = [r for r in rows if r["model"] == m and r["layout"] == lay]
        big = [r for r in sel if r["seq"] >= 4096]
        lines.append(
            f"| {m} | {lay} | {geomean([r['ref'] / r['ours'] for r in sel]):.2f}x | "
            f"{geomean([r['ref'] / r['ours'] for r in big]):.2f}x | "
            f"{ratio(big, 'ref_prep', 'ours_prep')} | "
            f"{geomean([r['c3'] / r['ours'] for r in sel]):.2f}x | "
            f"{100 * sum(r['regret'] for r in sel) / len(sel):.1f}% | "
            f"{100 * max(r['regret'] for r in sel):.1f}% | "
            f"{ratio(big, 'no_helpers', 'ours')} | {confirmed(sel)} | {spread(sel)} |")
    return "\n".join(lines)


def graph_table(rows) -> str:
    """bench_op `--cuda-graph`: the op, torch's GEMM2 alone and the prepared reference,
    each replayed from a CUDA graph, so no host work is in any of them ('' where no row
    of the run timed them)."""
    rows = [r for r in rows if r.get("ours_graph") and r.get("gemm_graph")]
    if not rows:
        return ""
    swept = any(r.get("graph_sweep") for r in rows)
    lines = ["CUDA graphs (`--cuda-graph`: no host work in any column; replays checked "
             "against their eager outputs)\n",
             "| workload | ours graph ms | GEMM2 alone (torch) graph ms | reference "
             "(prepared) graph ms | ours / GEMM2 alone | reference / ours | replay = eager |"
             + (" fastest other C or L | graph regret | own choice captured twice |"
                if swept else ""),
             "|---|---|---|---|---|---|---|" + ("---|---|---|" if swept else "")]
    for r in rows:
        ref = r.get("ref_graph")
        ref_ms, ref_ratio = ("-", "-") if ref is None else (f"{ref:.3f}", f"{ref / r['ours_graph']:.2f}x")
        lines.append(
            f"| {r['case']} | {r['ours_graph']:.3f} | {r['gemm_graph']:.3f} | "
            f"{ref_ms} | {r['ours_graph'] / r['gemm_graph']:.2f}x | {ref_ratio} | "
            f"{'yes' if r['graphs_equal'] else 'no'} |" + (_graph_sweep_cells(r) if swept else ""))
    regrets = [v for v in map(graph_regret, rows) if v is not None]
    if regrets:
        spreads = [v for v in map(graph_retime_spread, rows) if v is not None]
        lines.append(f"\ngraph regret over {len(regrets)} workloads: mean "
                     f"{100 * sum(regrets) / len(regrets):.1f}%, max {100 * max(regrets):.1f}%"
                     + (f"; the planner's own choice captured twice differs by up to "
                        f"{100 * max(spreads):.1f}%" if spreads else ""))
    big = [r for r in rows if r["seq"] >= 4096]
    if big:
        lines.append(f"\nS >= 4096: ours / GEMM2 alone geomean "
                     f"{geomean([r['ours_graph'] / r['gemm_graph'] for r in big]):.3f}x "
                     f"(max {max(r['ours_graph'] / r['gemm_graph'] for r in big):.3f}x) over "
                     f"{len(big)} workloads")
    return "\n".join(lines) + "\n"


def _graph_sweep_split(r) -> tuple[dict, dict]:
    """The captured sweep (`--graph-sweep`) as (other configurations, the planner's own
    C* or L* captured again): a swept point equal to the planner's choice is the same
    configuration in another graph, so its difference is noise, not regret."""
    sweep = r.get("graph_sweep") or {}
    own = {f"C={r.get('c_star')}", f"L={r.get('L')}"}
    return ({k: v for k, v in sweep.items() if k not in own},
            {k: v for k, v in sweep.items() if k in own})


def graph_regret(r) -> float | None:
    """(T(planner) - T(fastest)) / T(fastest) over the captured C and L that differ from
    the planner's, its own replay among the candidates (0 where it is the fastest);
    None unswept."""
    others, _ = _graph_sweep_split(r)
    if not others:
        return None
    best = min(min(others.values()), r["ours_graph"])
    return (r["ours_graph"] - best) / best


def graph_retime_spread(r) -> float | None:
    """The largest |T - T(planner)| / T(planner) of the planner's own configuration
    captured again by the sweep: the noise the graph regrets sit in."""
    _, own = _graph_sweep_split(r)
    if not own:
        return None
    return max(abs(v - r["ours_graph"]) / r["ours_graph"] for v in own.values())


def _graph_sweep_cells(r) -> str:
    others, _ = _graph_sweep_split(r)
    if not others:
        return " - | - | - |"
    name = min(others, key=others.get)
    spread = graph_retime_spread(r)
    return (f" {name} {others[name]:.3f} | {100 * graph_regret(r):.1f}% | "
            f"{'-' if spread is None else f'{100 * spread:.1f}%'} |")


def confirmed(sel) -> str:
    """Mean / max of `confirmed_regret`, where the confirmation phase ran."""
    v = [r["confirmed"] for r in sel if r.get("confirmed") is not None]
    return f"{100 * sum(v) / len(v):.1f}% / {100 * max(v):.1f}%" if v else "-"


def spread(sel) -> str:
    """The largest `retiming_spread`, where the phase timed the planner's C twice."""
    v = [r["retimed"] for r in sel if r.get("retimed") is not None]
    return f"{100 * max(v):.1f}%" if v else "-"


def plots(rows, out_dir, tag):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routing = "uniform" if any(r["routing"] == "uniform" for r in rows) else rows[0]["routing"]
    models = sorted({r["model"] for r in rows})
    layouts = sorted({r["layout"] for r in rows})
    fig, axes = plt.subplots(len(layouts), len(models), figsize=(4 * len(models),
                             3.2 * len(layouts)), squeeze=False, dpi=110)
    for i, lay in enumerate(layouts):
        for j, m in enumerate(models):
            ax = axes[i][j]
            sel = sorted([r for r in rows if r["model"] == m and r["layout"] == lay
                          and r["routing"] == routing], key=lambda r: r["seq"])
            s = [r["seq"] for r in sel]
            for key, label in (("ref", "reference"), ("ours", "ours (planner)"),
                               ("oracle", "oracle C"), ("c3", "C=3"), ("gemm", "GEMM2 alone")):
                ax.plot(s, [r[key] for r in sel], "o-", label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{m} {lay} ({routing})", fontsize=9)
            ax.set_xlabel("S")
            ax.set_ylabel("ms")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{tag}_latency.png"))
    plt.close(fig)
    # predicted vs measured T(C), normalized to each curve's minimum
    sel = [r for r in rows if r["routing"] == routing and r["seq"] == 4096]
    fig, axes = plt.subplots(1, max(1, len(sel)), figsize=(3.2 * max(1, len(sel)), 3),
                             squeeze=False, dpi=110)
    for ax, r in zip(axes[0], sel):
        cs = sorted(r["sweep"])
        meas = [r["sweep"][c] / r["oracle"] for c in cs]
        pmin = min(r["predicted"][c] for c in cs if c in r["predicted"])
        pred = [r["predicted"].get(c, float("nan")) / pmin for c in cs]
        ax.plot(cs, meas, "s-", label="measured / min")
        ax.plot(cs, pred, "o--", label="model / min")
        ax.axvline(r["c_star"], color="tab:red", ls=":", label=f"C*={r['c_star']}")
        ax.set_ylim(0.9, 3)
        ax.set_title(r["case"], fontsize=8)
        ax.set_xlabel("C")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{tag}_curves.png"))
    plt.close(fig)
    # speedup over the reference and regret against S, every routing
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    for m in models:
        for lay in layouts:
            for rt in sorted({r["routing"] for r in rows}):
                sel = sorted([r for r in rows if (r["model"], r["layout"], r["routing"])
                              == (m, lay, rt)], key=lambda r: r["seq"])
                if not sel:
                    continue
                s = [r["seq"] for r in sel]
                label = f"{m} {lay} {rt}"
                axes[0].plot(s, [r["ref"] / r["ours"] for r in sel], "o-", label=label)
                axes[1].plot(s, [100 * r["regret"] for r in sel], "o-", label=label)
    for ax, ylabel in zip(axes, ("speedup over the reference", "regret (%)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("S (B = 4)")
        ax.set_ylabel(ylabel)
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[1].axhline(2.0, color="gray", lw=0.8, ls=":")
    axes[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{tag}_speedup_regret.png"))
    plt.close(fig)

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="docs/data")
    ap.add_argument("--out", default=os.path.join("build", "report"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    parts = []
    for tag in sorted({os.path.basename(p).rsplit("_", 1)[0]
                       for p in glob.glob(os.path.join(args.data, "op*_*.json"))}):
        rows = op_rows(load(os.path.join(args.data, f"{tag}_*.json")))
        if not rows:
            continue
        plots(rows, args.out, tag)
        graphed = graph_table(rows) and graph_table(rows) + "\n"
        env = rows and load(os.path.join(args.data, f"{tag}_*.json"))[0]["_env"]
        parts.append(f"### {tag}\n\n{env.get('gpus')}x {env.get('gpu')}, torch "
                     f"{env.get('torch')}, triton {env.get('triton')}, CUDA {env.get('cuda')}, "
                     f"NCCL {env.get('nccl')}, {env.get('time')}\n\n"
                     f"{summary(rows)}\n\n{op_table(rows)}\n\n{graphed}"
                     f"![latency]({tag}_latency.png)\n![curves]({tag}_curves.png)\n"
                     f"![speedup and regret]({tag}_speedup_regret.png)\n")
    parts += model_sections(args.data, args.out)
    with open(os.path.join(args.out, "results_tables.md"), "w") as f:
        f.write("<!-- generated by tools/report.py; do not edit -->\n\n" + "\n".join(parts))
    print(f"wrote {args.out}/results_tables.md ({len(parts)} sections)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
