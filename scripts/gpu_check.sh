#!/usr/bin/env bash
# LoRA + vLLM-colocate MemPO steps on a CUDA machine; the last line is one JSON object with "result": "PASS"/"FAIL"
# (exit status 0 / 1). Installs this repository itself (no dependencies: torch, vllm and the rest must be there).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >&2
python -c "import torch, vllm, trl; print('torch', torch.__version__, 'vllm', vllm.__version__, 'trl', trl.__version__)" >&2
python -m pip install --quiet --no-deps --no-build-isolation -e . >&2
python scripts/gpu_check.py "${1:-$(mktemp -d)}"
