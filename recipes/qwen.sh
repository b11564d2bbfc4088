#!/usr/bin/env bash
# Qwen1.5-MoE-A2.7B (Qwen/Qwen1.5-MoE-A2.7B) trained by Megatron-LM's pretrain_gpt.py,
# every MoE layer an OverlapMoELayer (--moe-overlap). Layout from the environment: TP (1),
# EP (1), GPUS_PER_NODE (TP x EP), NNODES (1), MASTER_ADDR, MASTER_PORT; e.g.
#   TP=1 EP=2 MEGATRON_LM=~/Megatron-LM bash recipes/qwen.sh    # TP1EP2 on 2 GPUs
# (checked layouts: TP1EP1 TP2EP1 TP1EP2 TP2EP2 TP4EP1 TP1EP4). Data: DATA_PATH (a Megatron .bin/.idx prefix,
# TOKENIZER_MODEL), else --mock-data. Extra arguments are Megatron-LM's or ours, e.g.
# --moe-overlap-calibration h200 or --moe-overlap-comm-ctas 8; without --moe-overlap
# (MOE_OVERLAP=0) the same line trains Megatron's stock MoE layer. NUM_LAYERS sets the depth.
# Numbers: megatron_overlap/mcore/models.py qwen_config (the published config.json).
set -euo pipefail

MODEL_ARGS=(
    --transformer-impl transformer_engine
    --num-layers "${NUM_LAYERS:-24}"
    --hidden-size 2048
    --ffn-hidden-size 5632
    --num-attention-heads 16
    --seq-length "${SEQ:-4096}"
    --max-position-embeddings 32768
    --position-embedding-type rope
    --rotary-base 1000000
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --disable-bias-linear
    --add-qkv-bias
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

MOE_ARGS=(
    --num-experts 60
    --moe-router-topk 4
    --moe-ffn-hidden-size 1408
    --moe-router-pre-softmax
    --moe-router-dtype fp32
    --moe-shared-expert-intermediate-size 5632
    --moe-shared-expert-gate
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 0.001
    --moe-grouped-gemm
    --moe-token-dispatcher-type allgather
)

RECIPE=recipes/qwen.sh
HF_TOKENIZER=Qwen/Qwen1.5-MoE-A2.7B
VOCAB_SIZE=151936
# the layout, data, training and launch arguments every recipe shares
source "$(dirname "${BASH_SOURCE[0]}")/common.bash"
