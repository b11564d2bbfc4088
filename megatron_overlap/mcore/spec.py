"""Spec helpers: install OverlapMoELayer (and GroupedGemmExperts) in any GPT spec.

A GPT layer or block spec is a tree of ModuleSpecs, functools.partials and submodule
dataclasses. The MoE layer appears as `partial(MoELayer, submodules=MoESubmodules(...))`
in megatron-core >= 0.18 and as `ModuleSpec(module=MoELayer, submodules=...)` in <= 0.17.
The helpers walk the whole tree (block -> layer specs -> mlp, MTP blocks, anything nested),
rebuild only the paths that change, and never modify the spec they are given. The
dispatcher has no spec entry in megatron-core 0.19 (`MoESubmodules` names the experts,
shared experts and router): OverlapMoELayer installs its own (`dispatch.py` says how).

For Megatron-LM launch scripts (`pretrain_gpt.py`: core_v0.19's GPTModelBuilder calls the
object named by `--spec`, older gpt_builders hand it to GPTModel as a block spec;
`megatron_overlap.mcore.launch` adds our flags to its parser):

    --spec megatron_overlap.mcore moe_overlap_gpt_spec  --moe-overlap ...
    (with extra_args_provider=moe_overlap_args_provider(its own provider))

`moe_overlap_gpt_spec` is a block spec that resolves itself from Megatron's global args
on first use: the spec Megatron-LM's builder picks from the same flags
(`get_gpt_decoder_block_spec`, TE or local), with OverlapMoELayer in place of MoELayer when
`--moe-overlap` is set. Under `--transformer-impl local --moe-grouped-gemm` its experts are
GroupedGemmExperts with or without `--moe-overlap` (megatron-core 0.19's local spec has no
grouped experts and would build SequentialMLP; ours draw the same initial weights), so
the stock and overlapped runs of one command line compare the same experts. Under the TE
spec the experts stay Megatron's (TEGroupedMLP with `--moe-grouped-gemm`, else
SequentialMLP of TE linears). Frameworks that call a callable spec get the same from
`moe_overlap_gpt_spec(args, config, vp_stage)` or, as megatron.training's
GPTModelBuilder calls it, `moe_overlap_gpt_spec(gpt_model_config, vp_stage=...)`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from ..ops import OverlapConfig
from .architectures import with_latent_kv_norm_where_needed
from .args import layer_policy_from_args, overlap_config_from_args
from .policy import LayerPolicy
from .experts import GroupedGemmExperts
from .layer import OverlapMoELayer, checked_overlap_args


def _moe_class(obj):
    """The MoELayer (sub)class `obj` builds, or None when it builds something else."""
    target = obj.func if isinstance(obj, functools.partial) else getattr(obj, "module", None)
    if isinstance(obj, ModuleSpec) and isinstance(target, tuple):  # ("pkg.module", "Name")
        try:
            target = getattr(__import__(target[0], fromlist=[target[1]]), target[1], None)
        except ImportError:
            return None
    if isinstance(target, type) and issubclass(target, MoELayer):
        return target
    return None


def _rewrite(obj, fn, memo: dict):
    """A copy of the spec tree with every MoE node replaced by fn(node); shares the rest."""
    key = id(obj)
    if key in memo:
        return memo[key]
    if (isinstance(obj, (functools.partial, ModuleSpec))) and _moe_class(obj) is not None:
        new = fn(obj)
    elif isinstance(obj, functools.partial):
        args = [_rewrite(a, fn, memo) for a in obj.args]
        kwargs = {k: _rewrite(v, fn, memo) for k, v in obj.keywords.items()}
        changed = any(a is not b for a, b in zip(args, obj.args)) or any(
            kwargs[k] is not v for k, v in obj.keywords.items())
        new = functools.partial(obj.func, *args, **kwargs) if changed else obj
    elif isinstance(obj, dict):
        items = {k: _rewrite(v, fn, memo) for k, v in obj.items()}
        new = items if any(items[k] is not v for k, v in obj.items()) else obj
    elif isinstance(obj, (list, tuple)):
        items = [_rewrite(v, fn, memo) for v in obj]
        changed = any(a is not b for a, b in zip(items, obj))
        new = type(obj)(items) if changed else obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        updates = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            replaced = _rewrite(value, fn, memo)
            if replaced is not value:
                updates[f.name] = replaced
        new = obj
        if updates:
            new = copy.copy(obj)
            for name, value in updates.items():
                object.__setattr__(new, name, value)  # also works for frozen dataclasses
    else:
        new = obj
    memo[key] = new
    return new


def _swap(node, cls, extra: dict, submodules_fn=None):
    """`node` (partial or ModuleSpec building a MoELayer) rebuilt for `cls` with `extra`."""
    if isinstance(node, functools.partial):
        kwargs = dict(node.keywords, **extra)
        if submodules_fn is not None:
            kwargs["submodules"] = submodules_fn(kwargs.get("submodules"))
        return functools.partial(cls, *node.args, **kwargs)
    new = copy.copy(node)
    new.module = cls
    new.params = dict(node.params, **extra)
    if submodules_fn is not None:
        new.submodules = submodules_fn(node.submodules)
    return new


def with_overlap_moe(spec, overlap_config: OverlapConfig | None = None,
                     policy: LayerPolicy | None = None):
    """A copy of `spec` whose MoE layers are OverlapMoELayer(overlap_config=overlap_config,
    policy=policy): the op's configuration, and the layer's own (fuse or not, host counts).

    spec: any GPT layer spec (ModuleSpec), block spec (TransformerBlockSubmodules), list of
    layer specs, or MoE spec itself, in the partial form (>= 0.18) or ModuleSpec form
    (<= 0.17). A spec without MoE layers comes back unchanged. An OverlapMoELayer already
    there gets the new config. A custom MoELayer subclass raises ValueError (we cannot
    know it keeps the two override points intact).
    """
    checked_overlap_args(overlap_config, policy)

    def swap(node):
        cls = _moe_class(node)
        if cls is not MoELayer and not issubclass(cls, OverlapMoELayer):
            raise ValueError(f"cannot install OverlapMoELayer over the custom MoE class "
                             f"{cls.__qualname__}; only megatron.core MoELayer is swapped")
        return _swap(node, OverlapMoELayer, {"overlap_config": overlap_config,
                                              "policy": policy})

    return _rewrite(spec, swap, {})


def with_grouped_experts(spec):
    """A copy of `spec` whose MoE layers build GroupedGemmExperts (router and shared
    experts kept), in both spec forms; for the non-TE baseline and the overlap."""

    def submodules(old):
        if old is None:
            raise ValueError("a MoE spec without submodules cannot take GroupedGemmExperts")
        if isinstance(old, MoESubmodules):
            return dataclasses.replace(old, experts=GroupedGemmExperts)
        new = copy.copy(old)  # <= 0.17: a MoESubmodules-like dataclass of ModuleSpecs
        new.experts = GroupedGemmExperts
        return new

    return _rewrite(spec, lambda node: _swap(node, _moe_class(node), {}, submodules), {})


def moe_layer_specs(spec) -> list:
    """Every MoE node (partial or ModuleSpec) inside `spec`, in walk order (for checks)."""
    found = []

    def note(node):
        found.append(node)
        return node

    _rewrite(spec, note, {})
    return found


# ---------------------------------------------------------------- Megatron-LM --spec
def gpt_block_spec_from_args(args, config, vp_stage: int | None = None):
    """The GPT spec Megatron-LM's gpt_builders picks from `args`, with GroupedGemmExperts
    under `--transformer-impl local --moe-grouped-gemm` and OverlapMoELayer if
    `--moe-overlap` (see the module docstring). RuntimeError for the TE spec (Megatron-LM's
    default `--transformer-impl transformer_engine`) where Megatron-Core found no TE."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    impl = getattr(args, "transformer_impl", "local")
    if impl not in ("local", "transformer_engine"):
        raise ValueError(f"moe_overlap_gpt_spec builds the 'transformer_engine' or 'local' "
                         f"spec, not --transformer-impl {impl}")
    use_te = impl == "transformer_engine"
    if use_te and gpt_layer_specs.TESpecProvider is None:
        raise RuntimeError(
            "--transformer-impl transformer_engine (Megatron-LM's default) needs Transformer "
            "Engine, which megatron.core could not import here (pip install "
            "megatron-overlap[te]); or pass --transformer-impl local (add --moe-grouped-gemm "
            "for grouped experts)")
    if getattr(args, "num_experts", None):
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization=args.normalization,
            qk_l2_norm=getattr(args, "qk_l2_norm", False), vp_stage=vp_stage)
    else:  # dense model: nothing to swap
        build = get_gpt_layer_with_transformer_engine_spec if use_te else get_gpt_layer_local_spec
        return build(num_experts=None, moe_grouped_gemm=False, qk_layernorm=args.qk_layernorm,
                     multi_latent_attention=args.multi_latent_attention)
    if not use_te and getattr(args, "moe_grouped_gemm", False):
        spec = with_grouped_experts(spec)
    # DeepSeek-V2-Lite's KV-latent norm, which Megatron's own spec cannot place without
    # also norming the query input (architectures.py): the stock arm of this spec too
    spec = with_latent_kv_norm_where_needed(config, spec)
    overlap = overlap_config_from_args(args)
    return (spec if overlap is None
            else with_overlap_moe(spec, overlap, layer_policy_from_args(args)))


def _megatron_args():
    try:
        from megatron.training import get_args
    except ImportError as err:  # megatron.training needs Python >= 3.12 in 0.19
        raise RuntimeError("moe_overlap_gpt_spec resolves from Megatron-LM's global args "
                           f"(megatron.training), which failed to import: {err}") from err
    return get_args()


def _megatron_args_and_config():
    args = _megatron_args()
    from megatron.training.arguments import core_transformer_config_from_args

    return args, core_transformer_config_from_args(args)


class _ArgsBlockSpec(TransformerBlockSubmodules):
    """A TransformerBlockSubmodules that builds itself from Megatron's args when read.

    Megatron-LM's builders give the `--spec` object to GPTModel unchanged, before any
    config exists at import time; so the fields resolve lazily (once per process). Virtual
    pipeline stages need the callable form: `moe_overlap_gpt_spec(args, config, vp_stage)`.
    """

    def __init__(self):  # no dataclass fields stored: they are the properties below
        self._resolved = None

    def _resolve(self) -> TransformerBlockSubmodules:
        if self._resolved is None:
            args, config = _megatron_args_and_config()
            if getattr(args, "virtual_pipeline_model_parallel_size", None):
                raise ValueError("moe_overlap_gpt_spec cannot know the virtual pipeline stage; "
                                 "call moe_overlap_gpt_spec(args, config, vp_stage) from a model "
                                 "provider instead")
            spec = gpt_block_spec_from_args(args, config)
            if not isinstance(spec, TransformerBlockSubmodules):  # dense: one layer spec
                from megatron.core.transformer.transformer_block import _get_block_submodules

                spec = _get_block_submodules(config, spec)
            self._resolved = spec
        return self._resolved

    layer_specs = property(lambda self: self._resolve().layer_specs)
    layer_norm = property(lambda self: self._resolve().layer_norm)

    def __call__(self, args, config=None, vp_stage: int | None = None):
        """(args, TransformerConfig, vp_stage), or megatron.training's GPTModelBuilder form
        (GPTModelConfig, vp_stage=...), whose args are Megatron's global ones."""
        if config is None:
            if not hasattr(args, "transformer"):
                raise ValueError("moe_overlap_gpt_spec(args, config, vp_stage) or "
                                 "moe_overlap_gpt_spec(gpt_model_config, vp_stage=...)")
            config = args.transformer
            args = _megatron_args()
        return gpt_block_spec_from_args(args, config, vp_stage)

    def __repr__(self) -> str:
        return "moe_overlap_gpt_spec (resolved from Megatron args on first use)"


#: `--spec megatron_overlap.mcore moe_overlap_gpt_spec` (see the module docstring).
moe_overlap_gpt_spec = _ArgsBlockSpec()
