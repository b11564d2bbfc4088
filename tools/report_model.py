"""The model-level sections of `tools/report.py`: the MoE layer (layer_*.json,
tools/bench_layer.py), the complete-model prefill and training step (prefill_*.json,
train_*.json: megatron_overlap.mcore.prefill --json, one section per run, the file name
less its `_{model}_{layout}.json`), Megatron-LM's training loop (train_loop_*.json) and
the host syncs per MoE layer call (host_costs_*.json)."""

from __future__ import annotations

import glob
import json
import math
import os

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
             *_train_loop_args(data),
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


def _train_loop_args(data) -> list[str]:
    """The Megatron-LM arguments both arms took beyond the recipe, and whether each pair
    captured TE's CUDA graphs where they were asked for."""
    extra = data.get("megatron_args")
    if not extra:
        return []
    lines = [f"Both arms with `{' '.join(extra)}`\n"]
    captured = {m: a["verdict"].get("cuda_graphs_captured") for m, a in data["models"].items()}
    if any(v is not None for v in captured.values()):
        lines.append("TE CUDA graphs captured in both arms (TECudaGraphHelper's log line): "
                     + ", ".join(f"{m} {'yes' if v else 'no'}" for m, v in captured.items())
                     + "\n")
    return lines


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


def model_sections(data_dir: str, out: str) -> list[str]:
    """Every model-level section of the runs under `data_dir` (plots into `out`)."""
    parts = []
    for tag in sorted({os.path.basename(p).rsplit("_", 1)[0]
                       for p in glob.glob(os.path.join(data_dir, "layer_*_*.json"))}):
        layer = load(os.path.join(data_dir, f"{tag}_*.json"))
        if layer:
            parts.append(layer_section(tag, layer))
    for kind in ("prefill", "train"):  # (train_*: the same tool's `--train` runs)
        for tag in run_tags(data_dir, kind):
            prefill = []
            for path in sorted(glob.glob(os.path.join(data_dir, f"{kind}_{tag}_*_*.json"))):
                if run_tag(path, kind) != tag:
                    continue
                with open(path) as f:
                    data = json.load(f)
                prefill.extend(r for r in (data if isinstance(data, list) else [data])  # --seqs
                               if "policies" in r or r.get("oom"))  # (not train_loop's file)
            if prefill:
                parts.append(prefill_section(tag if kind == "prefill" else f"train_{tag}",
                                             prefill, out))
    for path in sorted(glob.glob(os.path.join(data_dir, "train_loop_*.json"))):
        with open(path) as f:
            parts.append(train_loop_section(os.path.basename(path)[len("train_loop_"):-5],
                                            json.load(f)))
    costs = {}
    for path in sorted(glob.glob(os.path.join(data_dir, "host_costs_*_*.json"))):
        with open(path) as f:
            data = json.load(f)
        tag = os.path.basename(path).rsplit("_", 1)[0].removeprefix("host_costs_")  # less _{model}
        costs.setdefault(tag, []).extend(
            data if isinstance(data, list) else [data])
    for tag, rows in sorted(costs.items()):
        parts.append(host_costs_section(tag, rows))
    return parts
