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
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def load(pattern):
    rows = []
    for path in sorted(glob.glob(pattern)):
        with open(path) as f:
            d = json.load(f)
        for r in d.get("results", []):
            r["_file"] = os.path.basename(path)
            r["_env"] = d.get("env", {})
            r["_command"] = d.get("command", "")
            rows.append(r)
    return rows


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


def layer_section(tag, layer) -> str:
    graphs = any("graph" in r for r in layer)
    lines = [f"### MoE layer, {tag} (tools/bench_layer.py)\n", "| model | layout | S | stock ms "
             "[95% CI] | overlap ms [95% CI] | speedup | C, L, P | rel. err | input: max_e/mean |"
             + (" graph ms [95% CI] | stock / graph | replay = eager |" if graphs else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if graphs else "")]
    for r in layer:
        st = r["stats"]
        cells = ""
        if graphs:
            g = st.get("graph")
            cells = (f" {g['median']:.3f} [{g['ci_low']:.3f}, {g['ci_high']:.3f}] | "
                     f"{r['speedup_graph']:.2f}x | "
                     f"{'yes' if r['graph'].get('equal') else 'no'} |" if g
                     else " not captured | - | - |")
        lines.append(
            f"| {r['model']} | TP{r['tp']}EP{r['ep']} | {r['seq']} | "
            f"{st['stock']['median']:.3f} [{st['stock']['ci_low']:.3f}, "
            f"{st['stock']['ci_high']:.3f}] | {st['overlap']['median']:.3f} "
            f"[{st['overlap']['ci_low']:.3f}, {st['overlap']['ci_high']:.3f}] | "
            f"{r['speedup']:.2f}x | {r['decision']} | {r['rel_err']:.1e} | {_layer_input(r)} |"
            + cells)
    graphed = [r["speedup_graph"] for r in layer if "speedup_graph" in r]
    if graphed:
        lines.append(f"\ngraph: geomean stock / graph {geomean(graphed):.2f}x (min "
                     f"{min(graphed):.2f}x, max {max(graphed):.2f}x)")
    lines.append(f"\ngeomean speedup: {geomean([r['speedup'] for r in layer]):.2f}x over "
                 f"{len(layer)} workloads (min {min(r['speedup'] for r in layer):.2f}x); "
                 f"{layer[0]['_env'].get('gpu')}, torch {layer[0]['_env'].get('torch')}, "
                 f"triton {layer[0]['_env'].get('triton')}\n")
    return "\n".join(lines)


def _layer_input(r) -> str:
    """Which input a layer row was timed on and how skewed its routing was (rows before
    `--input-layer` existed were random hidden states, their skew not recorded)."""
    source = f"layer {r['input_layer']}" if r.get("input_layer") else "random"
    routing = r.get("routing")
    return f"{source}: {routing['max_over_mean']:.2f}" if routing else source


def _layer_loads(r) -> str:
    """min / median / max of the MoE layers' max_e / mean at their latest fused launch (rank
    0's local experts; runs before the prefill recorded it, or stock-path layers: '-')."""
    loads = sorted(d["max_over_mean"] for d in r.get("decisions_rank0", [])
                   if d.get("max_over_mean"))
    if not loads:
        return "-"
    return f"{loads[0]:.2f} / {loads[len(loads) // 2]:.2f} / {loads[-1]:.2f}"


def _overlapped(r) -> str:
    """How many of rank 0's MoE layers ran the fused op in the overlap arm ('0 / n': below
    the thresholds, both arms ran the stock path); '-' where not recorded."""
    decisions = r.get("decisions_rank0", [])
    if not decisions:
        return "-"
    return f"{sum('C' in d for d in decisions)} / {len(decisions)}"


def _graph_cells(r) -> str:
    """The `--cuda-graph` policy's cells: its median [CI], stock over it, and whether the
    replay gave the eager fused forward's bits."""
    g, check = r["policies"].get("graph"), r.get("graph", {})
    if g is None:
        return f" {check.get('error', 'not captured')[:60]} | - | - |"
    return (f" {g['median_ms']:.2f} [{g['ci95_ms'][0]:.2f}, {g['ci95_ms'][1]:.2f}] | "
            f"{r['speedup_graph']:.3f}x | {'yes' if check.get('equal') else 'no'} |")


def _fused_ratio(r) -> float | None:
    """stock / overlap with Megatron's MoE fusions on in both arms (`--moe-fusions`,
    `--baselines ...,fused`), or None where the run did not time them."""
    return r.get("speedups_by_baseline", {}).get("fused")


def prefill_section(tag, prefill, out_dir) -> str:
    """Table, geomeans and a speedup-vs-S plot of complete-model prefill runs (with the
    captured forward's columns where the run timed it, `--cuda-graph`)."""
    graphs = any(r.get("cuda_graph") for r in prefill)
    fused = any(_fused_ratio(r) for r in prefill)  # (a run with Megatron's MoE fusions on)
    train = tag.startswith("train_")  # (a `--train` run: the training step)
    name = tag if train else f"prefill_{tag}"
    lines = [f"### {'Training step' if train else 'Complete-model prefill'}, {tag} (python -m "
             "megatron_overlap.mcore.prefill --abba" + (" --train" if train else "")
             + (" --cuda-graph" if graphs else "") + ")\n",
             "| model | layout | B x S | stock ms [95% CI] | overlap ms [95% CI] | speedup | "
             "layers overlapped | max_e/mean over layers |"
             + (" graph ms [95% CI] | stock / graph | replay = eager |" if graphs else "")
             + (" speedup, fused MoE flags |" if fused else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|---|" if graphs else "")
             + ("---|" if fused else "")]
    for r in sorted(prefill, key=lambda r: (r["model"], r["tp"], r["ep"], r["seq"])):
        head = (f"| {r['model']} | TP{r['tp']}EP{r['ep']} | {r['batch']}x{r['seq']}"
                + ("*" if "source" in r else "") + " | ")
        if r.get("oom"):
            lines.append(head + "OOM | OOM | - | - | - |" + (" OOM | - | - |" if graphs else "")
                         + (" OOM |" if fused else ""))
            continue
        st, ov = r["policies"]["stock"], r["policies"]["overlap"]
        lines.append(head + f"{st['median_ms']:.2f} [{st['ci95_ms'][0]:.2f}, {st['ci95_ms'][1]:.2f}]"
                     f" | {ov['median_ms']:.2f} [{ov['ci95_ms'][0]:.2f}, "
                     f"{ov['ci95_ms'][1]:.2f}] | {r['speedup']:.3f}x | {_overlapped(r)} | "
                     f"{_layer_loads(r)} |" + (_graph_cells(r) if graphs else "")
                     + (f" {_fused_ratio(r) or 0:.3f}x |" if fused else ""))
    if any("source" in r for r in prefill):
        lines.append("\n\\* parsed from the run's printed report (its JSON did not come back "
                     "from the device machine; see the file's `source`)")
    done = [r for r in prefill if not r.get("oom")]
    groups = sorted({(r["model"], r["tp"], r["ep"]) for r in done})
    lines.append("\n| model | layout | geomean speedup (all S) | (S >= 4096) | min |"
                 + (" graph: geomean (all S) | min |" if graphs else "")
                 + (" fused MoE flags: geomean (S >= 4096) | min |" if fused else ""))
    lines.append("|---|---|---|---|---|" + ("---|---|" if graphs else "")
                 + ("---|---|" if fused else ""))
    for m, tp, ep in groups:
        rs = [r for r in done if (r["model"], r["tp"], r["ep"]) == (m, tp, ep)]
        big = [r["speedup"] for r in rs if r["seq"] >= 4096]
        row = (f"| {m} | TP{tp}EP{ep} | {geomean([r['speedup'] for r in rs]):.3f}x | "
               f"{geomean(big):.3f}x | {min(r['speedup'] for r in rs):.3f}x |")
        graphed = [r["speedup_graph"] for r in rs if "speedup_graph" in r]
        if graphs:
            row += (f" {geomean(graphed):.3f}x | {min(graphed):.3f}x |" if graphed else " - | - |")
        if fused:
            tuned = [x for r in rs if (x := _fused_ratio(r))]
            big = [x for r in rs if r["seq"] >= 4096 and (x := _fused_ratio(r))]
            row += (f" {geomean(big):.3f}x | {min(tuned):.3f}x |" if big else " - | - |")
        lines.append(row)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "\n".join(lines) + "\n"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for m, tp, ep in groups:
        rs = sorted((r for r in done if (r["model"], r["tp"], r["ep"]) == (m, tp, ep)),
                    key=lambda r: r["seq"])
        label = f"{m} TP{tp}EP{ep}"
        axes[0].plot([r["seq"] for r in rs], [r["policies"]["overlap"]["median_ms"] for r in rs],
                     "o-", label=label)
        line, = axes[1].plot([r["seq"] for r in rs], [r["speedup"] for r in rs], "o-",
                             label=label)
        graphed = [r for r in rs if "speedup_graph" in r]
        if graphed:
            axes[1].plot([r["seq"] for r in graphed], [r["speedup_graph"] for r in graphed],
                         "s--", color=line.get_color(), label=label + ", CUDA graph")
    for ax, ylabel in zip(axes, ("overlap latency (ms)", "speedup over stock")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("S (B = 4)")
        ax.set_ylabel(ylabel)
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{name}_speedup.png"))
    plt.close(fig)
    lines.append(f"\n![{'training step' if train else 'prefill'}]({name}_speedup.png)")
    return "\n".join(lines) + "\n"


def train_loop_section(tag, data) -> str:
    """Megatron-LM's own training loop, stock against `--moe-overlap` (tools/train_loop.py):
    logged iterations, the lm loss's largest relative difference, ms per iteration."""
    lines = [f"### Megatron-LM's training loop, {tag} (tools/train_loop.py)\n",
             f"{data.get('layers')} layers, SEQ {data.get('seq')}, MICRO_BATCH "
             f"{data.get('micro_batch')}, {data.get('iters')} iterations\n",
             "| model | logged iterations | lm loss, max rel. diff | stock ms/iter | "
             "--moe-overlap ms/iter | speedup | MoE layers overlapped |",
             "|---|---|---|---|---|---|---|"]
    for model, arms in data["models"].items():
        v = arms["verdict"]
        build = (arms["overlap"].get("build") or ["-"])[0]
        lines.append(f"| {model} | {len(v['logged'])} | {v['loss_max_rel']:.1e} | "
                     f"{v['stock_ms']:.1f} | {v['overlap_ms']:.1f} | {v['speedup']:.2f}x | "
                     f"{build.split(': ', 1)[-1].split(' MoE')[0]} |")
    return "\n".join(lines) + "\n"


def host_costs_section(tag, rows) -> str:
    """Host syncs and host time per MoE layer call (`--host-costs`), stock / fused."""
    lines = [f"### Host syncs per MoE layer call, {tag} (--host-costs)\n",
             "| model | B x S | MoE layers | syncs per MoE call stock / fused | syncs in the "
             "forward stock / fused | host us per MoE call stock / fused |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        st, ov = r["host_costs"]["stock"], r["host_costs"]["overlap"]
        lines.append(f"| {r['model']} | {r['batch']}x{r['seq']} | {st['calls']} | "
                     f"{st['syncs_per_call']:g} / {ov['syncs_per_call']:g} | "
                     f"{st['step_syncs']} / {ov['step_syncs']} | "
                     f"{st['host_us_per_call']:.0f} / {ov['host_us_per_call']:.0f} |")
    return "\n".join(lines) + "\n"


def run_tag(path: str, kind: str = "prefill") -> str:
    """The run a prefill file belongs to: its name less `{kind}_` and `_{model}_{layout}`
    (`prefill_h200_core_te_qwen_TP1EP1.json` -> `h200_core_te`)."""
    return os.path.basename(path).removesuffix(".json").rsplit("_", 2)[0].removeprefix(f"{kind}_")


def run_tags(data: str, kind: str = "prefill") -> list[str]:
    """Every run of `kind` (prefill or train) under `data`, one tag per run."""
    return sorted({run_tag(p, kind) for p in glob.glob(os.path.join(data, f"{kind}_*_*_*.json"))})


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
    for tag in sorted({os.path.basename(p).rsplit("_", 1)[0]
                       for p in glob.glob(os.path.join(args.data, "layer_*_*.json"))}):
        layer = load(os.path.join(args.data, f"{tag}_*.json"))
        if layer:
            parts.append(layer_section(tag, layer))
    for kind in ("prefill", "train"):  # (train_*: the same tool's `--train` runs)
        for tag in run_tags(args.data, kind):
            prefill = []
            for path in sorted(glob.glob(os.path.join(args.data, f"{kind}_{tag}_*_*.json"))):
                if run_tag(path, kind) != tag:
                    continue
                with open(path) as f:
                    data = json.load(f)
                prefill.extend(r for r in (data if isinstance(data, list) else [data])  # --seqs
                               if "policies" in r or r.get("oom"))  # (not train_loop's file)
            if prefill:
                parts.append(prefill_section(tag if kind == "prefill" else f"train_{tag}",
                                             prefill, args.out))
    for path in sorted(glob.glob(os.path.join(args.data, "train_loop_*.json"))):
        with open(path) as f:
            parts.append(train_loop_section(os.path.basename(path)[len("train_loop_"):-5],
                                            json.load(f)))
    costs = {}
    for path in sorted(glob.glob(os.path.join(args.data, "host_costs_*_*.json"))):
        with open(path) as f:
            data = json.load(f)
        tag = os.path.basename(path).rsplit("_", 1)[0].removeprefix("host_costs_")  # less _{model}
        costs.setdefault(tag, []).extend(
            data if isinstance(data, list) else [data])
    for tag, rows in sorted(costs.items()):
        parts.append(host_costs_section(tag, rows))
    with open(os.path.join(args.out, "results_tables.md"), "w") as f:
        f.write("<!-- generated by tools/report.py; do not edit -->\n\n" + "\n".join(parts))
    print(f"wrote {args.out}/results_tables.md ({len(parts)} sections)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
