"""`make demo`: what a newcomer runs first.

Prints the planner's decisions for the paper's three models over the evaluated layouts,
sequence lengths and routings.
"""

from __future__ import annotations

from .planner import Preset, get_preset
from .planner.cache import PlanCache
from .routing import SKEW_TARGETS, expert_counts, route
from .shapes import BATCH, LAYOUTS, MODELS, SEQUENCE_LENGTHS


def decision_rows(preset: Preset, routings=("uniform", "p90"), seed: int = 0):
    """One row per model x layout x S x routing: the counts of EP rank 0 and the plan."""
    cache = PlanCache(preset.kernel, preset.device, preset.calibration)
    for key, shape in MODELS.items():
        for layout, (tp, ep) in LAYOUTS.items():
            k_rank, e_local = shape.ffn_per_rank(tp), shape.local_experts(ep)
            for s in SEQUENCE_LENGTHS:
                tokens = BATCH * s
                for routing in routings:
                    idx = route(tokens, shape.experts, shape.topk, routing, seed)
                    counts = expert_counts(idx, shape.experts)[:e_local].tolist()
                    d = cache.decide(tokens, shape.hidden, k_rank, tp * ep,
                                     shape.default_splits, counts)
                    yield dict(model=key, layout=layout, S=s, routing=routing,
                               counts=counts, plan=d)


def print_decision_table(preset: Preset) -> None:
    print(f"Planner decisions, preset {preset.name} (G={preset.device.available_sms} SMs, "
          f"o_comp={preset.kernel.o_comp}, o_comm={preset.kernel.o_comm}, "
          f"C_max={preset.calibration.c_max}); B={BATCH}, counts of EP rank 0; skew targets "
          + ", ".join(f"{k}: R={v}" for k, v in SKEW_TARGETS.items()))
    header = f"{'model':<9}{'layout':<8}{'S':>6} {'routing':<8}{'W_comp':>7}{'W_comm':>7}" \
             f"{'C*':>4}{'R':>4}{'P':>5}{'T(C*)':>9}{'T(3)':>9}{'T(3)/T*':>8}"
    print(header)
    print("-" * len(header))
    for row in decision_rows(preset):
        d = row["plan"]
        t = dict(d.curve)
        t3 = t.get(3, float("nan"))
        print(f"{row['model']:<9}{row['layout']:<8}{row['S']:>6} {row['routing']:<8}"
              f"{d.w_comp:>7}{d.w_comm:>7}{d.comm_ctas:>4}{d.reservation:>4}"
              f"{d.compute_slots:>5}{d.predicted:>9.1f}{t3:>9.1f}{t3 / d.predicted:>8.2f}")


def run_demo(nproc: int = 2, planner_only: bool = False) -> int:
    print_decision_table(get_preset("a100-paper"))
    return 0
