"""The kit environments' training experiment, `lab/environments_training.py`: where it writes, and one tiny run."""

import doctest
import json
from pathlib import Path

import environments_training
import pytest


def test_environments_training_publishes_only_its_default_settings():
    """Only the default settings run into the default ``--out`` write `lab/results/environments_training.json`
    (the doctests of `default_results`)."""
    assert doctest.testmod(environments_training).failed == 0


@pytest.mark.slow
def test_environments_training_bench_end_to_end(tmp_path):
    """`lab/environments_training.py` at the smallest size: both warm starts, both context modes, one step each;
    the summary lands next to the runs with its command, versions, machine and settings, and the committed summary
    is left alone (non-default settings). A rerun with the same settings reuses the warm starts."""
    bench = environments_training
    committed = Path(__file__).resolve().parents[2] / bench.RESULTS
    before = committed.read_bytes()
    argv = ["--warm_steps", "2", "--steps", "1", "--warm_eval_rows", "2", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    summary = json.loads((tmp_path / "environments_training.json").read_text())
    runs = [f"{env} {mode}" for env in bench.ENVIRONMENTS for mode in bench.MODES]
    assert sorted(summary) == sorted(["command", "versions", "machine", "settings", "warm", *runs])
    assert summary["command"] == "python lab/environments_training.py " + " ".join(argv)
    assert {"torch", "transformers", "trl", "mempo_trl"} <= set(summary["versions"])
    assert summary["settings"]["train"]["max_steps"] == 1
    for env in bench.ENVIRONMENTS:
        warm = summary["warm"][env]
        assert warm["settings"]["steps"] == 2 and warm["settings"]["eval_rows"] == 2
        assert warm["sft_examples"] > 0 and "turns" in warm["held_out_greedy"]
        assert (tmp_path / f"warm_{env}" / "warm_start.json").is_file()
        assert (tmp_path / f"rows_{env}" / "train.jsonl").is_file()
    for run in runs:
        assert sorted(summary[run]) == sorted([*bench.KEYS, "seconds"])
        assert len(summary[run]["tokens/prompt_per_round"]) == 1 and len(summary[run]["reward"]) == 1
    assert committed.read_bytes() == before
    assert not (tmp_path / "bench").exists()
    weights = tmp_path / "warm_safe" / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert (
        bench.warm_start("safe", tmp_path / "warm_safe", summary["warm"]["safe"]["settings"])
        == summary["warm"]["safe"]
    )
    assert weights.stat().st_mtime_ns == written
