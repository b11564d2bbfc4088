#!/usr/bin/env bash
# Granite-3.1-1B-A400M (ibm-granite/granite-3.1-1b-a400m-instruct) trained by Megatron-LM's pretrain_gpt.py,
# every MoE layer an OverlapMoELayer (--moe-overlap). Layout from the environment: TP (1),
# EP (1), GPUS_PER_NODE (TP x EP), NNODES (1), MASTER_ADDR, MASTER_PORT; e.g.
#   TP=1 EP=2 MEGATRON_LM=~/Megatron-LM bash recipes/granite.sh    # TP1EP2 on 2 GPUs
# (checked layouts: TP1EP1 TP2EP1 TP1EP2 TP2EP2 TP4EP1 TP1EP4). Data: DATA_PATH (a Megatron .bin/.idx prefix,
# TOKENIZER_MODEL), else --mock-data. Extra arguments are Megatron-LM's or ours, e.g.
# --moe-overlap-calibration h200 or --moe-overlap-comm-ctas 8; without --moe-overlap
# (OVERLAP_ARGS) the same line trains Megatron's stock MoE layer.
# Numbers: megatron_overlap/mcore/models.py granite_config (the published config.json).
# Not expressible as Megatron-LM flags: attention_multiplier 0.015625 (Megatron scales by
# 1/sqrt(64)) and the embedding / residual / logits multipliers (12, 0.22, 6): element-wise,
# same shapes and MoE cost.
set -euo pipefail

TP=${TP:-1}
EP=${EP:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-$((TP * EP))}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
MEGATRON_LM=${MEGATRON_LM:-.}
if [[ ! -f "$MEGATRON_LM/pretrain_gpt.py" ]]; then
    echo "recipes/granite.sh: no pretrain_gpt.py in MEGATRON_LM=$MEGATRON_LM (a Megatron-LM checkout)" >&2
    exit 2
fi
DP=$((GPUS_PER_NODE * NNODES / TP))
export CUDA_DEVICE_MAX_CONNECTIONS=1
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0  # NVLink multicast stays off

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE"
    --nnodes "$NNODES"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

MODEL_ARGS=(
    --transformer-impl transformer_engine
    --num-layers 24
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

OVERLAP_ARGS=(
    --spec megatron_overlap.mcore moe_overlap_gpt_spec
    --moe-overlap
)

if [[ -n "${DATA_PATH:-}" ]]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --split 99,1,0 --tokenizer-type HuggingFaceTokenizer
               --tokenizer-model "${TOKENIZER_MODEL:-ibm-granite/granite-3.1-1b-a400m-instruct}")
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 49155)
fi

TRAINING_ARGS=(
    --micro-batch-size "${MICRO_BATCH:-4}"
    --global-batch-size "${GLOBAL_BATCH:-$((${MICRO_BATCH:-4} * DP))}"
    --train-iters "${TRAIN_ITERS:-100}"
    --lr 1e-4
    --min-lr 1e-5
    --lr-decay-style cosine
    --lr-warmup-iters 10
    --weight-decay 0.1
    --clip-grad 1.0
    --bf16
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --expert-model-parallel-size "$EP"
)
if ((TP > 1)); then
    MODEL_PARALLEL_ARGS+=(--sequence-parallel)  # Megatron requires it for MoE under TP
fi

LOGGING_ARGS=(
    --log-interval 10
    --eval-iters 0
)
if [[ -n "${CHECKPOINT_PATH:-}" ]]; then
    LOGGING_ARGS+=(--save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH")
fi

# Megatron-LM's pretrain_gpt.py, unmodified: megatron_overlap.mcore.launch runs it with the
# --moe-overlap* flags added to its parser (its own extra_args_provider kept).
exec torchrun "${DISTRIBUTED_ARGS[@]}" -m megatron_overlap.mcore.launch "$MEGATRON_LM/pretrain_gpt.py" \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${OVERLAP_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"
