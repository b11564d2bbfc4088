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

For benchmarks and A/B runs of a built model (the prefill launcher, tools/bench_layer.py):
`init_parallel(tp, ep)` sets up the process group and Megatron's parallel state that
`build_model` needs, `model_config` gives a model's config without weights,
`token_inputs` a prefill's random tokens; `set_overlap_enabled(model, on)` switches
every OverlapMoELayer between stock and overlapped, `fused_at_every_size(model)` fuses
them at every size (as a CUDA-graph capture runs them); `set_moe_fusions(model, on)` sets
Megatron's `--moe-permute-fusion --moe-router-fusion` on the built model, the flag sets
a benchmark compares being `BASELINES` (`add_baseline_args` / `baselines_from_args`:
the `--baselines` / `--moe-fusions` flags; `check_moe_fusions_available` before a fused
run).
"""

from .args import (add_moe_overlap_args, layer_policy_from_args, moe_overlap_args_provider,
                   overlap_config_from_args)
from .baselines import (BASELINES, add_baseline_args, baselines_from_args,
                        check_moe_fusions_available, set_moe_fusions)
from .convert import (OverlapBuildError, OverlapReport, fused_at_every_size, overlap_moe_layers,
                      set_overlap_enabled)
from .experts import GroupedGemmExperts
from .hf import load_hf_checkpoint
from .layer import OverlapMoELayer
from .models import build_deepseek, build_granite, build_model, build_qwen, model_config
from .policy import LayerPolicy
from .parallel import init_parallel, token_inputs
from .spec import moe_overlap_gpt_spec, with_grouped_experts, with_overlap_moe

__all__ = [
    "GroupedGemmExperts", "LayerPolicy", "OverlapBuildError", "OverlapMoELayer",
    "OverlapReport", "add_moe_overlap_args", "overlap_moe_layers",
    "build_deepseek", "layer_policy_from_args",
    "build_granite", "build_model", "build_qwen", "load_hf_checkpoint", "moe_overlap_args_provider",
    "moe_overlap_gpt_spec", "overlap_config_from_args", "with_grouped_experts",
    "with_overlap_moe",
    # benchmarks and A/B runs of a built model (the docstring's last paragraph)
    "BASELINES", "add_baseline_args", "baselines_from_args", "check_moe_fusions_available",
    "fused_at_every_size", "init_parallel", "model_config", "set_moe_fusions",
    "set_overlap_enabled", "token_inputs",
]
