#!/usr/bin/env bash
# SmolLM2-135M-Instruct trained end to end on the CPU, offline (examples/configs/smollm2_cpu.yaml says what each
# stage is). Usage: examples/smollm2_cpu.sh [--model DIR] [RUN_DIR (default runs/smollm2)] [SFT_STEPS (24)]
#   [RL_STEPS (1)] [EVAL_QUESTIONS (20)]; --model: the folder `mempo-trl kit smollm2` wrote (default: convert into
#   RUN_DIR/model); $TRAIN_ARGS adds flags to `mempo-trl train`. A finished stage is skipped when run again (a
#   stage whose final save was cut short is not finished), the SFT resumes from its checkpoint, and the RL from its
#   newest complete checkpoint (found by the Python that runs $MEMPO; $PYTHON overrides). Each stage's output, the
#   numbers included, is in RUN_DIR/*.log; RUN_DIR/summary.json has them all.
# Cost with the defaults: ~34 min and ~3.2 GB on a loaded 2-core CPU (docs/training.md).
set -euo pipefail
COMMAND="$0 $*"
MODEL=
if [ "${1:-}" = "--model" ]; then
    [ -n "${2:-}" ] || { echo "error: --model needs a folder: the one \`mempo-trl kit smollm2 --output_dir DIR\` wrote" >&2; exit 2; }
    MODEL=$2
    shift 2
fi
RUN=${1:-runs/smollm2}
SFT_STEPS=${2:-24}
RL_STEPS=${3:-1}
EVAL_QUESTIONS=${4:-20}
MEMPO=${MEMPO:-mempo-trl}
if [ -z "${PYTHON:-}" ]; then  # the Python that runs $MEMPO (a venv's, activated or not): its script's #! line
    PYTHON=${MEMPO%% *}
    found=$(command -v "$PYTHON" || true)
    if [ -n "$found" ] && [ "$(head -c 2 "$found")" = "#!" ]; then PYTHON=$(head -n 1 "$found" | cut -c 3- | cut -d " " -f 1); fi
fi
if ! "$PYTHON" -c 'import mempo_trl' 2>/dev/null; then
    echo "error: $PYTHON (the Python of MEMPO=$MEMPO) cannot import mempo_trl: set PYTHON to one that can" >&2
    exit 2
fi
WORLD=$RUN/learner/world
mkdir -p "$RUN"

stage() {  # stage NAME DONE_FILE COMMAND...: run COMMAND (output in RUN/NAME.log) unless DONE_FILE exists and no
    local name=$1 done_file=$2  # save was cut short beside it (mempo_save_incomplete.json)
    shift 2
    if [ -e "$done_file" ] && [ ! -e "$(dirname "$done_file")/mempo_save_incomplete.json" ]; then
        echo "[$name] done ($done_file)"
        return
    fi
    echo "[$name] $(date -u +%H:%M:%S) $*"
    local start=$SECONDS
    "$@" 2>&1 | tee "$RUN/$name.log"
    echo "[$name] seconds: $((SECONDS - start))" | tee -a "$RUN/$name.log"
}
evaluate() {  # evaluate NAME MODEL MODE
    stage "eval_$1" "$RUN/eval_$1/results.json" $MEMPO eval --model_name_or_path "$2" \
        --dataset_name "$WORLD/test.jsonl" --corpus "$WORLD/corpus.jsonl" --output_dir "$RUN/eval_$1" \
        --context_mode "$3" --max_eval_samples "$EVAL_QUESTIONS" --max_turns 3 --retrieval_topk 2 \
        --max_completion_length 64 --per_device_eval_batch_size 20 --device cpu --dtype float32
}

if [ -z "$MODEL" ]; then
    MODEL=$RUN/model
    stage model "$MODEL/model.safetensors" $MEMPO kit smollm2 --output_dir "$MODEL"
elif [ ! -f "$MODEL/model.safetensors" ]; then
    echo "error: --model $MODEL holds no model.safetensors: give the folder \`mempo-trl kit smollm2 --output_dir DIR\`" \
        "wrote, or leave --model out to convert SmolLM2 into $RUN/model" >&2
    exit 2
fi
stage world "$WORLD/test.jsonl" $MEMPO kit learner --output_dir "$RUN/learner"
evaluate before_sft "$MODEL" memory
if [ ! -e "$RUN/sft/warm_start.json" ]; then mkdir -p "$RUN/sft" && cp -rn "$MODEL/." "$RUN/sft/"; fi
stage sft "$RUN/sft/warm_start.json" $MEMPO kit warm-start --model_name_or_path "$RUN/sft" \
    --train_file "$WORLD/warm.jsonl" --corpus "$WORLD/corpus.jsonl" --max_steps "$SFT_STEPS" \
    --per_device_train_batch_size 2 --learning_rate 1e-4 --checkpoint_every 8
evaluate after_sft "$RUN/sft" both
RESUME=()  # the newest checkpoint that a kill did not cut short
LAST=$("$PYTHON" -c 'import sys; from mempo_trl.checkpoints import newest_complete_checkpoint as n; print(n(sys.argv[1]) or "")' "$RUN/rl")
if [ -n "$LAST" ]; then RESUME=(--resume_from_checkpoint "$LAST"); fi
stage rl "$RUN/rl/mempo_metrics.json" $MEMPO train --config "$(dirname "$0")/configs/smollm2_cpu.yaml" \
    --model_name_or_path "$RUN/sft" --output_dir "$RUN/rl" --max_steps "$RL_STEPS" --dataset_name "$WORLD" \
    --corpus "$WORLD/corpus.jsonl" "${RESUME[@]}" ${TRAIN_ARGS:-}
stage merge "$RUN/rl_merged/model.safetensors" $MEMPO merge-lora --model_name_or_path "$RUN/rl" \
    --output_dir "$RUN/rl_merged"
evaluate after_rl "$RUN/rl_merged" both
# One summary of the run: EM, F1 and format-valid rate of every evaluation, the SFT and RL costs, machine and threads,
# the command, and a note with the RL step's parts, the recipe's total time and its disk use.
"$PYTHON" - "$RUN" "$COMMAND" <<'PY'
import json, os, platform, re, sys
from pathlib import Path
run, command = Path(sys.argv[1]), sys.argv[2]
summary = {"evaluations": {}, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "load_average_at_end": os.getloadavg()}
for name in ("before_sft", "after_sft", "after_rl"):
    results = json.loads((run / f"eval_{name}" / "results.json").read_text())
    summary["evaluations"][name] = {
        mode: {k: v["overall"][k] for k in ("num_questions", "em", "f1", "format_valid", "turns_per_question")}
        for mode, v in results["modes"].items()
    }
sft = json.loads((run / "sft" / "warm_start.json").read_text())
summary["sft"] = {**sft["settings"], **sft["stats"], "seconds_per_step": sft["stats"]["seconds"] / sft["stats"]["steps"]}
rl = json.loads((run / "rl" / "mempo_metrics.json").read_text())
steps = rl["step"]  # the last logged step (logging_steps 1)
summary["rl"] = {"steps": steps, "train_runtime": rl["train_runtime"], "seconds_per_step": rl["train_runtime"] / steps,
                 **{f"time_{k}": round(rl[f"time/{k}"], 1) for k in ("generation", "memory_scoring") if f"time/{k}" in rl}}
mempo = "" if os.environ.get("MEMPO", "mempo-trl") == "mempo-trl" else f" (MEMPO={os.environ['MEMPO']!r})"
summary["command"] = f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} {command}{mempo}"
seconds = sum(int(m[-1]) for log in run.glob("*.log") if (m := re.findall(r"seconds: (\d+)", log.read_text())))
disk = sum(f.stat().st_size for f in run.rglob("*") if f.is_file())
summary["note"] = (
    f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end. The stages took "
    f"{seconds / 60:.1f} min in all ({run}/*.log) and {run} holds {disk / 1e9:.1f} GB. The last RL step's generation "
    f"took {summary['rl'].get('time_generation')} s and its memory scoring {summary['rl'].get('time_memory_scoring')} s "
    f"({run}/rl/mempo_metrics.json)."
)
(run / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(f"wrote {run / 'summary.json'}: {summary['note']}")
for name, modes in summary["evaluations"].items():
    print(f"{name}: " + " | ".join(f"{mode} EM {m['em']:.3f} format {m['format_valid']:.3f}" for mode, m in modes.items()))
PY
