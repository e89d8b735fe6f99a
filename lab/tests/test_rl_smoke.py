"""The RL smoke (`lab/rl_smoke.py`): what it refuses before any work, and its step records. Its run end to end is
in `test_credit_study.py::test_quick_run_end_to_end`, through the GPU script's CPU dry run."""

import doctest
import json
import os
import subprocess

import credit_study
import pytest
import rl_smoke


def test_doctests():
    assert doctest.testmod(rl_smoke).failed == 0


QUICK_STUDY = credit_study.merged(credit_study.STUDY, credit_study.QUICK)


@pytest.mark.parametrize(
    "gate, expected",
    [
        (None, "gate.json is missing: no gated warm start in"),
        ({"warm_digest": "000000000000", "by_k": {}}, "gates warm start 000000000000, not this study's"),
        ("failed", "failed its gate"),
    ],
    ids=["missing", "another warm start", "failed"],
)
def test_a_warm_start_without_a_passed_gate_of_this_study_is_one_error_line(
    tmp_path, monkeypatch, capsys, gate, expected
):
    study_out = tmp_path / "credit"
    study_out.mkdir()
    if gate == "failed":
        cell = {"format_valid": 0.0, "searched_k": 0.0}
        gate = {"warm_digest": credit_study.warm_digest(QUICK_STUDY), "by_k": {"2": cell}}
        monkeypatch.setitem(credit_study.QUICK, "gate", {**credit_study.QUICK["gate"], "min_format_valid": 0.5})
    if gate is not None:
        (study_out / "gate.json").write_text(json.dumps(gate))
    monkeypatch.setattr(rl_smoke, "rows_dir", lambda *a: pytest.fail("work started"))
    assert rl_smoke.main(["--quick", "--study_out", str(study_out), "--out", str(tmp_path / "smoke")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and expected in line, line


def test_each_arm_trains_with_the_shared_command_and_its_own_arguments(tmp_path):
    base = rl_smoke.train_command(
        tmp_path / "m", tmp_path / "d", tmp_path / "c.jsonl", tmp_path / "a", credit_study.STUDY, rl_smoke.SMOKE, "cpu"
    )
    value = {flag: base[i + 1] for i, flag in enumerate(base) if flag.startswith("--") and i + 1 < len(base)}
    assert value["--max_turns"] == "6" and value["--max_completion_length"] == "128"
    assert value["--instruction"] == credit_study.STUDY["protocol"]["instruction"]
    assert value["--learning_rate"] == "5e-05" and value["--max_steps"] == "3"
    # 16 episodes an optimizer step, 4 a forward (all 16 in one forward were OOM-killed at 22 GB)
    assert value["--per_device_train_batch_size"] == "4" and value["--gradient_accumulation_steps"] == "4"
    assert value["--num_generations"] == "4"
    assert "--use_peft" in base and value["--save_steps"] == "1"
    assert rl_smoke.ARMS["mempo"] == [] and rl_smoke.ARMS["outcome_only_dynamic"] == [
        "--memory_coef",
        "0",
        "--dynamic_sampling",
        "refill",
    ]


def test_an_arms_training_ends_with_the_smoke(tmp_path, monkeypatch):
    """`mempo-trl train` is started naming the smoke as the parent it ends with (`child_env`): a smoke killed, even
    by SIGKILL, leaves no training behind."""
    from mempo_trl.processes import PARENT_PID_ENV

    started = []

    def run(command, **kwargs):
        started.append(kwargs["env"])
        return subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(rl_smoke.subprocess, "run", run)
    with pytest.raises(SystemExit, match="exit code 1"):
        rl_smoke.run_arm("mempo", ["mempo-trl", "train"], tmp_path / "mempo", lambda line: None)
    assert started[0][PARENT_PID_ENV] == str(os.getpid()) and started[0]["PYTHONUNBUFFERED"] == "1"
