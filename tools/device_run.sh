#!/usr/bin/env bash
# One call on the device machine (see /work/.library/device): install the carried wheels
# (.whl/: megatron-core for py3.12 and this package), then run the named stages in order,
# each bounded, logs appended to $OUT/log.txt; every JSON comes back in one archive.
# Usage: tools/device_run.sh STAGE...   (settings are environment variables, defaults below)
# Setup and checks:
#   te            Transformer Engine from the parts earlier calls staged (tools/te_wheels.sh)
#   env           nvidia-smi, the topology, torch and Triton versions
#   demo          `make demo` in a fresh venv (the README's main job)
#   gpu_tests     pytest -m gpu over GPU_TEST_FILES (tests/ files, default the kernels', the
#                 op's and the layer's); what is not installed skips (TE: `te` first), e.g.
#                 GPU_TEST_FILES="test_mcore_te_gpu.py test_megatron_lm_launch_gpu.py
#                 test_hf_checkpoint.py". A failure of the kernels' or op's tests turns the
#                 tail helpers off for later stages unless GPU_TESTS_DEGRADE=0
#   check_op      the op against fp64 over models x layouts x routing (CHECK_ARGS)
# Device setup (once per device):
#   tune          GEMM2 and GatherRS tiles (tools/tune_tiles.py) -> tiles.json; TUNE_COMM=1:
#                 GatherRS tiles alone, and later stages use them (MEGATRON_OVERLAP_TILES)
#   calibrate     the planner's calibration of this device -> $CAL_NAME.json; SHIP_CAL=1:
#                 later stages plan with it as if shipped (over a shipped one: SHIP_OVER=1)
#   calibrate_fp8 the FP8 kernel families (tensor, block) added to this device's shipped
#                 calibration on one GPU -> $CAL_NAME.json; later stages plan with it
#   unpermute_rate  TE's and Megatron's unpermute timed into the calibration (after te)
# Benchmarks (layouts: LAYOUTS, default every TPxEPy of this machine's GPUs; one GPU TP1EP1):
#   bench_op      the op against the reference, C swept, eager (OP_MODELS, OP_SEQS, ROUTING)
#   op_graph      the op, GEMM2 alone and the reference replayed from CUDA graphs, C and L swept
#   layers        one MoE layer, stock and overlapped (bench_layer.py; LAYER_IMPLS=te,local:
#                 TE's grouped experts = core-TE beside local ones, after te; FP8:
#                 LAYER_IMPLS=te LAYER_ARGS="--fp8-recipe R"; forward + backward in training
#                 mode: LAYER_ARGS="--backward ...")
#   prefill       complete-model prefill, stock and overlapped (PREFILL_MODELS, PREFILL_SEQS);
#                 PREFILL_IMPL=te: the TE spec (core-TE, after te); PREFILL_MODES="prefill
#                 train": also one training step (TRAIN_SEQS, TRAIN_BATCH, TRAIN_LAYERS)
#   grid          core-TE against --moe-overlap, one GPU, over GRID_MODES (prefill train) x
#                 GRID_MODELS x GRID_BATCHES x GRID_SEQS (after te); GRID_FUSED=1: each point
#                 under Megatron's default MoE flags and its fusions in one schedule;
#                 FP8 cells: GRID_ARGS="--fp8-recipe R --moe-overlap-fp8" (both arms FP8;
#                 blockwise: add --moe-overlap-fp8-blockwise)
#   train_loop    Megatron-LM's own training loop, stock vs --moe-overlap (after te); both arms
#                 take TRAIN_LOOP_ARGS, e.g. Megatron's fusions and TE CUDA graphs:
#                 TRAIN_LOOP_ARGS="--moe-permute-fusion --moe-router-fusion --cuda-graph-impl
#                 transformer_engine --cuda-graph-modules attn moe_router moe_preprocess"
# Before and after a change:
#   ab            the one-GPU op, layer and prefill benchmarks of a base wheel (.whl/base/*.whl,
#                 its tools in .whl/base/tools if given) and of this code, in one call (the
#                 base's tools must know TP1EP1: commits from 668fe43, 2026-12-04, on)
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
REPO=$(cd "$(dirname "$0")/.." && pwd)
LOG=$OUT/log.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$REPO"/.whl/*.whl >>"$LOG" 2>&1 || { echo "wheel install failed"; tail "$LOG"; exit 1; }
export PYTHONPATH=/tmp/site
# the checkout's calibrations win over the wheel's: one made in an earlier call travels
# in the working tree without a rebuilt wheel
cp "$REPO"/megatron_overlap/planner/calibrations/*.json /tmp/site/megatron_overlap/planner/calibrations/
NGPU=$(nvidia-smi -L | wc -l)
# the preset this device's calibration is named and shipped as: the shipped one found by
# the GPU's name (h100, h200), else a new name from it ("NVIDIA A100-SXM4-80GB": a100-sxm4-80gb)
CAL_NAME=${CAL_NAME:-$(python3 -c "import sys; from megatron_overlap.planner import preset_for_device
name = sys.argv[1].strip(); found = preset_for_device(name)
print(found.name if found else name.lower().removeprefix('nvidia').strip().replace(' ', '-'))" \
    "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)")}
TR="torchrun --nproc-per-node $NGPU"
# The repository root must not shadow the installed package (its kernels/ is mapped).
cd /tmp

stage() {  # stage NAME SECONDS CMD...
    local name=$1 secs=$2; shift 2
    echo "=== $name ($(date +%T))" | tee -a "$LOG"
    # (in the background and waited for: a TERM to this script interrupts `wait` at once,
    # and its trap ends the stage and archives; a foreground child would delay the trap)
    timeout "$secs" "$@" >>"$LOG" 2>&1 </dev/null &
    STAGE_PID=$!
    wait $STAGE_PID
    local rc=$?
    STAGE_PID=
    echo "=== $name rc=$rc ($(date +%T))" | tee -a "$LOG"
    return $rc
}

archive() {  # The device tool brings back at most 8 files: one archive of every JSON and
  # chart folder instead (unpack with tar xzf results_*.tgz); one per invocation, so a later
  # call in the same device run does not replace it. Also on TERM / INT: a run cut at the
  # call's bound (`timeout`) still brings back what its finished stages wrote.
  local parts
  parts=$(cd "$OUT" && ls -d ./*.json ./*/ 2>/dev/null)
  [ -n "$parts" ] && (cd "$OUT" && tar czf "results_$(date +%H%M%S).tgz" $parts && rm -rf $parts)
  return 0
}
STAGE_PID=
trap '[ -n "$STAGE_PID" ] && kill $STAGE_PID 2>/dev/null; archive; exit 143' TERM INT

tp_ep() {  # tp_ep TPxEPy: sets TP and EP
    TP=${1#TP}; TP=${TP%EP*}; EP=${1#*EP}
}

# the layouts of this machine's GPUs: TP N .. 1 by halves (1: TP1EP1; 4: TP4EP1 TP2EP2 TP1EP4)
LAYS=""; tp=$NGPU
while [ $tp -ge 1 ]; do LAYS="$LAYS TP${tp}EP$((NGPU / tp))"; tp=$((tp / 2)); done

ab_base() {  # the base wheel into /tmp/site_base (its package shadows this one there)
    [ "${AB_READY:-0}" = 1 ] && return 0
    compgen -G "$REPO/.whl/base/*.whl" >/dev/null && python3 -m pip install -q --no-index \
        --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_base \
        "$REPO"/.whl/base/*.whl >>"$LOG" 2>&1 \
        || { echo "ab: no base wheel installed from .whl/base/" | tee -a "$LOG"; return 1; }
    AB_BASE_TOOLS=$REPO/tools
    [ -d "$REPO/.whl/base/tools" ] && AB_BASE_TOOLS=$REPO/.whl/base/tools
    echo "ab: base tools from $AB_BASE_TOOLS" | tee -a "$LOG"; AB_READY=1
}

ab_run() {  # ab_run BENCH ARM TOOLS: one arm's process(es) of a one-GPU benchmark
    local bench=$1 arm=$2 tools=$3 m
    case $bench in
      op) stage ab_op_$arm ${AB_OP_SECS:-150} torchrun --nproc-per-node 1 "$tools/bench_op.py" \
            --model ${OP_MODELS:-granite,qwen,deepseek} --layout TP1EP1 --seqs ${OP_SEQS:-4096,16384} \
            --routing ${ROUTING:-uniform} --cset 132 --samples ${OP_SAMPLES:-10} --warmup 2 \
            --preset "${PRESET:-$CAL_NAME}" --cuda-graph --json "$OUT/ab_${TAG:-}op_$arm.json" ;;
      layer) stage ab_layer_$arm ${AB_LAYER_SECS:-150} torchrun --nproc-per-node 1 \
            "$tools/bench_layer.py" --models ${LAYER_MODELS:-granite,qwen,deepseek} --tp 1 --ep 1 \
            --seqs ${LAYER_SEQS:-4096,16384} --samples 12 ${LAYER_ARGS:-} \
            --json "$OUT/ab_${TAG:-}layer_$arm.json" ;;
      prefill) for m in ${PREFILL_MODELS:-granite qwen deepseek}; do
          stage ab_prefill_${arm}_$m ${PREFILL_SECS:-75} torchrun --nproc-per-node 1 \
            -m megatron_overlap.mcore.prefill --model $m --tp 1 --ep 1 --batch 4 \
            --seqs ${PREFILL_SEQS:-4096} --iters ${PREFILL_ITERS:-8} --warmup 1 --abba \
            ${PREFILL_ARGS:-} --json "$OUT/ab_${TAG:-}prefill_${arm}_$m.json"; done ;;
      *) echo "ab: unknown benchmark $bench (op, layer, prefill)" | tee -a "$LOG" ;;
    esac
}

for s in "$@"; do
  case $s in
    te)  # Transformer Engine from the parts staged by earlier calls (tools/te_wheels.sh)
      stage te_install 180 "$REPO/tools/te_wheels.sh" install \
        && export PYTHONPATH=/tmp/site:${TE_TARGET:-/tmp/te_site} ;;
    env) stage env 60 bash -c "nvidia-smi; nvidia-smi topo -m; python3 -c 'import torch,triton; print(torch.__version__, triton.__version__, torch.cuda.device_count())'" ;;
    demo) stage demo 240 bash -c "cd '$REPO' && make demo" ;;  # the README's main job, fresh venv
    gpu_tests) files=""  # (names under tests/; `tests/` prefixes and ::test ids kept)
      for f in ${GPU_TEST_FILES:-test_kernels_gpu.py test_op_gpu.py test_mcore_gpu.py}; do
        files="$files $REPO/tests/${f#tests/}"; done
      stage gpu_tests ${GPU_TEST_SECS:-420} python3 -m pytest -q -m gpu -p no:cacheprovider \
        --rootdir "$REPO" -c "$REPO/pyproject.toml" -rs ${GPU_TEST_K:+-k "$GPU_TEST_K"} $files
      rc=$?
      if [ $rc = 124 ]; then  # the stage's bound, not a failed test: nothing to work around
        echo "gpu_tests ran past ${GPU_TEST_SECS:-420} s: later stages keep the tail helpers" | tee -a "$LOG"
      elif [ $rc != 0 ] && [ "${GPU_TESTS_DEGRADE:-1}" != 0 ] \
          && [[ "$files" =~ test_(kernels|op)_gpu\.py ]]; then
        # later stages measure without the tail helpers rather than not at all (the
        # tools' OverlapConfig.from_env reads it)
        echo "gpu_tests failed: MEGATRON_OVERLAP_TAIL_HELPERS=0 from here on" | tee -a "$LOG"
        export MEGATRON_OVERLAP_TAIL_HELPERS=0
      fi ;;
    check_op) stage check_op ${CHECK_SECS:-240} python3 "$REPO/tools/check_op.py" ${CHECK_ARGS:-} ;;
    tune) if [ "${TUNE_COMM:-0}" = 1 ]; then  # GatherRS candidates on every GPU; later stages use its choice
        stage tune_comm 120 $TR "$REPO/tools/tune_tiles.py" --comm-only --cset 4,16,32,64 \
          --samples 8 --json "$OUT/tiles.json"
        [ -f "$OUT/tiles.json" ] && export MEGATRON_OVERLAP_TILES=$OUT/tiles.json TILES=$OUT/tiles.json
      else stage tune 170 $TR "$REPO/tools/tune_tiles.py" --json "$OUT/tiles.json"; fi ;;
    calibrate) stage calibrate 200 $TR "$REPO/tools/calibrate.py" ${TILES:+--tiles $TILES} \
        --name $CAL_NAME --json "$OUT/$CAL_NAME.json"
      if [ "${SHIP_CAL:-0}" = 1 ] && [ -f "$OUT/$CAL_NAME.json" ]; then
        # later stages plan with the calibration just made, as if it were shipped
        # (not over a shipped one unless SHIP_OVER=1: h200's was made on two GPUs, d_ref = 2)
        if [ -f "$REPO/megatron_overlap/planner/calibrations/$CAL_NAME.json" ] && [ "${SHIP_OVER:-0}" != 1 ]; then
          echo "calibrate: $CAL_NAME is shipped; kept (SHIP_OVER=1 replaces it)" | tee -a "$LOG"
        else cp "$OUT/$CAL_NAME.json" /tmp/site/megatron_overlap/planner/calibrations/; fi
      fi ;;
    calibrate_fp8)  # GEMM2 alone, bf16 beside FP8: no peer is timed, one GPU suffices
      base=$CAL_NAME
      for kind in tensor block; do
        stage calibrate_fp8_$kind 150 torchrun --nproc-per-node 1 "$REPO/tools/calibrate.py" \
          --fp8 $kind --base "$base" --json "$OUT/${CAL_NAME}_fp8$kind.json" && base=$OUT/${CAL_NAME}_fp8$kind.json
      done
      if [ "$base" != "$CAL_NAME" ]; then  # (the shipped terms kept: safe to plan with)
        cp "$base" "$OUT/$CAL_NAME.json"
        cp "$base" /tmp/site/megatron_overlap/planner/calibrations/$CAL_NAME.json; fi ;;
    unpermute_rate)  # TE's fused unpermute and Megatron's, timed at the three models' shapes,
      # written into this device's calibration (the fuse-or-not's step costs; after `te`)
      cp "$REPO/megatron_overlap/planner/calibrations/$CAL_NAME.json" "$OUT/$CAL_NAME.json"
      stage unpermute_rate 150 python3 "$REPO/tools/unpermute_rate.py" \
        --json "$OUT/unpermute_$CAL_NAME.json" --write-calibration "$OUT/$CAL_NAME.json" ;;
    bench_op) for lay in ${LAYOUTS:-$LAYS}; do
        stage bench_op_$lay ${BENCH_SECS:-170} $TR "$REPO/tools/bench_op.py" \
          --model ${OP_MODELS:-granite,qwen,deepseek} --layout $lay --seqs ${OP_SEQS:-1024,4096,16384} \
          --routing ${ROUTING:-uniform,p90} ${BENCH_CSET:+--cset $BENCH_CSET} \
          --samples ${OP_SAMPLES:-10} --warmup 2 ${CONFIRM:+--confirm $CONFIRM} \
          --preset "${PRESET:-$CAL_NAME}" ${TILES:+--tiles $TILES} ${BENCH_ARGS:-} \
          --json "$OUT/op_${TAG:-}$lay.json"; done ;;
    op_graph)  # the op, GEMM2 alone and the reference replayed from CUDA graphs, with the C
      # and L sweeps captured too: GPU ratios and the regret without the host's noise
      for lay in ${LAYOUTS:-$LAYS}; do
        stage op_graph_$lay ${BENCH_SECS:-200} $TR "$REPO/tools/bench_op.py" \
          --model ${OP_MODELS:-granite,qwen,deepseek} --layout $lay --seqs ${OP_SEQS:-4096,16384} \
          --routing ${ROUTING:-uniform} --cset ${BENCH_CSET:-33,66,132} --lset ${LSET:-1,2,4,8} \
          --samples ${OP_SAMPLES:-10} --warmup 2 --preset "${PRESET:-$CAL_NAME}" --cuda-graph \
          --graph-sweep --json "$OUT/op_graph_${TAG:-}$lay.json"; done ;;
    layers) impls=${LAYER_IMPLS:-local}; itag=""  # (te in the file name: layer_<TAG>te_<layout>)
      case ,$impls, in *,te,*) itag=te_ ;; esac
      for lay in ${LAYOUTS:-$LAYS}; do tp_ep $lay
        stage layer_${itag}$lay ${LAYER_SECS:-$([ -n "$itag" ] && echo 240 || echo 120)} $TR \
          "$REPO/tools/bench_layer.py" --models ${LAYER_MODELS:-granite,qwen,deepseek} --tp $TP \
          --ep $EP --impls $impls --seqs ${LAYER_SEQS:-4096,16384} --samples 12 \
          ${INPUT_LAYER:+--input-layer $INPUT_LAYER} ${LAYER_ARGS:-} \
          --json "$OUT/layer_${TAG:-}${itag}$lay.json"; done ;;
    prefill) impl=${PREFILL_IMPL:-local}; itag=""  # (files prefill_<TAG>[te_]<model>_<layout>,
      [ $impl = te ] && itag=te_                   # train_<TAG>[te_]...: report.py's sections)
      for mode in ${PREFILL_MODES:-prefill}; do for lay in ${LAYOUTS:-$LAYS}; do tp_ep $lay
        for m in ${PREFILL_MODELS:-granite qwen deepseek}; do
          if [ $mode = train ]; then  # one training step: forward with labels, the loss's backward
            stage train_${itag}${m}_$lay ${PREFILL_SECS:-100} $TR -m megatron_overlap.mcore.prefill \
              --impl $impl --train --model $m --tp $TP --ep $EP --batch ${TRAIN_BATCH:-4} \
              --seqs ${TRAIN_SEQS:-4096} ${TRAIN_LAYERS:+--layers $TRAIN_LAYERS} \
              --iters ${TRAIN_ITERS:-6} --warmup 2 --abba ${TRAIN_ARGS:-} \
              --json "$OUT/train_${TAG:-}${itag}${m}_$lay.json"
          else
            stage prefill_${itag}${m}_$lay ${PREFILL_SECS:-$([ -n "$itag" ] && echo 100 || echo 75)} \
              $TR -m megatron_overlap.mcore.prefill --impl $impl --model $m --tp $TP --ep $EP \
              --batch 4 --seqs ${PREFILL_SEQS:-1024,4096,16384} --iters ${PREFILL_ITERS:-8} \
              --warmup 1 --abba ${PREFILL_ARGS:-} --json "$OUT/prefill_${TAG:-}${itag}${m}_$lay.json"
          fi; done; done; done ;;
    grid)  # --moe-overlap on / off (= core-TE: same TEGroupedMLP, same weights), TP1EP1, one GPU:
      # over the three models x B x S, prefill at the published depth and one training step
      # (issue: never slower); report: tools/report_grid.py. GRID_FUSED=1 (--baselines
      # default,fused): both arms under Megatron's default MoE flags and under
      # --moe-permute-fusion --moe-router-fusion in one ABBA schedule per point, B = 4,
      # prefill at S = 4096, 16384 and a 4-layer training step at S = 4096, files gridfused_*
      # (report_grid.py --prefix gridfused; bounded 3 x (90 + 50) s = 7 min). Needs `te` first.
      if [ "${GRID_FUSED:-0}" = 1 ]; then
        prefix=gridfused batches=${GRID_BATCHES:-4} seqs=${GRID_SEQS:-4096,16384}
        tseqs=${GRID_TRAIN_SEQS:-4096} tlayers=${GRID_TRAIN_LAYERS:-4} iters=${GRID_ITERS:-6}
        pwarm=1 psecs=${GRID_SECS:-90} tsecs=${GRID_SECS:-50} flags="--baselines default,fused"
      else
        prefix=grid batches=${GRID_BATCHES:-1 4} seqs=${GRID_SEQS:-256,1024,4096,16384}
        tseqs=${GRID_TRAIN_SEQS:-$seqs} tlayers=${GRID_TRAIN_LAYERS:-} iters=${GRID_ITERS:-8}
        pwarm=2 psecs=${GRID_SECS:-150} tsecs=${GRID_SECS:-150} flags=""
      fi
      for mode in ${GRID_MODES:-prefill train}; do for m in ${GRID_MODELS:-granite qwen deepseek}; do
        for b in $batches; do
          if [ $mode = train ]; then
            stage ${prefix}_train_${m}_B$b $tsecs torchrun --nproc-per-node 1 \
              -m megatron_overlap.mcore.prefill --impl te --train ${tlayers:+--layers $tlayers} \
              --model $m --tp 1 --ep 1 --batch $b --seqs $tseqs --iters $iters --warmup 2 --abba \
              $flags ${GRID_ARGS:-} --json "$OUT/${prefix}_${TAG:-}train_${m}_B$b.json"
          else
            stage ${prefix}_prefill_${m}_B$b $psecs torchrun --nproc-per-node 1 \
              -m megatron_overlap.mcore.prefill --impl te --model $m --tp 1 --ep 1 --batch $b \
              --seqs $seqs --iters $iters --warmup $pwarm --abba $flags ${GRID_ARGS:-} \
              --json "$OUT/${prefix}_${TAG:-}prefill_${m}_B$b.json"
          fi; done; done; done ;;
    train_loop)  # Megatron-LM's own training loop from the recipes (.mlm: core_r0.19.0's
      # pretrain_gpt.py, pretrain_hybrid.py and their builders), stock vs --moe-overlap. The
      # wheel ships the dataset helpers compiled but no Makefile for initialize's `make`.
      printf 'all:\n\t@true\n' > /tmp/site/megatron/core/datasets/Makefile
      stage train_loop ${TRAIN_SECS:-570} python3 "$REPO/tools/train_loop.py" \
        --megatron-lm "$REPO/.mlm" --models ${TRAIN_MODELS_LOOP:-granite,qwen,deepseek,qwen_hybrid} \
        --iters ${TRAIN_ITERS_LOOP:-50} --json "$OUT/train_loop${TAG:-}.json" \
        -- --no-gradient-accumulation-fusion ${TRAIN_LOOP_ARGS:-} ;;
    ab)  # a base wheel (.whl/base/*.whl: `pip wheel --no-deps` of the base commit; its tools/
      # in .whl/base/tools, else this checkout's) against this code, one GPU, TP1EP1: per
      # benchmark of AB_BENCHES the processes in the order AB_ORDER (base new new base: the
      # spread between one code's two runs is the noise a difference must exceed)
      ab_base || continue
      for bench in ${AB_BENCHES:-op layer prefill}; do n_base=0; n_new=0
        for code in ${AB_ORDER:-base new new base}; do
          if [ $code = base ]; then n_base=$((n_base + 1)); arm=base$n_base
            path=/tmp/site_base:$PYTHONPATH; tools=$AB_BASE_TOOLS
          else n_new=$((n_new + 1)); arm=new$n_new; path=$PYTHONPATH; tools=$REPO/tools; fi
          PYTHONPATH=$path ab_run $bench $arm "$tools"; done; done ;;
    *) echo "unknown stage $s" ;;
  esac
done
archive
grep -E "^===|^check |^timeline |^routing |^transformer_engine|^train |skipped|SKIP|^[a-z]+/TP[0-9]EP[0-9]/[0-9]+: GatherRS|^variant |^(rows|tokens)|rho_ref|^comm alone|^[a-z]+/TP|^chosen|^gemm2 |^comm rows|^torch._grouped|^torch gather|^(qwen|granite|deepseek) |^  (host|api |gpu |prof )|^cProfile|^host |^  step |^torch copy|^layer |^prefill|speedup|^moe-overlap|^    [A-Z][a-zA-Z ]+ +[a-z%/]+ +[0-9]|^  (stock|overlap|speedup)|^  (partition|shared|torch)|passed|failed|Error|error" "$LOG" | grep -v Warning | tail -n 80
