"""The benchmarks' baselines: Megatron's MoE flags each stock and overlapped arm runs under.

"default" is Megatron-LM's defaults (no MoE fusion); "fused" is what NVIDIA's MoE recipes
pass, `--moe-permute-fusion --moe-router-fusion` (TE's fused permute / unpermute and
fused top-k). Both arms of a baseline run under the same flags: the stock layer
through Megatron's code as the flags select it, ours with the same config (its fused
path keeps its own permute whatever the flags say, `OverlapMoELayer._permute`; the
router is Megatron's).

Megatron's allgather dispatcher and router read both flags from the config at each call
(megatron-core 0.19: no module reads them at build), so one built model runs every
baseline: `set_moe_fusions` sets them on each config object the model holds, between
timed calls, which lets one ABBA schedule time every baseline on the same weights.
"""

from __future__ import annotations

from megatron.core.transformer.transformer_config import TransformerConfig

from .convert import set_overlap_enabled

#: Megatron config fields each baseline sets (both False: Megatron-LM's defaults)
BASELINES = {"default": False, "fused": True}
FLAGS = ("moe_permute_fusion", "moe_router_fusion")


def add_baseline_args(parser) -> None:
    parser.add_argument("--moe-fusions", action="store_true",
                        help="both arms with Megatron's --moe-permute-fusion and "
                             "--moe-router-fusion (TE's fused permute / unpermute and top-k); "
                             "= --baselines fused")
    parser.add_argument("--baselines", default=None, metavar="default,fused",
                        help="the flag sets timed in one ABBA schedule, the first the primary "
                             "(its arms 'stock' / 'overlap', the others' suffixed '-fused' or "
                             "'-default'); default: default (fused with --moe-fusions)")


def baselines_from_args(args) -> list[str]:
    """The --baselines list (validated), `--moe-fusions` as `fused`; ValueError names
    the flag."""
    if args.baselines is None:
        return ["fused"] if args.moe_fusions else ["default"]
    if args.moe_fusions:
        raise ValueError("--moe-fusions is --baselines fused: give one of them")
    names = args.baselines.split(",")
    if not names or any(n not in BASELINES for n in names) or len(set(names)) < len(names):
        raise ValueError(f"--baselines: distinct entries of {', '.join(BASELINES)}, "
                         f"got {args.baselines!r}")
    return names


def arm(name: str, baseline: str, primary: str) -> str:
    """A policy's name: `name` ("stock", "overlap") under the primary baseline, else
    suffixed with its baseline ("stock-fused")."""
    return name if baseline == primary else f"{name}-{baseline}"


def check_moe_fusions_available() -> None:
    """Megatron raises on the first fused call where TE lacks a kernel; fail before
    building and timing anything instead."""
    from megatron.core.transformer.moe import moe_utils

    missing = [n for n in ("fused_permute", "fused_unpermute", "fused_topk_with_score_function")
               if getattr(moe_utils, n, None) is None]
    if missing or not moe_utils.HAVE_TE:
        raise ValueError("the fused baseline needs Transformer Engine's MoE kernels "
                         f"(missing: {', '.join(missing) or 'transformer_engine'})")


def set_moe_fusions(module, on: bool) -> int:
    """Both fusion flags set to `on` on every TransformerConfig `module` holds; returns
    how many config objects were set."""
    configs = {id(c): c for m in module.modules()
               if isinstance(c := getattr(m, "config", None), TransformerConfig)}
    for config in configs.values():
        for flag in FLAGS:
            setattr(config, flag, on)
    return len(configs)


def use_arm(model, arm_: tuple[str, str]) -> None:
    """`model` set up for one arm: (stock or overlap, the baseline whose flags it runs)."""
    name, baseline = arm_
    set_overlap_enabled(model, name == "overlap")
    set_moe_fusions(model, BASELINES[baseline])
