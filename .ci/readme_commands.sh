#!/usr/bin/env bash
# CI: run the README's quick start and CPU-launch commands as written (`.ci/readme_commands.py` reads them from
# README.md), in a fresh directory, each under a time limit, so that a README command that hangs or fails is a red CI.
# Two arguments are appended, and only these: `$README_QUICKSTART_OVERRIDE` (default `--max_steps 10`) to the quick
# start's `mempo-trl train`, to fit the CI budget, and `--max_steps 1` to the two-process launches. One command is
# skipped: `examples/smollm2_cpu.sh` (SmolLM2 end to end, ~30 min), which `tests/test_smollm2.py` runs at its smallest. `git clone`,
# `python -m venv` and `pip install` lines are skipped: CI runs in a clone where `.ci/run` has just installed the
# package in a fresh virtualenv.
#   bash .ci/readme_commands.sh            (from the repository root, with the package installed)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
limit_s="${README_COMMAND_LIMIT_S:-600}"        # per command: a hang fails here, not after the CI job's own limit
quickstart_override="${README_QUICKSTART_OVERRIDE---max_steps 10}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
ln -s "$root/examples" "$work/examples"          # the commands name examples/... relative to a clone's root
ln -s "$root/accelerate_configs" "$work/accelerate_configs"
export MEMPO_CACHE="$work/cache"                 # fresh: `mempo-trl kit tiny` builds the tiny model, as on a new machine
cd "$work"

mapfile -t commands < <(python "$root/.ci/readme_commands.py" "$root/README.md")
[ "${#commands[@]}" -ge 5 ] || { echo "readme_commands: found only ${#commands[@]} commands in README.md"; exit 1; }

start=$(date +%s)
for command in "${commands[@]}"; do
  extra=""
  case "$command" in
    *"mempo-trl train --config examples/configs/quickstart_cpu.yaml") extra=" $quickstart_override" ;;
    *examples/smollm2_cpu.sh*)  # ~30 min as written; the slow test runs this script at its smallest, twice
      echo "::: $command  (skipped: tests/test_smollm2.py::test_smollm2_recipe_runs_end_to_end_small runs it)"
      continue ;;
    *--num_processes*|"accelerate launch"*) extra=" --max_steps 1" ;;
  esac
  echo "::: $command$extra"
  t0=$(date +%s)
  set +e
  timeout --kill-after 30 "$limit_s" bash -c "$command$extra" < /dev/null > "$work/log" 2>&1
  rc=$?
  set -e
  tail -n 4 "$work/log"
  echo "::: rc=$rc in $(( $(date +%s) - t0 )) s"
  if [ "$rc" -ne 0 ]; then
    [ "$rc" -eq 124 ] && echo "readme_commands: timed out after ${limit_s} s (a hang?)"
    tail -n 60 "$work/log"
    exit 1
  fi
done
echo "readme_commands: ${#commands[@]} README commands passed in $(( $(date +%s) - start )) s"
