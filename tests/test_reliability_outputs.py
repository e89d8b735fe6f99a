"""Runs never lose work, part 4 (issue 44): an overwrite or a resume never destroys another run, a checkpoint or a
user's files. Runs go through the real CLI: `python -m mempo_trl` subprocesses, or `mempo_trl.cli.main` in process
where a failure is injected. Each wait is bounded.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cpu_recipe, one_error_line, record_as_run

from mempo_trl.cli import main


REPO = Path(__file__).resolve().parents[1]
SRC = str(REPO / "src")  # this checkout's code, whatever is installed


def mempo(*args, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m mempo_trl *args`, finished."""
    return subprocess.run(
        [sys.executable, "-m", "mempo_trl", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": SRC},
    )


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one `error:` line of a run that exited with code 2 (no traceback)."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-4000:]
    return lines[0]


def tree(directory: Path) -> dict[str, bytes | None]:
    """Every path under `directory` with its bytes (None for a directory)."""
    return {
        str(p.relative_to(directory)): None if p.is_dir() else p.read_bytes() for p in sorted(directory.rglob("*"))
    }


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model_dir):
    """A finished 2-step run (`checkpoint-1`, `checkpoint-2`, the model) and its recipe."""
    base = tmp_path_factory.mktemp("finished")
    recipe = cpu_recipe(base, tiny_model_dir, save_strategy="steps", save_steps=1, logging_steps=1, max_steps=2)
    result = mempo("train", "--config", recipe)
    assert result.returncode == 0, result.stderr[-4000:]
    return base / "out", recipe


def copy_run(finished, destination: Path) -> Path:
    shutil.copytree(finished[0], destination)  # sizes kept: the copy's record still matches it
    return destination


# ------------------------------------------------------------------------------------------ G1, R-a: what is a run's


def test_overwrite_never_deletes_a_directory_no_run_recorded(tmp_path, finished):
    """G1: names alone (`results.json`, a `checkpoint-N` of another tool) prove nothing."""
    project, other_tool = tmp_path / "proj", tmp_path / "hf_run"
    (project / "runs" / "exp1").mkdir(parents=True)
    (other_tool / "checkpoint-500").mkdir(parents=True)
    files = {
        "proj/README.md": "# my project",
        "proj/config.json": '{"lr": 1}',
        "proj/results.json": '{"acc": 0.9}',
        "proj/vocab.json": "{}",
        "proj/analysis.py": "x",
        "proj/runs/exp1/data.csv": "1,2",
        "hf_run/checkpoint-500/trainer_state.json": '{"global_step": 500}',
        "hf_run/notes.txt": "mine",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    before = tree(tmp_path)
    for directory, shown in ((project, "README.md, config.json, results.json, ..."), (other_tool, "checkpoint-500")):
        for extra in ([], ["--overwrite_output_dir", "true"]):
            line = error_line(mempo("train", "--config", finished[1], "--output_dir", directory, *extra))
            assert line == (
                f"error: output directory {directory} holds {shown}, which no mempo-trl run recorded and a run "
                "would overwrite. Move them away or choose another output directory."
            )
    assert tree(tmp_path) == before


def test_a_tampered_or_edited_record_never_deletes_a_users_file(tmp_path, capsys, finished):
    """R-a: a record entry counts only while the entry matches its fingerprint (or, in a record of an older version
    that lists names only, has a name a run writes); a card the user edited is theirs."""
    out = copy_run(finished, tmp_path / "out")
    (out / "thesis.tex").write_text("my thesis")
    record = json.loads((out / "_mempo_outputs.json").read_text())
    tampered = {"written": {**record["written"], "thesis.tex": "0123456789abcdef"}}
    (out / "_mempo_outputs.json").write_text(json.dumps(tampered))
    argv = ["train", "--config", str(finished[1]), "--output_dir", str(out), "--max_steps", "1"]
    assert main([*argv, "--save_strategy", "no", "--overwrite_output_dir", "true"]) == 0
    removed = next(line for line in capsys.readouterr().out.splitlines() if "removed the previous run" in line)
    assert removed == (
        "--overwrite_output_dir: removed the previous run's README.md, chat_template.jinja, checkpoint-1, "
        f"checkpoint-2, config.json, generation_config.json, mempo_agent.json, mempo_metrics.json, model.safetensors, "
        f"tokenizer.json, tokenizer_config.json, training_args.bin from {out}"
    )
    assert (out / "thesis.tex").read_text() == "my thesis"
    names = sorted(json.loads((out / "_mempo_outputs.json").read_text())["written"])
    assert "thesis.tex" not in names and "model.safetensors" in names
    (out / "_mempo_outputs.json").write_text(json.dumps({"written": [*names, "thesis.tex"]}))  # names only
    assert main([*argv, "--overwrite_output_dir", "true"]) == 0
    assert (out / "thesis.tex").read_text() == "my thesis"
    (out / "README.md").write_text("my notes on this run")  # the card, edited: the user's now
    assert main([*argv, "--overwrite_output_dir", "true"]) == 2
    assert one_error_line(capsys) == (
        f"error: output directory {out} holds README.md, which no mempo-trl run recorded and a run would "
        f"overwrite. Pass --resume_from_checkpoint {out / 'checkpoint-1'} to continue it, move them away or choose "
        "another output directory."
    )
    assert (out / "README.md").read_text() == "my notes on this run"


# ------------------------------------------------------------------------------------------ G2: resume elsewhere


def test_a_checkpoint_of_another_directory_never_touches_this_ones_results(tmp_path, capsys, finished):
    """G2: runB's checkpoint-2 is later than runA's checkpoint-1, yet no branch of runB's is abandoned."""
    run_a, run_b = copy_run(finished, tmp_path / "runA"), copy_run(finished, tmp_path / "runB")
    before_a, before_b = tree(run_a), tree(run_b)
    argv = ["train", "--config", finished[1], "--max_steps", 2, "--resume_from_checkpoint", run_a / "checkpoint-1"]
    line = error_line(mempo(*argv, "--output_dir", run_b))
    assert line.startswith(f"error: output directory {run_b} already holds results (README.md, "), line
    assert f"Pass --resume_from_checkpoint {run_b / 'checkpoint-2'} to continue it, --overwrite_output_dir" in line
    assert tree(run_b) == before_b
    # Into a directory of its own it continues runA's checkpoint, and runA stays as it was.
    assert main([*map(str, argv), "--output_dir", str(tmp_path / "runC")]) == 0
    assert "step 2/2" in capsys.readouterr().out and (tmp_path / "runC" / "model.safetensors").is_file()
    assert tree(run_a) == before_a


# ------------------------------------------------------------------------------------------ G3: a failed load


def test_a_full_weight_checkpoint_resumed_with_use_peft_is_refused_up_front(tmp_path, finished):
    out = copy_run(finished, tmp_path / "out")
    before = tree(out)
    argv = ["train", "--config", finished[1], "--output_dir", out, "--max_steps", 2, "--save_strategy", "steps"]
    result = mempo(*argv, "--use_peft", "true", "--lora_r", 4, "--resume_from_checkpoint", out / "checkpoint-1")
    assert error_line(result) == (
        f"error: checkpoint {out / 'checkpoint-1'} holds the full model's weights (model.safetensors), not a LoRA "
        "adapter, and this run has --use_peft true. Resume it without --use_peft (use_peft: false), as the run that "
        "saved it."
    )
    assert tree(out) == before


def test_a_lora_checkpoint_resumed_without_use_peft_is_refused_up_front(tmp_path, capsys, tiny_model_dir):
    recipe = cpu_recipe(
        tmp_path,
        tiny_model_dir,
        save_strategy="steps",
        save_steps=1,
        max_steps=2,
        use_peft=True,
        lora_r=4,
        lora_alpha=8,
    )
    out = tmp_path / "out"
    assert main(["train", "--config", str(recipe), "--max_steps", "1"]) == 0
    before = tree(out)
    resume = ["--resume_from_checkpoint", str(out / "checkpoint-1")]
    assert main(["train", "--config", str(recipe), "--use_peft", "false", *resume]) == 2
    assert one_error_line(capsys) == (
        f"error: checkpoint {out / 'checkpoint-1'} holds a LoRA adapter ({out / 'checkpoint-1' / 'adapter_config.json'})"
        ", and this run trains the full model. Resume it with --use_peft true --lora_r 4 (the LoRA settings of the run "
        "that saved it)."
    )
    assert tree(out) == before


def test_a_resume_that_fails_while_loading_writes_nothing(tmp_path, capsys, finished, monkeypatch):
    """G3: the checkpoint's state is loaded (step 1), then its optimizer fails to load: no step ran, nothing saved."""
    from transformers import Trainer

    def mismatch(self, checkpoint):
        if checkpoint is not None:
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of optimizer's")

    monkeypatch.setattr(Trainer, "_load_optimizer_and_scheduler", mismatch)
    out = copy_run(finished, tmp_path / "out")
    before = tree(out)
    argv = ["train", "--config", str(finished[1]), "--output_dir", str(out), "--max_steps", "2"]
    assert main([*argv, "--resume_from_checkpoint", str(out / "checkpoint-1")]) == 2
    assert one_error_line(capsys) == (
        "error: loaded state dict contains a parameter group that doesn't match the size of optimizer's"
    )
    assert tree(out) == before


# ------------------------------------------------------------------------------------------ G4, R-j: checks first


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--corpus", "nosuch.jsonl", "error: Corpus file nosuch.jsonl does not exist. "),
        ("--dataset_name", "bad.jsonl", "error: bad.jsonl, line 1: field 'question' must be a string with visible "),
    ],
)
def test_overwrite_deletes_the_previous_run_only_after_the_inputs_are_checked(
    tmp_path, finished, flag, value, message
):
    out = copy_run(finished, tmp_path / "out")
    (tmp_path / "bad.jsonl").write_text('{"id": "a", "question": "", "golden_answers": ["x"]}\n')
    before = tree(out)
    argv = ["train", "--config", finished[1], "--output_dir", out, "--overwrite_output_dir", "true", flag, value]
    assert error_line(mempo(*argv, cwd=tmp_path)).startswith(message)
    assert tree(out) == before


def test_eval_overwrite_keeps_the_previous_results_when_its_input_is_bad(tmp_path, capsys, tiny_model_dir):
    out, bad = tmp_path / "eval1", tmp_path / "bad.jsonl"
    out.mkdir()
    (out / "results.json").write_text('{"previous": true}')
    record_as_run(out, "results.json")
    bad.write_text('{"id": "a", "question": "", "golden_answers": ["x"]}\n')
    argv = ["eval", "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(bad), "--output_dir", str(out)]
    assert main([*argv, "--overwrite_output_dir", "true"]) == 2
    assert one_error_line(capsys).startswith(f"error: {bad}, line 1: field 'question' must be a string with visible")
    assert (out / "results.json").read_text() == '{"previous": true}'


def test_a_run_refused_late_leaves_no_output_dir_behind(tmp_path, finished):
    """R-j: the output directory a run created is removed when nothing was written into it."""
    out = tmp_path / "new" / "out"
    result = mempo("train", "--config", finished[1], "--output_dir", out, "--max_context_tokens", 10)
    assert "more than max_context_tokens=10" in error_line(result)
    assert not out.exists() and (tmp_path / "new").is_dir()
