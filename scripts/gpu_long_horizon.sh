#!/usr/bin/env bash
# The long-horizon experiment with the real learner on one lent GPU: `lab/long_horizon.py --learner smollm2 --device
# cuda`, several runs side by side, within the device's limits: at most 64 MiB travels per call with the working tree
# (~9 MB), and SmolLM2's GGUF file is 98 MB, so it travels in three parts, in three calls on one warm machine (each
# within the warm time of the one before; what a call carried stays there, out of git):
#
#   bash scripts/gpu_long_horizon.sh prepare     # here: the wheels the device lacks into .whl/ (~24 MiB), the GGUF
#                                                # cut in three (.smol_a/, .smol_b/, .smol_c/, 31 MiB each)
#   call 1, carry [".whl", ".smol_a"]:  bash scripts/gpu_long_horizon.sh stage   # installs the wheels into .site/
#   call 2, carry [".smol_b"]:          ls .smol_b
#   call 3, carry [".smol_c"]:          bash scripts/gpu_long_horizon.sh run     # joins the GGUF, runs, fills $OUT
#   bash scripts/gpu_long_horizon.sh dry-run DIR # `run` on the CPU: the quick world, --device cpu, into DIR
#   call 4 (optional, same warm machine): bash scripts/gpu_long_horizon.sh credit   # the credit study on the GPU
#   bash scripts/gpu_long_horizon.sh credit-dry-run DIR   # `credit` on the CPU: --quick --device cpu, into DIR
#   call 5 (optional, same warm machine): bash scripts/gpu_long_horizon.sh pipeline # the paper's pipeline, SmolLM2
#   bash scripts/gpu_long_horizon.sh pipeline-dry-run DIR # `pipeline` at its smallest on the CPU, into DIR
#   call 6 (same warm machine; again to finish): bash scripts/gpu_long_horizon.sh compare   # MemPO vs outcome-only
#   bash scripts/gpu_long_horizon.sh compare-dry-run DIR  # `compare` at its smallest on the CPU, into DIR
#
# `run` takes ARGS (default "--seeds 0 1 --jobs 8": the test runs, after `--tune --split validation` on an earlier
# call) and LIMIT_S (default 500: a call may run 600 s); a run cut by the limit resumes from its checkpoint on the next
# call; PYTHON (default python) runs lab/long_horizon.py. It copies the summary, the figure and every run's run.json
# (runs.tgz) to $OUT, which the device tool brings back. `credit` runs `lab/credit_study.py --device cuda` (its warm
# start, gate and scoring resume from runs/credit_study_gpu on the next call), then, once it passed its gate, the RL
# smoke (`lab/rl_smoke.py --device cuda`, resumable) in what is left of LIMIT_S, and copies the study's summary, figure,
# gate and phase times and the smoke's summary to $OUT; results that come back go in bench/results/gpu/. `pipeline` runs the paper's pipeline on the
# learner's world with SmolLM2 as the student (compose -> distill with the kit learner as teacher -> LoRA SFT ->
# merge-lora -> MemPO train -> eval over the number of objectives, README "Your data, the paper's pipeline") in
# runs/pipeline_gpu, each step once (a step cut by LIMIT_S starts again on the next call), and copies the sweep,
# the training metrics and the distillation report to $OUT. `compare` builds the credit study's warm start on a world
# with an RL split of its own and gates it (`lab/credit_study.py --rl_rows 120 --gate_only`, in runs/credit_rl), then
# runs `lab/rl_compare.py` (outcome-only GRPO, MemPO at the paper's default and at VARIANT, default diff; K = 4, seeds
# 0 and 1, JOBS runs side by side, default 6) in what is left of LIMIT_S, and copies rl_compare.json (the evaluation
# and the pre-registered verdict, lab/preregistration_credit.md) and the gate to $OUT; a call cut by LIMIT_S resumes
# every run from its checkpoint on the next call.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
# What the device image lacks, or has at other versions than this environment (its transformers is 5.17), at the
# versions installed here; the rest (torch, pyarrow, pandas, tokenizers, safetensors, xxhash) it has.
WHEEL_NAMES="transformers trl datasets bm25s PyStemmer gguf dill multiprocess huggingface_hub accelerate peft fsspec
tokenizers kernels"

join_gguf() {  # on the device: SmolLM2's GGUF from the three parts the calls carried, into the cache it is read from
    export PYTHONPATH="$PWD/.site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" MEMPO_CACHE="$PWD/.cache"
    mkdir -p "$MEMPO_CACHE/smollm2"
    cat .smol_a/part-aa .smol_b/part-ab .smol_c/part-ac >"$MEMPO_CACHE/smollm2/$GGUF"
    echo "$GGUF_SHA256  $MEMPO_CACHE/smollm2/$GGUF" | sha256sum -c --quiet
}

case "${1:-}" in
prepare)
    for folder in .whl .smol_a .smol_b .smol_c .site .cache; do
        grep -qx "/$folder/" .git/info/exclude 2>/dev/null || echo "/$folder/" >>.git/info/exclude
    done
    rm -rf .whl .smol_a .smol_b .smol_c && mkdir -p .whl .smol_a .smol_b .smol_c
    # shellcheck disable=SC2086
    wheels=$("${PYTHON:-python}" -c "import importlib.metadata as m, sys
print(' '.join(f'{n}=={m.version(n)}' for n in sys.argv[1:]))" $WHEEL_NAMES)
    # shellcheck disable=SC2086
    "${PYTHON:-python}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl $wheels
    source=$("${PYTHON:-python}" -c "from mempo_trl.kit.smollm2 import smollm2_gguf; print(smollm2_gguf())")
    split -n 3 "$source" .smol_a/part-  # three equal parts: the first travels with the wheels
    mv .smol_a/part-ab .smol_b/ && mv .smol_a/part-ac .smol_c/
    du -sh .whl .smol_a .smol_b .smol_c
    ;;
stage)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl
    ls .smol_a/part-aa >/dev/null
    echo "staged: $(ls .site | wc -l) entries in .site, $(du -sh .smol_a | cut -f1) of the GGUF"
    ;;
credit | credit-dry-run)
    if [ "$1" = credit ]; then
        join_gguf
        out=runs/credit_study_gpu device=cuda quick="" results=${OUT:?OUT is where the device tool collects files}
    else
        out=${2:?credit-dry-run DIR} device=cpu quick=--quick results=${2}/collected
    fi
    deadline=$((SECONDS + ${LIMIT_S:-500}))
    # shellcheck disable=SC2086
    timeout "${LIMIT_S:-500}" "${PYTHON:-python}" lab/credit_study.py $quick --device "$device" --out "$out" \
        || echo "credit_study: exit $? (a phase cut by LIMIT_S resumes next call)"
    # the RL smoke, once the study passed its gate, in what is left of LIMIT_S (resumes next call)
    if [ -f "$out/credit_study.json" ] && [ $((deadline - SECONDS)) -gt 30 ]; then
        # shellcheck disable=SC2086
        timeout $((deadline - SECONDS)) "${PYTHON:-python}" lab/rl_smoke.py $quick --device "$device" \
            --study_out "$out" --out "$out/rl_smoke" || echo "rl_smoke: exit $? (an arm cut by LIMIT_S resumes next call)"
    fi
    mkdir -p "$results"
    for file in credit_study.json credit_study.png gate.json phases.json rl_smoke/rl_smoke.json; do
        [ -f "$out/$file" ] && cp "$out/$file" "$results/"
    done
    ls "$results"
    ;;
compare | compare-dry-run)
    if [ "$1" = compare ]; then
        join_gguf
        study=runs/credit_rl out=runs/rl_compare device=cuda quick="" rl=120 jobs=${JOBS:-6}
        results=${OUT:?OUT is where the device tool collects files}
    else
        study=${2:?compare-dry-run DIR}/study out=${2}/compare device=cpu quick=--quick rl=2 jobs=1 results=${2}/collected
    fi
    deadline=$((SECONDS + ${LIMIT_S:-500}))
    # shellcheck disable=SC2086
    timeout "${LIMIT_S:-500}" "${PYTHON:-python}" lab/credit_study.py $quick --rl_rows "$rl" --gate_only \
        --device "$device" --out "$study" || echo "credit_study: exit $? (a warm start cut by LIMIT_S resumes next call)"
    if [ -f "$study/gate.json" ] && [ $((deadline - SECONDS)) -gt 30 ]; then
        # shellcheck disable=SC2086
        timeout $((deadline - SECONDS)) "${PYTHON:-python}" lab/rl_compare.py $quick --study_out "$study" --out "$out" \
            --device "$device" --jobs "$jobs" --variant "${VARIANT:-diff}" \
            || echo "rl_compare: exit $? (a run cut by LIMIT_S resumes next call)"
    fi
    mkdir -p "$results"
    for file in "$out/rl_compare.json" "$study/gate.json"; do
        [ -f "$file" ] && cp "$file" "$results/"
    done
    ls "$results"
    ;;
pipeline | pipeline-dry-run)
    if [ "$1" = pipeline ]; then
        join_gguf
        out=runs/pipeline_gpu results=${OUT:?OUT is where the device tool collects files}
    else
        out=${2:?pipeline-dry-run DIR} results=${2}/collected
    fi
    mkdir -p "$out"
    timeout "${LIMIT_S:-500}" bash scripts/gpu_long_horizon.sh pipeline-steps "$1" "$out" \
        || echo "pipeline: exit $? (the steps done are kept; the next call goes on)"
    mkdir -p "$results"
    for file in sweep/objectives.json sweep/objectives.png rl/mempo_metrics.json distilled/distill_report.json; do
        [ -f "$out/$file" ] && cp "$out/$file" "$results/"
    done
    ls "$results"
    ;;
pipeline-steps)  # pipeline-steps pipeline|pipeline-dry-run DIR: the steps, in DIR
    if [ "$2" = pipeline ]; then  # one GPU, bf16
        on=(--use_cpu false --bf16 true) rows=${PIPELINE_ROWS:-200} objectives=(1 2 4) sft=(150 8) rl=(20 8 32)
        lora=(--lora_r 16 --lora_target_modules all-linear) tokens=128 turns=6 questions=50
    else  # the CPU, at its smallest
        on=(--use_cpu true --bf16 false) rows=6 objectives=(1 2) sft=(1 2) rl=(1 2 2)
        lora=(--lora_r 4 --lora_target_modules q_proj v_proj) tokens=32 turns=2 questions=2
    fi
    cd "${3:?DIR}"
    world=learner/world
    step() {  # step NAME ARGS...: `mempo-trl ARGS` into NAME, once; only a NAME this script started is started again
        [ -f "$1.done" ] && return 0
        if [ -e "$1" ] && [ ! -f "$1.started" ]; then
            echo "error: $PWD/$1 exists and was not written by this script: give an empty or new DIR" >&2
            return 2
        fi
        rm -rf "$1" && touch "$1.started" && "${PYTHON:-python}" -m mempo_trl "${@:2}" && touch "$1.done"
    }
    step learner kit learner --output_dir learner
    step composed compose --dataset_name "$world/warm.jsonl" --objectives "${objectives[@]}" --max_rows "$rows" \
        --output_dir composed
    if [ ! -f warm.jsonl ]; then
        for k in "${objectives[@]}"; do cat "composed/k$k/train.jsonl"; done >warm.jsonl.part && mv warm.jsonl.part warm.jsonl
    fi
    step distilled distill --model_name_or_path learner/model --dataset_name warm.jsonl \
        --corpus "$world/corpus.jsonl" --output_dir distilled --keep format_valid
    step smollm2 kit smollm2 --output_dir smollm2
    step student sft --model_name_or_path smollm2 --dataset_name distilled --output_dir student \
        --max_steps "${sft[0]}" --per_device_train_batch_size "${sft[1]}" --use_peft "${lora[@]}" "${on[@]}" \
        --save_strategy no --report_to none
    step student_merged merge-lora --model_name_or_path student --output_dir student_merged
    step rl train --model_name_or_path student_merged --dataset_name "composed/k${objectives[-1]}" \
        --corpus "$world/corpus.jsonl" --output_dir rl --max_steps "${rl[0]}" --num_generations "${rl[1]}" \
        --per_device_train_batch_size "${rl[2]}" --max_completion_length "$tokens" --max_turns "$turns" \
        --use_peft true "${lora[@]}" "${on[@]}" --report_to none --heldout_questions 0 --save_strategy no
    step sweep eval --model_name_or_path student_merged --dataset_name "$world/test.jsonl" --dataset_split test \
        --corpus "$world/corpus.jsonl" --objectives "${objectives[@]}" --max_eval_samples "$questions" \
        --max_completion_length "$tokens" --context_mode both --output_dir sweep --disable_tqdm true
    ;;
run | dry-run)
    if [ "$1" = run ]; then
        join_gguf
        out=runs/long_horizon
        # shellcheck disable=SC2086
        timeout "${LIMIT_S:-500}" "${PYTHON:-python}" lab/long_horizon.py --learner smollm2 --device cuda --out "$out" \
            ${ARGS:---seeds 0 1 --jobs 8} || echo "long_horizon: exit $? (a run cut by LIMIT_S resumes next call)"
        results=${OUT:?OUT is where the device tool collects files}
    else
        out=${2:?dry-run DIR}
        "${PYTHON:-python}" lab/long_horizon.py --quick --learner smollm2 --device cpu --out "$out" \
            --arms mempo full_history
        results=$out/collected
    fi
    mkdir -p "$results"
    root="$out/passage_words_100/smollm2"
    for file in lab/results/long_horizon_smollm2.json lab/results/long_horizon_smollm2.png \
        "$root/long_horizon_smollm2.json" "$root/long_horizon_smollm2.png"; do
        [ -f "$file" ] && cp "$file" "$results/"
    done
    # every run's run.json in one file (the device tool brings back at most 8 files)
    (cd "$root" && find runs -name run.json | tar czf - -T -) >"$results/runs.tgz"
    ls "$results"
    ;;
*)
    sed -n '2,35p' "$0"
    exit 2
    ;;
esac
