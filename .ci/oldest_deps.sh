#!/usr/bin/env bash
# CI, oldest versions: a fresh virtualenv with the lowest release that each core dependency range of pyproject.toml
# allows (every `>=X` floor installed as `==X`), then a fast subset of the tests, so that no floor claims what was
# not run. torch stays at the CPU build CI uses (2.13.0): the only CPU build of torch this machine's registry offers.
#   bash .ci/oldest_deps.sh
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export TOKENIZERS_PARALLELISM=false PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1

VENV=.venv-oldest
rm -rf "$VENV"
python3 -m venv "$VENV"
. "$VENV/bin/activate"

# `name==floor` for every core dependency; a floor that is not a `>=` on an exact release fails here.
python - >"$VENV/oldest.txt" <<'PY'
import re
import tomllib

for requirement in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    name, spec = re.match(r"([A-Za-z0-9_.-]+)(.*)", requirement).groups()
    floor = re.search(r">=\s*([0-9][0-9.]*)", spec)
    if floor is None or floor.group(1).count(".") < 2 and name != "torch":
        raise SystemExit(f"error: pyproject.toml: {requirement!r} needs a `>=` floor on an exact release (X.Y.Z)")
    if name != "torch":
        print(f"{name}=={floor.group(1)}")
PY
echo "oldest versions: $(tr '\n' ' ' <"$VENV/oldest.txt")"

pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
# -c pins the floors; the test tools take what they need. A floor that cannot be installed fails the job.
pip install -q -c "$VENV/oldest.txt" -e ".[kit]" "pytest>=9.0,<10" "pytest-timeout>=2.4" "hypothesis>=6.170" \
    2>&1 | grep -v "^WARNING: Location" || true
python - "$VENV/oldest.txt" <<'PY'
import sys
from importlib.metadata import version

wanted = dict(line.strip().split("==") for line in open(sys.argv[1]) if line.strip())
got = {name: version(name) for name in wanted}
print("installed:", " ".join(f"{name}=={v}" for name, v in got.items()))
wrong = {name: (wanted[name], v) for name, v in got.items() if v != wanted[name]}
if wrong:
    raise SystemExit(f"error: not the oldest versions: {wrong}")
PY

# The fast subset: the trainer (scripted rollouts, wiring, TRL features), scoring, memory, rewards, protocol,
# stopping and the retriever; nothing slow or multi-process.
set +e
python -m pytest -q -p no:cacheprovider -m "not slow and not distributed" \
    tests/test_trainer_scripted.py tests/test_trainer_wiring.py tests/test_trainer_trl_features.py \
    tests/test_scoring.py tests/test_memory.py tests/test_advantages.py tests/test_rewards.py tests/test_protocol.py \
    tests/test_stopping.py tests/test_retrieval_bm25.py tests/test_continuous_batching.py
rc=$?
set -e
echo "oldest-versions CI wall time: $(( $(date +%s) - start )) s"
exit "$rc"
