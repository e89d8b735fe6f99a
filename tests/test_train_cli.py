"""`mempo-trl train`: a bad recipe stops before training with one clear message (exit code 2, no traceback); the
quick start recipe trains the shipped learner on its own world."""

import json
import os
import re
from pathlib import Path

import pytest
from helpers import cpu_recipe, record_as_run

from mempo_trl.cli import main
from mempo_trl.kit.demo_world import demo_paths


DEMO = demo_paths()
"""The demo world shipped with the kit: what these recipes train and search."""


@pytest.fixture
def recipe(tmp_path, tiny_model_dir):
    def write(**fields):
        return str(cpu_recipe(tmp_path, tiny_model_dir, **fields))

    return write


def _fails(capsys, argv, *needles):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    message = err[err.index("error: ") :]  # may span lines (one per problem) but is one message
    for needle in needles:
        assert needle in message
    return message


def test_unknown_recipe_key(capsys, recipe):
    _fails(capsys, ["--config", recipe(max_turnz=3)], "max_turnz")


def test_missing_corpus_file(capsys, recipe, tmp_path):
    _fails(capsys, ["--config", recipe(corpus=str(tmp_path / "nope.jsonl"))], "nope.jsonl")


def test_rows_without_golden_answers(capsys, recipe, tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text('{"question": "a?", "golden_answers": ["x"]}\n{"question": "b?"}\n')
    _fails(capsys, ["--config", recipe(dataset_name=str(data))], "qa.jsonl", "line 2", "golden_answers")


def test_batch_size_not_divisible_by_num_generations(capsys, recipe):
    _fails(capsys, ["--config", recipe(per_device_train_batch_size=3)], "num_generations")


def test_unknown_reward_name(capsys, recipe):
    _fails(
        capsys, ["--config", recipe(reward_funcs=["mempo_outcome_reward", "style"])], "style", "mempo_format_reward"
    )


def test_invalid_mempo_setting(capsys, recipe):
    _fails(capsys, ["--config", recipe(memory_pooling="round")], "memory_pooling")


def test_heldout_questions_prints_em_before_and_after_training(capsys, recipe, tmp_path):
    metric = "mempo_trl.kit.learner.memory_recall_metric"
    assert main(["train", "--config", recipe(heldout_questions=3, heldout_row_metric=metric, max_steps=1)]) == 0
    out = capsys.readouterr().out
    *_, saved, last = out.strip().splitlines()
    assert last.startswith("held-out EM (3 questions, greedy): ")
    # The run ends with where things went and that line, no metrics dump (they are in mempo_metrics.json).
    assert (
        saved == f"model saved to {tmp_path / 'out'} (metrics: {tmp_path / 'out' / 'mempo_metrics.json'}, "
        f"model card: {tmp_path / 'out' / 'README.md'})"
    )
    assert '"train_runtime"' not in out and not any(line.strip() in ("{", "}") for line in out.splitlines())
    assert "before training (step 0) -> " in last and "after (step 1)" in last
    # Each evaluation says when it starts and what it found, with its time.
    assert out.count("held-out evaluation before training: 3 questions, greedy ...") == 1
    assert out.count("held-out evaluation after training: 3 questions, greedy ...") == 1
    # The demo rows' memory recall (`mempo_trl.kit.learner.memory_recall_metric`): a number, every row has hops.
    assert re.search(
        r"held-out evaluation at step 0: EM [\d.]+ \| format [\d.]+ \| memory recall [\d.]+ \(\d+ s\)", out
    )
    # ... and the metrics file keeps both, next to the last step's metrics.
    metrics = json.loads((tmp_path / "out" / "mempo_metrics.json").read_text())
    assert metrics["heldout/questions"] == 3
    assert (metrics["heldout/step_before"], metrics["heldout/step_after"]) == (0, 1)
    assert f"{metrics['heldout/em_before']:.3f} before training" in last
    assert f"{metrics['heldout/em_after']:.3f} after (step 1)" in last
    assert f"memory recall {metrics['heldout/memory_recall_before']:.3f} -> " in last
    assert "episode/em" in metrics


def test_overwrite_output_dir_removes_the_previous_runs_results(capsys, recipe, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("model.safetensors", "README.md", "mempo_metrics.json"):
        (out / name).write_text("previous run")
    (out / "checkpoint-3").mkdir()
    record_as_run(out, "model.safetensors", "README.md", "mempo_metrics.json", "checkpoint-3")
    lora = recipe(use_peft=True, lora_r=2, lora_target_modules=["q_proj", "v_proj"])
    assert main(["train", "--config", lora, "--overwrite_output_dir"]) == 0
    printed = capsys.readouterr().out
    assert "removed the previous run's README.md, checkpoint-3, mempo_metrics.json, model.safetensors" in printed
    # Without a held-out evaluation the last line is the run's own summary, read from the metrics file.
    metrics = json.loads((out / "mempo_metrics.json").read_text())
    assert printed.strip().splitlines()[-1] == (
        f"trained 1 step in {metrics['train_runtime']:.0f} s | last step: reward {metrics['reward']:.3f} | "
        f"em {metrics['episode/em']:.3f} | format {metrics['episode/format_valid']:.3f} "
        "(no held-out evaluation: set heldout_questions)"
    )
    assert (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists() and not (out / "checkpoint-3").exists()  # no stale full weights
    assert (out / "README.md").read_text() != "previous run"


def test_a_finished_run_tears_down_its_process_groups(recipe, tmp_path):
    """Left to interpreter exit, an extra process group (vLLM's TP group) can abort a finished rank (SIGABRT)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = (
        "import torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{port}', rank=0, world_size=1)\n"
        "dist.new_group([0])\n"
        "from mempo_trl.cli import main\n"
        f"code = main(['train', '--config', {recipe()!r}])\n"
        "print('exit', code, 'initialized', dist.is_initialized())\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "exit 0 initialized False"


QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "configs" / "quickstart_cpu.yaml"


@pytest.mark.slow
def test_quickstart_trains_the_shipped_learner_on_its_own_world(capsys, tmp_path, monkeypatch):
    """The quick start as the README gives it, shortened: `mempo-trl kit learner` writes the shipped learner and its
    world where the recipe names them, and training trains, searches and evaluates on that world."""
    from mempo_trl.commands.recipe import build_trainer
    from mempo_trl.commands.train import parse_args
    from mempo_trl.data import load_qa
    from mempo_trl.kit.learner import shipped_learner

    monkeypatch.chdir(tmp_path)  # the recipe's paths are relative, as in a clone
    assert main(["kit", "learner", "--output_dir", "kit/learner"]) == 0
    out, world = tmp_path / "quickstart", tmp_path / "kit" / "learner" / "world"
    argv = [
        "--config",
        str(QUICKSTART),
        "--output_dir",
        str(out),
        "--max_steps",
        "1",
        "--per_device_train_batch_size",
        "4",
        "--heldout_questions",
        "3",
    ]
    script_args, training_args, model_args, retriever_args = parse_args(argv)
    assert model_args.model_name_or_path == "kit/learner/model" and training_args.instruction == "Question: {question}"
    trainer = build_trainer(script_args, training_args, model_args, retriever_args)
    assert [r["question"] for r in trainer.train_dataset] == [r["question"] for r in load_qa(str(world / "rl.jsonl"))]
    shipped = json.loads((shipped_learner() / "config.json").read_text())
    assert trainer.model.config.hidden_size == shipped["hidden_size"] == 128
    heldout = next(c for c in trainer.callback_handler.callbacks if hasattr(c, "before_after"))
    first_test = json.loads((world / "test.jsonl").read_text().splitlines()[0])
    assert heldout.rows[0]["question"] == first_test["question"]
    passage = trainer.retriever.search([first_test["hop_queries"][0]], topk=1)[0][0]
    assert passage.id in {json.loads(line)["id"] for line in (world / "corpus.jsonl").read_text().splitlines()}

    assert main(["train", *argv]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("held-out EM (3 questions, greedy): ") and "after (step 1)" in last
    assert json.loads((out / "mempo_agent.json").read_text())["instruction"] == "Question: {question}"


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_a_launched_process_leaves_without_finalisation(monkeypatch, world_size):
    """Under a launcher, `mempo-trl train` runs the atexit handlers, then `os._exit(rc)`; alone it just returns."""
    from mempo_trl.commands import train

    calls = []
    monkeypatch.setenv("WORLD_SIZE", world_size)
    monkeypatch.setattr("atexit._run_exitfuncs", lambda: calls.append("atexit"))
    monkeypatch.setattr(train.os, "_exit", lambda rc: calls.append(("exit", rc)))
    train.leave_launched_process(3)
    assert calls == ([] if world_size == "1" else ["atexit", ("exit", 3)])


@pytest.mark.slow
def test_a_lora_run_with_activation_checkpointing_prints_no_deprecation_warning(recipe):
    """The SmolLM2 recipe's settings (LoRA, activation checkpointing) ran with two transformers `FutureWarning`s
    (`gradient_checkpointing_enable/disable`): ours are gone and TRL's are filtered (`UPSTREAM_NOISE`)."""
    import subprocess
    import sys

    config = recipe(
        use_peft=True, lora_r=2, lora_target_modules=["q_proj", "v_proj"], activation_checkpointing=True, max_turns=2
    )
    done = subprocess.run(
        [sys.executable, "-m", "mempo_trl", "train", "--config", config],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "default"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "FutureWarning" not in done.stderr and "deprecated" not in done.stderr, done.stderr[-3000:]
