"""`--moe-overlap` as the whole switch in Megatron-LM's training scripts.

Megatron-LM core_r0.19 builds its models in `megatron.training`: `pretrain_gpt.py` and
`pretrain_hybrid.py` through the builders `GPTModelBuilder` / `HybridModelBuilder`
(`build_model` once per pipeline stage, before any DDP wrap), older or custom scripts
through `training.get_model(model_provider)`. `install_build_hooks()` wraps those three
(once per process) so that every model they build passes through `overlap_from_args`:
with `--moe-overlap` every MoE layer in it becomes an OverlapMoELayer
(`convert.overlap_moe_layers`: GPT from Megatron's own spec choice or from a user's
`--spec`, the MTP block, HybridModel, `--transformer-impl transformer_engine` or
`local`), and rank 0 prints one line per model built: how many MoE layers are overlapped,
with which experts and dispatcher, and each one that runs stock with its reason
(`--moe-overlap-strict` makes such a layer an error). Without `--moe-overlap` the hooks
return the model untouched.

The launcher (`megatron_overlap.mcore.launch`) installs them; so does the flags'
`extra_args_provider` (`moe_overlap_args_provider`) in an edited script, since Megatron
calls it while parsing, before any model exists. `--spec megatron_overlap.mcore
moe_overlap_gpt_spec` keeps working: its layers already are OverlapMoELayers, which the
hook counts and never wraps twice.
"""

from __future__ import annotations

import functools

import torch

from .args import layer_policy_from_args, overlap_config_from_args
from .convert import OverlapReport, overlap_moe_layers

_HOOKED = "_moe_overlap_hook"


def overlap_from_args(model, args) -> OverlapReport | None:
    """Apply the parsed `--moe-overlap*` flags to a built model (a module or a list of
    stage modules) and print the report on rank 0; None (model untouched) without
    `--moe-overlap`."""
    overlap = overlap_config_from_args(args)
    if overlap is None:
        return None
    report = overlap_moe_layers(model, overlap, layer_policy_from_args(args),
                                strict=getattr(args, "moe_overlap_strict", False))
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(report.summary(), flush=True)
    return report


def _megatron_args():
    from megatron.training import get_args

    return get_args()


def _refuse_gpt_spec_in_hybrid(builder) -> None:
    from .spec import moe_overlap_gpt_spec

    if getattr(builder._model_config, "hybrid_stack_spec", None) is moe_overlap_gpt_spec:
        raise ValueError(
            "--spec megatron_overlap.mcore moe_overlap_gpt_spec is a GPT block spec; "
            "pretrain_hybrid.py takes a hybrid stack spec (e.g. --spec "
            "megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec): pass that, "
            "and --moe-overlap alone overlaps its MoE layers")


def _wrap_builder(builder_cls, check=None) -> None:
    build = builder_cls.build_model
    if getattr(build, _HOOKED, False):
        return

    @functools.wraps(build)
    def build_model(self, *args, **kwargs):
        if check is not None:
            check(self)
        model = build(self, *args, **kwargs)
        overlap_from_args(model, _megatron_args())
        return model

    setattr(build_model, _HOOKED, True)
    builder_cls.build_model = build_model


def _wrap_get_model(training) -> None:
    get_model = training.get_model
    if getattr(get_model, _HOOKED, False):
        return

    @functools.wraps(get_model)
    def hooked_get_model(model_provider_func, *args, **kwargs):
        @functools.wraps(model_provider_func)
        def provider(*p_args, **p_kwargs):
            model = model_provider_func(*p_args, **p_kwargs)
            overlap_from_args(model, _megatron_args())
            return model

        return get_model(provider, *args, **kwargs)

    setattr(hooked_get_model, _HOOKED, True)
    training.get_model = hooked_get_model


def install_build_hooks() -> None:
    """Hook Megatron-LM's model builders (module doc); idempotent. Builders this
    megatron.training lacks (older releases) are skipped; `get_model` is always there."""
    from megatron.training import training

    _wrap_get_model(training)
    try:
        from megatron.training.models.gpt import GPTModelBuilder
        from megatron.training.models.hybrid import HybridModelBuilder
    except ImportError:  # megatron-core < 0.19: every script builds through get_model
        return
    _wrap_builder(GPTModelBuilder)
    _wrap_builder(HybridModelBuilder, _refuse_gpt_spec_in_hybrid)
