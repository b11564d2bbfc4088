#!/usr/bin/env bash
# Granite-3.1-1B-A400M (ibm-granite/granite-3.1-1b-a400m-instruct) trained by Megatron-LM's pretrain_gpt.py,
# every MoE layer an OverlapMoELayer (--moe-overlap). Layout from the environment: TP (1),
# EP (1), GPUS_PER_NODE (TP x EP), NNODES (1), MASTER_ADDR, MASTER_PORT; e.g.
#   TP=1 EP=2 MEGATRON_LM=~/Megatron-LM bash recipes/granite.sh    # TP1EP2 on 2 GPUs
# (checked layouts: TP1EP1 TP2EP1 TP1EP2 TP2EP2 TP4EP1 TP1EP4). Data: DATA_PATH (a Megatron .bin/.idx prefix,
# TOKENIZER_MODEL), else --mock-data. Extra arguments are Megatron-LM's or ours, e.g.
# --moe-overlap-calibration h200 or --moe-overlap-comm-ctas 8; without --moe-overlap
# (MOE_OVERLAP=0) the same line trains Megatron's stock MoE layer. NUM_LAYERS sets the depth.
# Numbers: megatron_overlap/mcore/models.py granite_config (the published config.json).
# Not expressible as Megatron-LM flags: attention_multiplier 0.015625 (Megatron scales by
# 1/sqrt(64)) and the embedding / residual / logits multipliers (12, 0.22, 6): element-wise,
# same shapes and MoE cost.
set -euo pipefail

MODEL_ARGS=(
    --transformer-impl transformer_engine
    --num-layers "${NUM_LAYERS:-24}"
    --hidden-size 1024
    --ffn-hidden-size 512
    --num-attention-heads 16
    --group-query-attention
    --num-query-groups 8
    --seq-length "${SEQ:-4096}"
    --max-position-embeddings 131072
    --position-embedding-type rope
    --rotary-base 1500000
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --disable-bias-linear
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

MOE_ARGS=(
    --num-experts 32
    --moe-router-topk 8
    --moe-ffn-hidden-size 512
    --moe-router-dtype fp32
    --moe-router-load-balancing-type none
    --moe-aux-loss-coeff 0.0
    --moe-grouped-gemm
    --moe-token-dispatcher-type allgather
)

RECIPE=recipes/granite.sh
HF_TOKENIZER=ibm-granite/granite-3.1-1b-a400m-instruct
VOCAB_SIZE=49155
# the layout, data, training and launch arguments every recipe shares
source "$(dirname "${BASH_SOURCE[0]}")/common.bash"
