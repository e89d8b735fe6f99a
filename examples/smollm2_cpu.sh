#!/usr/bin/env bash
# SmolLM2-135M-Instruct trained end to end on the CPU, offline (examples/configs/smollm2_cpu.yaml says what each
# stage is). Usage: examples/smollm2_cpu.sh [RUN_DIR (default runs/smollm2)] [SFT_STEPS (60)] [RL_STEPS (4)]
#   [EVAL_QUESTIONS (30)]. A finished stage is skipped when run again, the SFT resumes from its checkpoint, and
#   the RL from its newest checkpoint. Each stage's output, the numbers included, is in RUN_DIR/*.log.
set -euo pipefail
RUN=${1:-runs/smollm2}
SFT_STEPS=${2:-60}
RL_STEPS=${3:-4}
EVAL_QUESTIONS=${4:-30}
MEMPO=${MEMPO:-mempo-trl}
WORLD=$RUN/learner/world
mkdir -p "$RUN"

stage() {  # stage NAME DONE_FILE COMMAND...: run COMMAND (output in RUN/NAME.log) unless DONE_FILE exists
    local name=$1 done_file=$2
    shift 2
    if [ -e "$done_file" ]; then echo "[$name] done ($done_file)"; return; fi
    echo "[$name] $(date -u +%H:%M:%S) $*"
    local start=$SECONDS
    "$@" 2>&1 | tee "$RUN/$name.log"
    echo "[$name] seconds: $((SECONDS - start))" | tee -a "$RUN/$name.log"
}
evaluate() {  # evaluate NAME MODEL MODE
    stage "eval_$1" "$RUN/eval_$1/results.json" $MEMPO eval --model_name_or_path "$2" \
        --dataset_name "$WORLD/test.jsonl" --corpus "$WORLD/corpus.jsonl" --output_dir "$RUN/eval_$1" \
        --context_mode "$3" --max_eval_samples "$EVAL_QUESTIONS" --max_turns 3 --retrieval_topk 2 \
        --max_completion_length 64 --device cpu --dtype float32 --disable_tqdm true
}

stage model "$RUN/model/model.safetensors" $MEMPO kit smollm2 --output_dir "$RUN/model"
stage world "$WORLD/test.jsonl" $MEMPO kit learner --output_dir "$RUN/learner"
evaluate before_sft "$RUN/model" memory
if [ ! -e "$RUN/sft/warm_start.json" ]; then mkdir -p "$RUN/sft" && cp -rn "$RUN/model/." "$RUN/sft/"; fi
stage sft "$RUN/sft/warm_start.json" $MEMPO kit warm-start --model_name_or_path "$RUN/sft" \
    --train_file "$WORLD/warm.jsonl" --corpus "$WORLD/corpus.jsonl" --max_steps "$SFT_STEPS" \
    --per_device_train_batch_size 2 --learning_rate 1e-4 --checkpoint_every 20
evaluate after_sft "$RUN/sft" both
RESUME=()
LAST=$(ls -d "$RUN"/rl/checkpoint-* 2>/dev/null | sort -V | tail -1 || true)
if [ -n "$LAST" ]; then RESUME=(--resume_from_checkpoint "$LAST"); fi
stage rl "$RUN/rl/adapter_config.json" $MEMPO train --config examples/configs/smollm2_cpu.yaml \
    --model_name_or_path "$RUN/sft" --output_dir "$RUN/rl" --max_steps "$RL_STEPS" "${RESUME[@]}"
stage merge "$RUN/rl_merged/model.safetensors" $MEMPO merge-lora --model_name_or_path "$RUN/rl" \
    --output_dir "$RUN/rl_merged"
evaluate after_rl "$RUN/rl_merged" both
