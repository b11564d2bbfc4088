#!/usr/bin/env bash
# DeepSeek-V2-Lite (deepseek-ai/DeepSeek-V2-Lite) trained by Megatron-LM's pretrain_gpt.py,
# every MoE layer an OverlapMoELayer (--moe-overlap). Layout from the environment: TP (1),
# EP (1), GPUS_PER_NODE (TP x EP), NNODES (1), MASTER_ADDR, MASTER_PORT; e.g.
#   TP=1 EP=2 MEGATRON_LM=~/Megatron-LM bash recipes/deepseek.sh    # TP1EP2 on 2 GPUs
# (checked layouts: TP1EP1 TP2EP1 TP1EP2 TP2EP2 TP4EP1 TP1EP4). Data: DATA_PATH (a Megatron .bin/.idx prefix,
# TOKENIZER_MODEL), else --mock-data. Extra arguments are Megatron-LM's or ours, e.g.
# --moe-overlap-calibration h200 or --moe-overlap-comm-ctas 8; without --moe-overlap
# (MOE_OVERLAP=0) the same line trains Megatron's stock MoE layer. NUM_LAYERS sets the depth.
# Numbers: megatron_overlap/mcore/models.py deepseek_config (the published config.json).
# The first layer is dense (--moe-layer-freq); MLA with YaRN rope. No --qk-layernorm: with
# q_lora_rank null Megatron would also norm the query input, which DeepSeek-V2-Lite lacks;
# moe_overlap_gpt_spec places its KV-latent norm itself (architectures.with_latent_kv_norm),
# so keep the --spec also for the stock arm (drop only --moe-overlap from OVERLAP_ARGS).
set -euo pipefail

MODEL_ARGS=(
    --transformer-impl transformer_engine
    --num-layers "${NUM_LAYERS:-27}"
    --hidden-size 2048
    --ffn-hidden-size 10944
    --num-attention-heads 16
    --multi-latent-attention
    --kv-lora-rank 512
    --qk-head-dim 128
    --qk-pos-emb-head-dim 64
    --v-head-dim 128
    --seq-length "${SEQ:-4096}"
    --max-position-embeddings 163840
    --position-embedding-type rope
    --rope-type yarn
    --rotary-base 10000
    --rotary-scaling-factor 40
    --yarn-original-max-position-embeddings 4096
    --yarn-beta-fast 32
    --yarn-beta-slow 1
    --mscale 0.707
    --mscale-all-dim 0.707
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

MOE_ARGS=(
    --num-experts 64
    --moe-router-topk 6
    --moe-ffn-hidden-size 1408
    --moe-layer-freq "${MOE_LAYER_FREQ:-([0]+[1]*$((${NUM_LAYERS:-27} - 1)))}"
    --moe-router-pre-softmax
    --moe-router-dtype fp32
    --moe-shared-expert-intermediate-size 2816
    --moe-router-load-balancing-type seq_aux_loss
    --moe-aux-loss-coeff 0.001
    --moe-grouped-gemm
    --moe-token-dispatcher-type allgather
)

RECIPE=recipes/deepseek.sh
HF_TOKENIZER=deepseek-ai/DeepSeek-V2-Lite
VOCAB_SIZE=102400
# the layout, data, training and launch arguments every recipe shares
source "$(dirname "${BASH_SOURCE[0]}")/common.bash"
