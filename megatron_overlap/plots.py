"""PNG plots (matplotlib, imported lazily so the planner stays light)."""

from __future__ import annotations


def plot_plan_curve(decision, path: str, title: str = "", measured=None) -> None:
    """T(C) predicted by the model, C* marked; optional measured {C: ms} on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = [c for c, _ in decision.curve]
    ts = [t for _, t in decision.curve]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(cs, ts, "o-", label="model T(C)")
    ax.axvline(decision.comm_ctas, color="tab:red", ls="--", label=f"C* = {decision.comm_ctas}")
    ax.set_xlabel("communication CTAs C")
    ax.set_ylabel("T(C) [compute waves]")
    if measured:
        ax2 = ax.twinx()
        mc = sorted(measured)
        ax2.plot(mc, [measured[c] for c in mc], "s-", color="tab:green", label="measured")
        ax2.set_ylabel("measured latency [ms]")
        ax2.legend(loc="upper center")
    ax.legend(loc="upper right")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
