#!/usr/bin/env bash
# One LoRA + vLLM-colocate MemPO step on a CUDA machine; exits non-zero if the adapter never reaches vLLM.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, vllm, trl; print('torch', torch.__version__, 'vllm', vllm.__version__, 'trl', trl.__version__)"
python scripts/gpu_check.py "${1:-$(mktemp -d)}"
