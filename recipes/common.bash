# Sourced by recipes/<model>.sh after MODEL_ARGS, MOE_ARGS, RECIPE, HF_TOKENIZER and
# VOCAB_SIZE: the layout from the environment (TP, EP, GPUS_PER_NODE, NNODES, NODE_RANK,
# MASTER_ADDR, MASTER_PORT, MEGATRON_LM), data, training, logging, and the launch.

TP=${TP:-1}
EP=${EP:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-$((TP * EP))}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
MEGATRON_LM=${MEGATRON_LM:-.}
SCRIPT=${SCRIPT:-pretrain_gpt.py}  # (recipes/qwen_hybrid.sh: pretrain_hybrid.py)
if [[ ! -f "$MEGATRON_LM/$SCRIPT" ]]; then
    echo "$RECIPE: no $SCRIPT in MEGATRON_LM=$MEGATRON_LM (a Megatron-LM checkout)" >&2
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

# --moe-overlap is the whole switch: every MoE layer of the model Megatron-LM builds becomes
# an OverlapMoELayer (rank 0 prints how many at build). MOE_OVERLAP=0: the stock layer, same
# line otherwise (the A/B baseline, core-TE).
OVERLAP_ARGS=()
if [[ "${MOE_OVERLAP:-1}" != 0 ]]; then
    OVERLAP_ARGS+=(--moe-overlap)
fi

if [[ -n "${DATA_PATH:-}" ]]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --split 99,1,0 --tokenizer-type HuggingFaceTokenizer
               --tokenizer-model "${TOKENIZER_MODEL:-$HF_TOKENIZER}")
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "$VOCAB_SIZE")
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
    --log-interval "${LOG_INTERVAL:-10}"
    --eval-iters 0
    --eval-interval "${TRAIN_ITERS:-100}"  # (Megatron-LM needs one even with no evaluation)
)
if [[ -n "${CHECKPOINT_PATH:-}" ]]; then
    LOGGING_ARGS+=(--save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH")
fi

# Megatron-LM's pretrain_gpt.py (or pretrain_hybrid.py), unmodified: megatron_overlap.mcore.launch
# runs it with the --moe-overlap* flags added to its parser (its own extra_args_provider kept).
exec torchrun "${DISTRIBUTED_ARGS[@]}" -m megatron_overlap.mcore.launch "$MEGATRON_LM/$SCRIPT" \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${OVERLAP_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"
