"""`--moe-overlap` flags for Megatron launch scripts, and the OverlapConfig they describe.

Megatron-LM scripts take one `extra_args_provider(parser)`; pass
`moe_overlap_args_provider(its own provider or None)`, which adds both sets of flags and
hooks the model builders (`megatron_lm.py`: `--moe-overlap` is then the whole switch);
`add_moe_overlap_args` only adds the flags, for parsers of your own.
`overlap_config_from_args(args)` turns the parsed
flags into the OverlapConfig the spec helpers hand to every OverlapMoELayer; without
`--moe-overlap` it returns None and the spec helpers leave the model stock.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from ..ops import OverlapConfig
from ..planner import load_preset_file, preset_names
from .policy import FUSE_CHOICES, LayerPolicy

BACKEND_CHOICES = ("auto", "triton", "interpret", "reference")


def _auto_or_positive_int(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive integer, got {text!r}")
    return value


def _calibration(text: str) -> str:
    """A shipped preset's name or a calibration JSON that loads; else an argparse error
    (at parse time, naming the flag), not an error at the first forward."""
    if text.endswith(".json") or os.sep in text:
        try:
            load_preset_file(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from err
        return text
    known = preset_names()
    if text not in known:
        raise argparse.ArgumentTypeError(f"unknown calibration preset {text!r}; shipped: "
                                         f"{', '.join(known)} (or a calibration .json file)")
    return text


def add_moe_overlap_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `--moe-overlap*` flags to `parser` and return it (extra_args_provider form)."""
    group = parser.add_argument_group(
        "moe overlap", "Overlapped GEMM2 + combine + reduce-scatter for allgather MoE layers "
                       "(megatron-overlap)")
    group.add_argument("--moe-overlap", action="store_true",
                       help="Make every MoE layer of the model an OverlapMoELayer (GPT, its "
                       "MTP block, HybridModel; any --spec); rank 0 prints at build how many "
                       "are overlapped and why any runs stock. Without it the model is stock.")
    group.add_argument("--moe-overlap-strict", action="store_true",
                       help="With --moe-overlap: a MoE layer that would run stock (another "
                       "dispatcher, fp8, a width the op cannot read, ...) is an error at build.")
    group.add_argument("--moe-overlap-comm-ctas", type=_auto_or_positive_int, default=None,
                       metavar="auto|N", help="Communication CTAs C; auto (default) lets the "
                       "planner choose before every launch; an explicit N wins.")
    group.add_argument("--moe-overlap-splits", type=_auto_or_positive_int, default=None,
                       metavar="auto|N", help="Column splits L; auto = max(1, hidden // 1024).")
    group.add_argument("--moe-overlap-backend", choices=BACKEND_CHOICES, default="auto",
                       help="triton (CUDA), reference (non-overlapped torch path), interpret "
                       "(Triton interpreter on CPU) or auto (triton on CUDA).")
    group.add_argument("--moe-overlap-fuse", choices=FUSE_CHOICES, default="auto",
                       help="auto (default): before each new size the planner predicts the "
                       "fused op against the stock steps it replaces (the device "
                       "calibration's step costs) and each layer runs the faster; always: "
                       "the fused op at every size.")
    group.add_argument("--moe-overlap-no-tail-helpers", action="store_true",
                       help="Leave the last split to the C communication CTAs (default: when "
                       "GEMM2 ends, one more GatherRS CTA per SM it leaves shares it; same "
                       "output either way). Also MEGATRON_OVERLAP_TAIL_HELPERS=0.")
    group.add_argument("--moe-overlap-host-counts", action="store_true",
                       help="Bring the expert counts to the host before each fused launch "
                       "(exact planning, one host sync per MoE layer). Default: where every "
                       "expert is on the rank they stay on the device and no MoE layer "
                       "syncs the host.")
    group.add_argument("--moe-overlap-fp8", action="store_true",
                       help="Fuse MoE layers under --fp8-recipe tensorwise or delayed too "
                       "(TEGroupedMLP; TE quantizes, the op runs GEMM2, TE runs FC2's "
                       "backward; measured at parity with core-TE FP8). Without it FP8 "
                       "layers run stock.")
    group.add_argument("--moe-overlap-fp8-blockwise", action="store_true",
                       help="With --moe-overlap-fp8, fuse under --fp8-recipe blockwise too "
                       "(measured slower than core-TE FP8: for checks and benchmarks).")
    group.add_argument("--moe-overlap-placement", choices=("auto", "shared", "partition"),
                       default="auto",
                       help="Where the communication CTAs run: shared (one beside GEMM2's on "
                       "every SM, the Hopper default), partition (SMs of their own, the "
                       "paper's scheme) or auto (the device default; also "
                       "MEGATRON_OVERLAP_PLACEMENT).")
    group.add_argument("--moe-overlap-calibration", type=_calibration, default=None,
                       metavar="PRESET|FILE",
                       help="Shipped calibration preset (e.g. h200, h100) or a calibration "
                       "JSON (tools/calibrate.py); default: the shipped calibration for this "
                       "device.")
    return parser


ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def moe_overlap_args_provider(other: ArgsProvider | None = None) -> ArgsProvider:
    """An extra_args_provider that runs `other` (if given), then adds the `--moe-overlap*`
    flags: `pretrain(..., extra_args_provider=moe_overlap_args_provider(add_modelopt_args))`.

    Like Megatron's providers, `other` returns the parser (None is taken as "the same one").
    Where `other` already added the flags they are not added twice. Called by Megatron-LM's
    parser (megatron.training loaded), it also hooks megatron.training's model builders
    (`megatron_lm.py`), so that `--moe-overlap` alone overlaps every MoE layer of the model
    the script builds.
    """
    if other is not None and not callable(other):
        raise ValueError(f"extra_args_provider must be callable, got {type(other).__name__}")

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if "megatron.training" in sys.modules:  # Megatron-LM's parser is calling: it parses
            from .megatron_lm import install_build_hooks  # before it builds, so the flag applies

            install_build_hooks()
        if other is not None:
            returned = other(parser)
            parser = parser if returned is None else returned
        if "--moe-overlap" in parser._option_string_actions:  # `other` added them already
            return parser
        return add_moe_overlap_args(parser)

    provider.__name__ = provider.__qualname__ = (
        "add_moe_overlap_args" if other is None
        else f"moe_overlap_args_provider({getattr(other, '__name__', 'provider')})")
    return provider


def overlap_config_from_args(args) -> OverlapConfig | None:
    """OverlapConfig from parsed `--moe-overlap*` flags; None without `--moe-overlap`.

    Missing attributes (a parser without these flags) mean "off"; the flags win over the
    MEGATRON_OVERLAP_* variables (`OverlapConfig.from_env`: this is a launcher's path).
    Raises ValueError for a calibration file that does not exist.
    """
    if not getattr(args, "moe_overlap", False):
        return None
    calibration = getattr(args, "moe_overlap_calibration", None)
    if calibration is not None and (calibration.endswith(".json") or os.sep in calibration) \
            and not os.path.isfile(calibration):
        raise ValueError(f"--moe-overlap-calibration: no such file {calibration!r}")
    return OverlapConfig.from_env(
        backend=getattr(args, "moe_overlap_backend", "auto"),
        comm_ctas=getattr(args, "moe_overlap_comm_ctas", None),
        splits=getattr(args, "moe_overlap_splits", None),
        preset=calibration,
        **({"placement": placement} if (placement := getattr(
            args, "moe_overlap_placement", "auto")) != "auto" else {}),
        **({"tail_helpers": False} if getattr(args, "moe_overlap_no_tail_helpers", False)
           else {}),
    )


def layer_policy_from_args(args) -> LayerPolicy:
    """The layers' LayerPolicy from parsed `--moe-overlap-fuse` / `--moe-overlap-host-counts`
    / `--moe-overlap-fp8` / `--moe-overlap-fp8-blockwise` flags (missing attributes: the
    defaults)."""
    return LayerPolicy(fuse=getattr(args, "moe_overlap_fuse", "auto"),
                       host_counts=getattr(args, "moe_overlap_host_counts", False),
                       fp8=getattr(args, "moe_overlap_fp8", False),
                       fp8_blockwise=getattr(args, "moe_overlap_fp8_blockwise", False))
