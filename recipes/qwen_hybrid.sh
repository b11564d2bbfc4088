#!/usr/bin/env bash
# Qwen1.5-MoE-A2.7B as a HybridModel (Megatron-Core 0.19's successor of GPTModel), trained by
# Megatron-LM's pretrain_hybrid.py, every MoE layer an OverlapMoELayer (--moe-overlap).
# HybridModel counts attention and MoE as layers of their own: one Qwen layer is the pattern
# "*E" (attention, then MoE), so NUM_LAYERS (24) Qwen layers give 2 x NUM_LAYERS hybrid
# layers; HYBRID_LAYER_PATTERN replaces the whole pattern (Megatron's symbols: * attention,
# E MoE, - MLP, M Mamba, which needs mamba-ssm). The spec is Megatron's own default
# hybrid_stack_spec (TE, TEGroupedMLP experts). Everything else as recipes/qwen.sh: layout,
# data and training from the environment, MOE_OVERLAP=0 for the stock layer.
set -euo pipefail

export SCRIPT=pretrain_hybrid.py
NUM_LAYERS=${NUM_LAYERS:-24}
PATTERN=${HYBRID_LAYER_PATTERN:-$(printf '*E%.0s' $(seq "$NUM_LAYERS"))}
# (pretrain_hybrid.py derives the depth from the pattern; the GPT depth qwen.sh passes is
# set to match so Megatron-LM has nothing to warn about)
export NUM_LAYERS=$(( ${#PATTERN} ))
exec bash "$(dirname "${BASH_SOURCE[0]}")/qwen.sh" --hybrid-layer-pattern "$PATTERN" "$@"
