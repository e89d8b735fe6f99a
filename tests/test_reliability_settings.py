"""A setting that turns the method into a no-op is refused or announced at the start, not found in the metrics
(issue 44: G7, R-b, R-c, R-i).

Every case runs `mempo-trl train` in process (`mempo_trl.cli.main`) on the tiny model and the demo world.
"""

import json
import shutil

import pytest
from helpers import cpu_recipe, one_error_line

from mempo_trl.cli import main


def train(tmp_path, model_dir, raw: str = "", **fields) -> list[str]:
    """`mempo-trl train` arguments for a short CPU run; `raw` is appended to the YAML as is (the last key counts)."""
    fields = {"save_strategy": "no", **fields}
    return ["train", "--config", str(cpu_recipe(tmp_path, model_dir, raw, **fields))]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            "memory_threshold: 0.5",
            "memory_threshold is a log-probability and must be < 0 (e.g. -0.69 = log 0.5), got 0.5",
        ),
        (
            "memory_threshold: 0",
            "memory_threshold is a log-probability and must be < 0 (e.g. -0.69 = log 0.5), got 0:",
        ),
        ("memory_coef: -1", "memory_coef must be >= 0.0, got -1."),
        ("memory_reward_eps: 0", "memory_reward_eps must be > 0 (log(P + eps) of a P of 0), got 0."),
        ("memory_reward_eps: -1.0e-6", "memory_reward_eps must be > 0 (log(P + eps) of a P of 0), got -1e-06."),
    ],
)
def test_a_memory_setting_that_voids_the_memory_reward_is_refused(tmp_path, capsys, tiny_model_dir, raw, message):
    assert main(train(tmp_path, tiny_model_dir, raw)) == 2
    line = one_error_line(capsys)
    assert line.startswith("error: Invalid MemPOConfig: - ") and message in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "setting, reason",
    [
        ({"memory_coef": 0.0}, "memory_coef is 0 (set memory_coef > 0 for MemPO)"),
        ({"context_mode": "full_history"}, "context_mode='full_history' does not score the memory reward"),
    ],
)
def test_a_setting_that_turns_memory_off_says_so_once(tmp_path, capsys, tiny_model_dir, setting, reason):
    assert main(train(tmp_path, tiny_model_dir, max_turns=2, **setting)) == 0
    out = capsys.readouterr().out
    announced = "the memory advantage is off, this run trains on the outcome reward only"
    assert out.count(announced) == 1 and f"mempo-trl: {reason}" in out, out[-3000:]


def test_memory_on_says_nothing_about_it(tmp_path, capsys, tiny_model_dir):
    assert main(train(tmp_path, tiny_model_dir, memory_coef=0.5, max_turns=2)) == 0
    assert "the memory advantage is off" not in capsys.readouterr().out


def test_dynamic_sampling_that_drops_every_group_says_so_once(tmp_path, capsys, tiny_model_dir):
    argv = train(tmp_path, tiny_model_dir, dynamic_sampling="drop", dynamic_sampling_tolerance=100.0, max_steps=2)
    assert main(argv) == 0
    out = capsys.readouterr().out
    warning = (
        "mempo-trl: WARNING: step 1: dynamic_sampling='drop' dropped every group (the outcome rewards of each span at "
        "most dynamic_sampling_tolerance=100.0): the step trains nothing."
    )
    assert out.count(warning) == 1 and out.count("dropped every group") == 1, out[-3000:]
    metrics = json.loads((tmp_path / "out" / "mempo_metrics.json").read_text())
    assert metrics["dynamic_sampling/groups_dropped"] == 1.0  # 4 rows, 4 generations: one group, dropped each step


def test_resume_with_another_max_turns_says_which_setting_changed(tmp_path, capsys, tiny_model_dir):
    first = train(tmp_path, tiny_model_dir, max_steps=2, max_turns=1, save_strategy="steps", save_steps=1)
    assert main(first) == 0
    out = tmp_path / "out"
    shutil.rmtree(out / "checkpoint-2")
    capsys.readouterr()
    assert main([*first, "--resume_from_checkpoint", str(out / "checkpoint-1"), "--max_turns", "2"]) == 0
    printed = capsys.readouterr().out
    assert (
        f"mempo-trl: resuming {out / 'checkpoint-1'} with another turn protocol: max_turns=2 overrides the saved "
        "max_turns=1 (this run's settings apply from here on and are saved with the model)."
    ) in printed, printed[-3000:]
    assert json.loads((out / "mempo_agent.json").read_text())["max_turns"] == 2


def test_resume_with_the_same_protocol_says_nothing_about_it(tmp_path, capsys, tiny_model_dir):
    argv = train(tmp_path, tiny_model_dir, max_steps=2, save_strategy="steps", save_steps=1)
    assert main(argv) == 0
    shutil.rmtree(tmp_path / "out" / "checkpoint-2")
    capsys.readouterr()
    assert main([*argv, "--resume_from_checkpoint", "true"]) == 0
    assert "another turn protocol" not in capsys.readouterr().out
