"""End to end on a random Qwen2.5-shaped model: the real 151,936-row vocabulary, tokenizer and chat template.

2 MemPO steps with `mempo-trl train` on the model built by `build_qwen2_5_model` (what `mempo-trl kit
build-qwen-model` saves), then `mempo-trl eval` on the trained model, through the command line as a user runs them
(tiny hidden size, so it fits on a CPU).
"""

import json

import pytest

from mempo_trl.cli import main
from mempo_trl.kit.demo_world import demo_paths
from mempo_trl.loading import load_tokenizer


@pytest.mark.slow
def test_train_two_steps_then_eval_on_a_qwen2_5_shaped_model(qwen_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEMPO_CACHE", str(tmp_path / "cache"))
    base, trained, evaluated = qwen_model_dir, tmp_path / "trained", tmp_path / "eval"
    recipe = {
        "model_name_or_path": str(base),
        "output_dir": str(trained),
        "use_cpu": True,
        "bf16": False,
        "report_to": "none",
        "save_strategy": "no",
        "max_steps": 2,
        "logging_steps": 1,
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_completion_length": 8,
        "max_turns": 2,
        "reward_funcs": ["mempo_outcome_reward", "mempo_format_reward"],
        "dataset_name": str(demo_paths().train.parent),
        "corpus": str(demo_paths().corpus),
    }
    (tmp_path / "recipe.yaml").write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in recipe.items()))
    assert main(["train", "--config", str(tmp_path / "recipe.yaml")]) == 0
    metrics = json.loads((trained / "mempo_metrics.json").read_text())
    assert metrics["train_runtime"] > 0 and "episode/format_valid" in metrics

    tokenizer = load_tokenizer(trained)
    assert tokenizer("Hello world, how are you?").input_ids == [9707, 1879, 11, 1246, 525, 498, 30]
    assert json.loads((trained / "config.json").read_text())["vocab_size"] == 151936

    argv = ["eval", "--model_name_or_path", str(trained), "--output_dir", str(evaluated), "--max_eval_samples", "3"]
    argv += ["--dataset_name", str(demo_paths().test), "--corpus", str(demo_paths().corpus)]
    assert main([*argv, "--max_turns", "2", "--max_completion_length", "8", "--disable_tqdm", "true"]) == 0
    report = json.loads((evaluated / "results.json").read_text())
    assert report["settings"]["num_questions"] == 3
    rows = [json.loads(line) for line in (evaluated / "trajectories.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    capsys.readouterr()
