"""Megatron-Core integration: OverlapMoELayer, spec helpers, launch flags, model builders.

Importing this package imports megatron.core (the rest of megatron_overlap does not).

    from megatron_overlap.mcore import overlap_config_from_args, with_grouped_experts, \
        with_overlap_moe
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    spec = with_grouped_experts(spec)  # non-TE grouped experts (else SequentialMLP)
    spec = with_overlap_moe(spec, overlap_config_from_args(args), layer_policy_from_args(args))

or, on a model already built by any builder, `overlap_moe_layers(model, config, policy)`
(convert.py); in a Megatron-LM launch `--moe-overlap` alone, through
`torchrun ... -m megatron_overlap.mcore.launch pretrain_gpt.py ...` (recipes/) or a script
passing `extra_args_provider=moe_overlap_args_provider(its_own_provider_or_None)`
(megatron_lm.py). `load_hf_checkpoint(folder, tp, ep, overlap=...)`
builds the same models from a local Hugging Face checkpoint (hf.py).
"""

from .args import (add_moe_overlap_args, layer_policy_from_args, moe_overlap_args_provider,
                   overlap_config_from_args)
from .convert import OverlapBuildError, OverlapReport, overlap_moe_layers
from .experts import GroupedGemmExperts
from .hf import load_hf_checkpoint
from .layer import OverlapMoELayer
from .models import build_deepseek, build_granite, build_model, build_qwen
from .policy import LayerPolicy
from .spec import moe_overlap_gpt_spec, with_grouped_experts, with_overlap_moe

__all__ = [
    "GroupedGemmExperts", "LayerPolicy", "OverlapBuildError", "OverlapMoELayer",
    "OverlapReport", "add_moe_overlap_args", "overlap_moe_layers",
    "build_deepseek", "layer_policy_from_args",
    "build_granite", "build_model", "build_qwen", "load_hf_checkpoint", "moe_overlap_args_provider",
    "moe_overlap_gpt_spec", "overlap_config_from_args", "with_grouped_experts",
    "with_overlap_moe",
]
