"""Megatron-Core integration: OverlapMoELayer, spec helpers, launch flags, model builders.

Importing this package imports megatron.core (the rest of megatron_overlap does not).

    from megatron_overlap.mcore import add_moe_overlap_args, overlap_config_from_args, \
        with_overlap_moe
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    spec = with_overlap_moe(spec, overlap_config_from_args(args))

or, in a Megatron-LM launch: `--spec megatron_overlap.mcore moe_overlap_gpt_spec --moe-overlap`
with `extra_args_provider=add_moe_overlap_args`.
"""

from .args import add_moe_overlap_args, overlap_config_from_args
from .layer import OverlapMoELayer
from .models import build_deepseek, build_granite, build_model, build_qwen
from .spec import moe_overlap_gpt_spec, with_overlap_moe

__all__ = [
    "OverlapMoELayer", "add_moe_overlap_args", "build_deepseek", "build_granite", "build_model",
    "build_qwen", "moe_overlap_gpt_spec", "overlap_config_from_args", "with_overlap_moe",
]
