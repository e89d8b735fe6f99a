"""The output directory's lifecycle through the real CLI: `--overwrite_output_dir` deletes only a previous run's
outputs, an output directory apart from the inputs, one run at a time (a lock), and resume never picks a checkpoint
of an abandoned branch. Runs are subprocesses of `python -m mempo_trl` or `mempo_trl.cli.main` in process; each wait
is bounded.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import cpu_recipe, one_error_line, record_as_run

from mempo_trl.cli import main
from mempo_trl.kit.demo_world import demo_paths


SRC = str(Path(__file__).resolve().parents[1] / "src")  # this checkout's code, whatever is installed


def start(argv: list[str], cwd: Path) -> tuple[subprocess.Popen, list[str]]:
    """`python -m mempo_trl *argv` in the background, and the list its output lines are collected into."""
    process = subprocess.Popen(
        [sys.executable, "-m", "mempo_trl", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": SRC, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True).start()
    return process, lines


def wait_for(process: subprocess.Popen, lines: list[str], text: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not any(text in line for line in lines):
        assert process.poll() is None and time.monotonic() < deadline, "".join(lines)[-4000:]
        time.sleep(0.1)


def tree(directory: Path) -> dict[str, bytes | None]:
    """Every path under `directory` (links not followed) with its bytes (None for a directory or a link)."""
    return {
        str(p.relative_to(directory)): None if p.is_dir() or p.is_symlink() else p.read_bytes()
        for p in sorted(directory.rglob("*"))
    }


# ------------------------------------------------------------------------------------------ F1: overwrite


def test_overwrite_deletes_only_the_previous_runs_outputs(tmp_path, tiny_model_dir):
    out = tmp_path / "userdir"
    (out / "photos").mkdir(parents=True)
    (out / "photos" / "cat.jpg").write_bytes(b"\xff\xd8 a photo")
    (out / "thesis.tex").write_text("my thesis")
    # A previous run's outputs: a checkpoint, the metrics, weights and card, in its record.
    (out / "checkpoint-7").mkdir()
    (out / "checkpoint-7" / "trainer_state.json").write_text("{}")
    for name in ("mempo_metrics.json", "model.safetensors", "README.md", "training_args.bin"):
        (out / name).write_text("previous run")
    record_as_run(out, "checkpoint-7", "mempo_metrics.json", "model.safetensors", "README.md", "training_args.bin")
    recipe = cpu_recipe(tmp_path, tiny_model_dir, output_dir=str(out), save_strategy="no")
    result = subprocess.run(
        [sys.executable, "-m", "mempo_trl", "train", "--config", str(recipe), "--overwrite_output_dir", "true"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": SRC},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (
        f"--overwrite_output_dir: removed the previous run's README.md, checkpoint-7, mempo_metrics.json, "
        f"model.safetensors, training_args.bin from {out}"
    ) in result.stdout
    assert (out / "thesis.tex").read_text() == "my thesis"
    assert (out / "photos" / "cat.jpg").read_bytes() == b"\xff\xd8 a photo"
    assert not (out / "checkpoint-7").exists() and (out / "model.safetensors").stat().st_size > 1000
    written = json.loads((out / "_mempo_outputs.json").read_text())["written"]
    assert {"README.md", "config.json", "mempo_metrics.json", "model.safetensors"} <= set(written)
    assert "thesis.tex" not in written and "photos" not in written
    # The next refusal lists only the run's outputs as results, and says the other files stay.
    line = subprocess.run(
        [sys.executable, "-m", "mempo_trl", "train", "--config", str(recipe)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": SRC},
    ).stderr.strip()
    assert line.startswith(f"error: output directory {out} already holds results (README.md, _mempo_outputs.json,")
    assert "thesis" not in line and "photos" not in line and "(other files there are kept)" in line


def test_eval_and_train_share_the_rules_other_files_alone_need_overwrite(tmp_path, capsys, tiny_model_dir):
    qa = demo_paths().test
    out = tmp_path / "notes"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    argv = ["eval", "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(qa), "--output_dir", str(out)]
    assert main(argv) == 2
    assert one_error_line(capsys) == (
        f"error: output directory {out} holds other files (notes.txt). Pass --overwrite_output_dir to write into it "
        "(they are kept), or choose another output directory."
    )
    (out / "README.md").write_text("my project")  # a name a run writes, not written by one: never overwritten
    for extra in ([], ["--overwrite_output_dir", "true"]):
        assert main([*argv, *extra]) == 2
        assert one_error_line(capsys) == (
            f"error: output directory {out} holds README.md, which no mempo-trl run recorded and a run would "
            "overwrite. Move them away or choose another output directory."
        )
    assert tree(out) == {"README.md": b"my project", "notes.txt": b"mine"}
    # A previous evaluation's results are replaced; notes.txt stays, as with train.
    (out / "README.md").unlink()
    (out / "trajectories.jsonl").write_text("an earlier evaluation")
    record_as_run(out, "trajectories.jsonl")
    corpus = ["--corpus", str(demo_paths().corpus), "--max_eval_samples", "1", "--disable_tqdm", "true"]
    assert main([*argv, *corpus, "--overwrite_output_dir", "true"]) == 0
    assert f"removed the previous run's trajectories.jsonl from {out}" in capsys.readouterr().out
    assert (out / "notes.txt").read_text() == "mine" and (out / "results.json").is_file()
    assert (out / "trajectories.jsonl").read_text() != "an earlier evaluation"


@pytest.mark.parametrize(
    ("output", "relation", "what", "given"),
    [
        ("MODEL", "is", "model", "MODEL"),
        ("DATA", "is", "dataset", "DATA"),
        ("WORLD", "contains", "corpus", "WORLD/corpus.jsonl"),
        ("MODEL/run1", "lies inside", "model", "MODEL"),
        ("CFG", "contains", "recipe", "CFG/recipe.yaml"),
    ],
)
def test_an_output_dir_overlapping_an_input_is_refused_before_any_work(
    tmp_path, capsys, tiny_model_dir, output, relation, what, given
):
    import shutil

    shutil.copytree(tiny_model_dir, tmp_path / "model")
    (tmp_path / "world").mkdir()
    (tmp_path / "world" / "corpus.jsonl").write_text('{"id": "1", "contents": "Alice was born in Ulm."}\n')
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(
        '{"question": "Where was Alice born?", "golden_answers": ["Ulm"]}\n'
    )
    (tmp_path / "cfg").mkdir()
    names = {"MODEL": "model", "DATA": "data", "WORLD": "world", "CFG": "cfg"}
    expand = lambda s: str(tmp_path / names[s.split("/")[0]]) + s[len(s.split("/")[0]) :]  # noqa: E731
    recipe = cpu_recipe(
        tmp_path / "cfg",
        tmp_path / "model",
        dataset_name=str(tmp_path / "data"),
        corpus=str(tmp_path / "world" / "corpus.jsonl"),
        output_dir=expand(output),
    )
    before = tree(tmp_path)
    assert main(["train", "--config", str(recipe), "--overwrite_output_dir", "true"]) == 2
    assert one_error_line(capsys) == (
        f"error: output directory {expand(output)} {relation} the {what} {expand(given)}: results and inputs would "
        "mix. Choose another output directory."
    )
    assert tree(tmp_path) == before  # nothing deleted, nothing written


def test_symlinked_output_dirs_never_delete_through_the_link(tmp_path, capsys, tiny_model_dir):
    (tmp_path / "rootlink").symlink_to("/")
    recipe = cpu_recipe(tmp_path, tiny_model_dir, output_dir=str(tmp_path / "rootlink"))
    assert main(["train", "--config", str(recipe)]) == 2
    line = one_error_line(capsys)
    assert line == (
        f"error: output directory {tmp_path / 'rootlink'} (a link to /) is /, a directory that holds far more than "
        "results. Choose a directory of its own (outputs/run1)."
    )
    assert "--overwrite_output_dir" not in line
    target = tmp_path / "real"
    target.mkdir()
    for name in ("important.txt", "mempo_metrics.json"):
        (target / name).write_text("keep")
    record_as_run(target, "mempo_metrics.json")  # a run's metrics
    record = (target / "_mempo_outputs.json").read_bytes()
    (tmp_path / "linkout").symlink_to(target)
    recipe = cpu_recipe(tmp_path, tiny_model_dir, output_dir=str(tmp_path / "linkout"))
    assert main(["train", "--config", str(recipe), "--overwrite_output_dir", "true"]) == 2
    assert one_error_line(capsys) == (
        f"error: output directory {tmp_path / 'linkout'} is a link to {target}: --overwrite_output_dir deletes "
        f"nothing through a link. Pass {target} itself, or choose another output directory."
    )
    assert tree(target) == {"_mempo_outputs.json": record, "important.txt": b"keep", "mempo_metrics.json": b"keep"}


# ------------------------------------------------------------------------------------------ F13: merge-lora


@pytest.mark.parametrize("output", ["ADAPTER", "ADAPTER/merged", "."])
def test_merge_lora_into_its_adapter_dir_is_refused_before_writing(tmp_path, capsys, output, monkeypatch):
    adapter = tmp_path / "lora1"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": "base"}')
    (adapter / "adapter_model.safetensors").write_bytes(b"adapter weights")
    monkeypatch.chdir(tmp_path / "lora1" if output == "." else tmp_path)
    destination = output.replace("ADAPTER", str(adapter))
    relation = {"ADAPTER": "is", "ADAPTER/merged": "lies inside", ".": "is"}[output]
    argv = ["merge-lora", "--model_name_or_path", str(adapter), "--output_dir", destination]
    assert main([*argv, "--overwrite_output_dir", "true"]) == 2
    assert one_error_line(capsys) == (
        f"error: output directory {destination} {relation} the model {adapter}: results and inputs would mix. "
        "Choose another output directory."
    )
    assert tree(adapter) == {
        "adapter_config.json": b'{"base_model_name_or_path": "base"}',
        "adapter_model.safetensors": b"adapter weights",
    }


# ------------------------------------------------------------------------------------------ F4: one run at a time


def test_a_second_run_into_a_running_output_dir_is_refused(tmp_path, capsys, tiny_model_dir):
    """Run A goes through the launcher with two processes: its top process holds the lock, its ranks share it."""
    recipe = cpu_recipe(tmp_path, tiny_model_dir, max_steps=2, save_strategy="no", logging_steps=1)
    first, lines = start(["train", "--config", str(recipe), "--num_processes", "2"], tmp_path)
    try:
        wait_for(first, lines, "mempo-trl: launching")
        assert main(["train", "--config", str(recipe), "--overwrite_output_dir", "true"]) == 2
        assert one_error_line(capsys) == (
            f"error: output directory {tmp_path / 'out'} is in use by another mempo-trl run. Wait for it to end, or "
            "choose another output directory."
        )
        assert first.wait(timeout=600) == 0, "".join(lines)[-4000:]
    finally:
        first.kill()
    written = json.loads((tmp_path / "out" / "_mempo_outputs.json").read_text())["written"]
    assert "model.safetensors" in written and "mempo_metrics.json" in written


def test_the_lock_of_a_killed_run_is_gone_with_it(tmp_path, capsys, tiny_model_dir):
    """A run killed before it records its outputs: what appeared after it began, with names a run writes, is its."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("there before")
    recipe = cpu_recipe(tmp_path, tiny_model_dir, max_steps=500, save_strategy="steps", save_steps=1, logging_steps=1)
    first, lines = start(["train", "--config", str(recipe), "--overwrite_output_dir", "true"], tmp_path)
    try:
        wait_for(first, lines, "step 2/500")  # checkpoint-1 is saved
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    (out / "later.txt").write_text("added after the kill")
    argv = ["train", "--config", str(recipe), "--max_steps", "1", "--save_strategy", "no"]
    assert main([*argv, "--overwrite_output_dir", "true"]) == 0
    removed = next(line for line in capsys.readouterr().out.splitlines() if "removed the previous run's" in line)
    assert "checkpoint-1" in removed and "notes.txt" not in removed and "later.txt" not in removed, removed
    assert not list(out.glob("checkpoint-*")) and (out / "model.safetensors").is_file()
    assert (out / "notes.txt").read_text() == "there before" and (out / "later.txt").is_file()


# ------------------------------------------------------------------------------------------ R3: abandoned branch


def test_resuming_from_an_earlier_checkpoint_drops_the_abandoned_later_ones(tmp_path, capsys, tiny_model_dir):
    out = tmp_path / "out"
    recipe = cpu_recipe(tmp_path, tiny_model_dir, save_strategy="steps", save_steps=1, logging_steps=1)
    assert main(["train", "--config", str(recipe), "--max_steps", "3"]) == 0
    capsys.readouterr()
    # Continue from checkpoint-1 on another branch (here: to step 2); checkpoint-2 and -3 of the first are abandoned.
    argv = ["train", "--config", str(recipe), "--max_steps", "2"]
    assert main([*argv, "--resume_from_checkpoint", str(out / "checkpoint-1")]) == 0
    assert (
        f"resuming from {out / 'checkpoint-1'}: removed the later checkpoint-2, checkpoint-3 of the run it continued "
        "before (a branch this resume abandons)"
    ) in capsys.readouterr().out
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert main([*argv, "--resume_from_checkpoint", "true"]) == 0
    assert capsys.readouterr().out.startswith(
        f"{out / 'checkpoint-2'} is already at the end of training (step 2 of 2)"
    )
