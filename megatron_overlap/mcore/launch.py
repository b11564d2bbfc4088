"""Run a Megatron-LM training script unmodified, its parser taking the `--moe-overlap*` flags.

    torchrun $DISTRIBUTED_ARGS -m megatron_overlap.mcore.launch $MEGATRON_LM/pretrain_gpt.py \
        <Megatron-LM arguments> --moe-overlap

Megatron-LM's scripts parse their flags with `megatron.training.arguments.parse_args`
(`pretrain_gpt.py` through `parse_and_validate_args`, which calls it), passing one
`extra_args_provider` (modelopt's `add_modelopt_args` where modelopt is installed). Before
running the script as `__main__` (its directory first on sys.path, as `python script.py`
would put it), this wraps that function so that the provider it is given becomes
`moe_overlap_args_provider(provider)`: the script's own flags stay, ours are added. A script
edited to pass `moe_overlap_args_provider(...)` itself runs the same (the flags are added
once). It also hooks megatron.training's model builders (`megatron_lm.py`), so that
`--moe-overlap` alone makes every MoE layer of the model the script builds (GPT, its MTP
block, HybridModel; any `--spec`) an OverlapMoELayer, and rank 0 prints at build how many
are. Everything else is the script's: data, training loop, checkpoints, logging.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys

from .args import moe_overlap_args_provider
from .megatron_lm import install_build_hooks

USAGE = ("usage: python -m megatron_overlap.mcore.launch SCRIPT.py [SCRIPT ARGUMENTS...]\n"
         "(e.g. Megatron-LM's pretrain_gpt.py, under torchrun -m)")


def install() -> None:
    """Wrap `megatron.training.arguments.parse_args` (once) to add the `--moe-overlap*` flags,
    and hook the model builders (`megatron_lm.install_build_hooks`)."""
    from megatron.training import arguments

    install_build_hooks()

    if getattr(arguments.parse_args, "_moe_overlap", False):
        return
    original = arguments.parse_args

    @functools.wraps(original)
    def parse_args(extra_args_provider=None, *args, **kwargs):
        return original(moe_overlap_args_provider(extra_args_provider), *args, **kwargs)

    parse_args._moe_overlap = True
    arguments.parse_args = parse_args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or not argv[0].endswith(".py"):
        raise SystemExit(USAGE)
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        raise SystemExit(f"megatron_overlap.mcore.launch: no such script {argv[0]!r}\n{USAGE}")
    install()
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(script))  # its sibling modules (gpt_builders, ...)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
