"""Command line: `megatron-overlap plan ...` (a stable contract) and `megatron-overlap demo`.

The `plan` sub-command imports only the planner, so it answers in milliseconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from .planner import Workload, get_preset, preset_names, timed_plan


def _counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(c) for c in text.split(",") if c.strip() != "")
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--expert-counts must be comma-separated integers, got {text!r}"
        ) from None


def _add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="choose the communication-CTA count for one workload")
    p.add_argument("--preset", default="a100-paper",
                   help=f"one of {', '.join(preset_names())} or a calibration JSON file")
    p.add_argument("--tokens", type=int, required=True, help="M: global tokens (B*S)")
    p.add_argument("--hidden", type=int, required=True, help="N: hidden size")
    p.add_argument("--ffn", type=int, required=True, help="K: GEMM2 reduction dim per rank")
    p.add_argument("--world", type=int, required=True, help="D: ranks (TP x EP)")
    p.add_argument("--splits", type=int, default=None, help="L (default: the preset's)")
    p.add_argument("--expert-counts", type=_counts, required=True,
                   help="M_e of each local expert, comma separated")
    p.add_argument("--groups", type=int, default=1, help="g: input groups")
    p.add_argument("--topk", type=int, default=None,
                   help="k: rows per token (read by calibrations that record topk_ref)")
    p.add_argument("--tail-helpers", action="store_true",
                   help="model the op's tail helpers (the last split served after GEMM2 by "
                        "C + G - R(C) CTAs, up to C_max), as gemm2_gather_rs runs")
    p.add_argument("--local-topk", type=float, default=None,
                   help="rows per token this rank holds (the op uses T/M: k under TP, "
                        "about k/EP under EP)")
    p.add_argument("--sm-margin", type=int, default=0, help="SMs left to other kernels")
    p.add_argument("--comm-ctas", type=int, default=None, help="explicit C (overrides)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="FILE", help="write a PNG of T(C) with C* marked")


#: plan() calls timed after the first; solver_us is their median
SOLVER_REPEATS = 5


def _timed(workload, kernel, preset, comm_ctas) -> tuple:
    """(plan, solver_us, solver_first_us). The first plan() of this fresh interpreter
    also pays Python's one-time warm-up of the planner's code (about 2-3x the rest);
    a launch that misses the op's cache plans in a process that has planned before, so
    solver_us is the median of the calls after it."""
    decision, first_us = timed_plan(workload, kernel, preset.device, preset.calibration,
                                    comm_ctas=comm_ctas)
    repeats = sorted(timed_plan(workload, kernel, preset.device, preset.calibration,
                                comm_ctas=comm_ctas)[1] for _ in range(SOLVER_REPEATS))
    return decision, repeats[SOLVER_REPEATS // 2], first_us


def _run_plan(args) -> int:
    preset = get_preset(args.preset).with_sm_margin(args.sm_margin)
    workload = Workload(
        tokens=args.tokens, hidden=args.hidden, ffn=args.ffn, world=args.world,
        splits=args.splits if args.splits is not None else preset.default_splits,
        expert_counts=args.expert_counts, groups=args.groups, topk=args.topk,
        local_topk=args.local_topk,
    )
    kernel = dataclasses.replace(preset.kernel, tail_helpers=args.tail_helpers)
    decision, solver_us, first_us = _timed(workload, kernel, preset, args.comm_ctas)
    result = {
        "preset": preset.name,
        "comm_ctas": decision.comm_ctas,
        "reservation": decision.reservation,
        "compute_slots": decision.compute_slots,
        "splits": decision.splits,
        "predicted_T": decision.predicted,
        "predicted": [{"C": c, "T": t} for c, t in decision.curve],
        "w_comp": decision.w_comp,
        "w_comm": decision.w_comm,
        "rho": decision.rho,
        "source": decision.source,
        "solver_us": solver_us,
        "solver_first_us": first_us,
        # the model above is the paper's partition placement; what the op runs by default
        "placement": "partition",
        "op_default": {"placement": "shared", "comm_ctas": preset.device.available_sms},
    }
    if args.plot:
        from .plots import plot_plan_curve

        plot_plan_curve(decision, args.plot, title=f"{preset.name}: M={args.tokens} "
                        f"N={args.hidden} K={args.ffn} D={args.world} L={decision.splits}")
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"preset {preset.name}: G={preset.device.available_sms} SMs, "
          f"o_comp={preset.kernel.o_comp}, o_comm={preset.kernel.o_comm}, "
          f"rho={decision.rho:.4f}, W_comp={decision.w_comp}, W_comm={decision.w_comm}")
    print(f"{'C':>4} {'R(C)':>5} {'P(C)':>5} {'T(C) waves':>11}")
    for c, t in decision.curve:
        mark = "  <- C*" if c == decision.comm_ctas else ""
        r = -(-c // preset.kernel.o_comm)
        p = preset.kernel.o_comp * (preset.device.available_sms - r)
        print(f"{c:>4} {r:>5} {p:>5} {t:>11.3f}{mark}")
    print(f"C* = {decision.comm_ctas} ({decision.source}), R = {decision.reservation}, "
          f"P = {decision.compute_slots}, solved in {solver_us:.1f} us")
    print(f"(the paper's partition placement: C CTAs on SMs of their own, what the op runs "
          f"with --moe-overlap-placement partition. Its default on a GPU is the shared "
          f"placement where it fits: one GatherRS CTA beside GEMM2's on every SM, C = G = "
          f"{preset.device.available_sms})")
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def _add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="the main demonstration (see README)")
    p.add_argument("--nproc", type=int, default=2, help="ranks for the layer comparison")
    p.add_argument("--planner-only", action="store_true",
                   help="only print the planner's decision table")


def _run_demo(args) -> int:
    from .demo import run_demo

    return run_demo(nproc=args.nproc, planner_only=args.planner_only)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-overlap", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plan_parser(sub)
    _add_demo_parser(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "plan":
            return _run_plan(args)
        return _run_demo(args)
    except (ValueError, OSError) as err:  # bad input, or a file that cannot be read/written
        print(f"megatron-overlap: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
