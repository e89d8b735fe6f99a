"""Runs never lose work, part 5 (issue 60, output directories): every command keeps the previous run until the new
one has results of its own (H1, H2), a resume touches only what its records list (H3, H4), the adapter's base model is
an input (H5), an edited file is the user's (H6), splits are splits (H9) and an empty or cut SFT file is one line
(H11). Every case runs the real CLI (`mempo_trl.cli.main` in process, or `python -m mempo_trl`); previous runs are
written by hand and recorded as a run records them (`record_as_run`) wherever a real one is not needed.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fake_openai import FakeOpenAI
from helpers import cpu_recipe, one_error_line, record_as_run

from mempo_trl.cli import main
from mempo_trl.data import read_jsonl
from mempo_trl.outputs import PREVIOUS_RUN
from mempo_trl.protocol import TurnProtocol


SRC = str(Path(__file__).resolve().parents[1] / "src")  # this checkout's code, whatever is installed


def tree(directory: Path) -> dict[str, bytes | None]:
    """Every path under `directory` (links not followed) with its bytes (None for a directory or a link)."""
    return {
        str(p.relative_to(directory)): None if p.is_dir() or p.is_symlink() else p.read_bytes()
        for p in sorted(directory.rglob("*"))
    }


def previous_run(directory: Path, *names: str) -> dict[str, bytes | None]:
    """`directory` holding a previous run's `names` (a file each, `name/` a folder with one file) and the user's
    notes.txt, recorded as that run records them; returns its `tree`."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        if name.endswith("/"):
            (directory / name).mkdir()
            (directory / name / "part.json").write_text(f'{{"previous": "{name}"}}')
        else:
            (directory / name).write_text(f"previous run's {name}")
    record_as_run(directory, *(name.rstrip("/") for name in names))
    (directory / "notes.txt").write_text("mine")
    return tree(directory)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model_dir):
    """A finished one-step run saving a checkpoint every step (`checkpoint-1` and the model), and its recipe."""
    base = tmp_path_factory.mktemp("finished")
    recipe = cpu_recipe(base, tiny_model_dir, save_strategy="steps", save_steps=1, logging_steps=1, max_steps=1)
    assert main(["train", "--config", str(recipe)]) == 0
    return base / "out", recipe


# ------------------------------------------------------------------------------------------ H1: every command


def test_h1_sft_overwrite_keeps_the_previous_model_when_its_data_has_a_cut_line(tmp_path, capsys, tiny_model_dir):
    """H1 (sft) and H11 (a cut last line): one line naming the line, the previous SFT model as it was."""
    out = tmp_path / "good"
    before = previous_run(out, "model.safetensors", "config.json", "mempo_agent.json", "checkpoint-3/")
    data = tmp_path / "b"
    data.mkdir()
    TurnProtocol().save(data)
    row = {"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}]}
    (data / "train.jsonl").write_text(json.dumps(row) + "\n" + '{"prompt": [{"role":"user","content":"x"}], "comp')
    argv = ["sft", "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(data), "--output_dir", str(out)]
    argv += ["--max_steps", "1", "--use_cpu", "true", "--report_to", "none", "--overwrite_output_dir", "true"]
    assert main(argv) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: {data / 'train.jsonl'}, line 2: invalid JSON (") and line.endswith(
        "fix or delete this line."
    ), line
    assert tree(out) == before


def test_h11_sft_on_an_empty_distill_output_is_one_line(tmp_path, capsys, tiny_model_dir):
    data = tmp_path / "e"
    data.mkdir()
    TurnProtocol().save(data)
    (data / "train.jsonl").write_text("")
    argv = ["sft", "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(data)]
    assert main([*argv, "--output_dir", str(tmp_path / "out"), "--use_cpu", "true", "--report_to", "none"]) == 2
    assert one_error_line(capsys) == (
        f"error: {data / 'train.jsonl'} holds no rows: distill kept no episode (see distill_report.json)."
    )
    assert not (tmp_path / "out").exists()


def test_h1_distill_overwrite_keeps_the_paid_distillation_when_the_dataset_is_a_typo(
    tmp_path, capsys, tiny_model_dir, demo_paths
):
    out = tmp_path / "dk4"
    names = ("distill_report.json", "distill_settings.json", "episodes.jsonl", "requests.jsonl", "train.jsonl")
    before = previous_run(out, "mempo_agent.json", *names)
    rows = read_jsonl(demo_paths.test)[:2]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    teacher = FakeOpenAI({row["question"]: row["golden_answers"][0] for row in rows})
    argv = ["distill", "--model_name_or_path", str(tiny_model_dir), "--corpus", str(demo_paths.corpus)]
    argv += ["--openai_base_url", teacher.url, "--openai_model", "teacher", "--output_dir", str(out)]
    argv += ["--overwrite_output_dir", "true", "--dataset_name"]
    try:
        assert main([*argv, str(tmp_path / "nosuch.jsonl")]) == 2
        assert one_error_line(capsys) == f"error: {tmp_path / 'nosuch.jsonl'}: file not found."
        assert tree(out) == before and not teacher.requests
        # The right file: the previous distillation goes once the first group of episodes is saved.
        assert main([*argv, str(tmp_path / "qa.jsonl")]) == 0
    finally:
        teacher.close()
    printed = capsys.readouterr().out
    removed = f"--overwrite_output_dir: removed the previous run's {', '.join(sorted(['mempo_agent.json', *names]))}"
    assert printed.index(removed) < printed.index("distill: 2/2 rows played")
    assert [row["id"] for row in read_jsonl(out / "episodes.jsonl")] == [row["id"] for row in rows]
    assert (out / "notes.txt").read_text() == "mine" and not (out / PREVIOUS_RUN).exists()


def test_h1_compose_overwrite_keeps_the_previous_rows_until_new_ones_are_written(tmp_path, capsys, demo_paths):
    out = tmp_path / "o_full"
    before = previous_run(out, "compose.json", "k2/")
    argv = ["compose", "--output_dir", str(out), "--objectives", "2", "--overwrite_output_dir", "true"]
    assert main([*argv, "--dataset_name", str(tmp_path / "nosuch.jsonl")]) == 2
    assert one_error_line(capsys) == f"error: {tmp_path / 'nosuch.jsonl'}: file not found."
    assert tree(out) == before
    # Good input: the previous rows go once the new ones are written, and notes.txt stays.
    assert main([*argv, "--dataset_name", str(demo_paths.train)]) == 0
    printed = capsys.readouterr().out
    assert f"--overwrite_output_dir: removed the previous run's compose.json, k2 from {out}" in printed
    assert (out / "notes.txt").read_text() == "mine" and not (out / PREVIOUS_RUN).exists()
    assert (out / "k2" / "train.jsonl").is_file() and not (out / "k2" / "part.json").exists()


def test_h1_merge_lora_overwrite_keeps_the_merged_model_when_the_adapter_is_damaged(tmp_path, capsys):
    out = tmp_path / "m_ck1"
    before = previous_run(out, "README.md", "config.json", "model.safetensors")
    adapter = tmp_path / "lemp"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": "some/hub-model"}')
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    argv = ["merge-lora", "--model_name_or_path", str(adapter), "--output_dir", str(out), "--overwrite_output_dir"]
    assert main(argv) == 2
    assert one_error_line(capsys).startswith(
        f"error: {adapter / 'adapter_model.safetensors'} is truncated (0 bytes, shorter than its header)"
    )
    assert tree(out) == before


# ------------------------------------------------------------------------------------------ H2: train until step 1


def test_h2_train_overwrite_keeps_the_previous_run_when_step_1_fails(tmp_path, capsys, tiny_model_dir, monkeypatch):
    """The retriever fails at the first rollout: no step finishes, and the previous run is back as it was."""
    from mempo_trl.retrieval import RetrieverOutage
    from mempo_trl.trainer import MemPOTrainer

    def retriever_down(self, inputs):
        raise RetrieverOutage("POST http://127.0.0.1:9/retrieve failed after 4 attempt(s) over 3.0s")

    monkeypatch.setattr(MemPOTrainer, "_play_episodes", retriever_down)
    out = tmp_path / "out"
    before = previous_run(out, "README.md", "model.safetensors", "mempo_metrics.json", "checkpoint-2/")
    recipe = cpu_recipe(tmp_path, tiny_model_dir, max_steps=2, save_strategy="steps", save_steps=1)
    assert main(["train", "--config", str(recipe), "--overwrite_output_dir", "true"]) == 2
    assert one_error_line(capsys).startswith("error: training stopped: POST http://127.0.0.1:9/retrieve failed after ")
    assert tree(out) == before


def test_h2_a_run_killed_before_its_first_checkpoint_gives_the_previous_run_back(tmp_path, capsys, tiny_model_dir):
    """`kill -9` cannot be caught: the next run into the directory puts the previous run back, then decides."""
    out = tmp_path / "out"
    before = previous_run(out, "README.md", "model.safetensors", "checkpoint-2/")
    recipe = cpu_recipe(tmp_path, tiny_model_dir, max_steps=500, save_strategy="no", logging_steps=1)
    process = subprocess.Popen(
        [sys.executable, "-m", "mempo_trl", "train", "--config", str(recipe), "--overwrite_output_dir", "true"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True).start()
    try:
        deadline = time.monotonic() + 300
        while not any("aside in" in line for line in lines):
            assert process.poll() is None and time.monotonic() < deadline, "".join(lines)[-4000:]
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    assert not (out / "model.safetensors").exists() and (out / PREVIOUS_RUN / "model.safetensors").is_file()
    assert main(["train", "--config", str(recipe)]) == 2
    printed = capsys.readouterr()
    assert f"put the previous run's README.md, checkpoint-2, model.safetensors back in {out}" in printed.out
    assert printed.err.strip().startswith(f"error: output directory {out} already holds results (README.md, ")
    after = tree(out)
    assert after.pop("_mempo_run_going.json") is not None  # the killed run's note, as after any kill
    assert after == before


# ------------------------------------------------------------------------------------------ H3, H4: resumes


def test_h3_a_resume_never_writes_through_a_linked_checkpoint(tmp_path, capsys, finished):
    run, recipe = finished
    out, outside = Path(shutil.copytree(run, tmp_path / "runH")), tmp_path / "outside"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(b"user weights")
    (outside / "config.json").write_text('{"mine": true}')
    (out / "checkpoint-2").symlink_to("../outside")
    before, user = tree(out), tree(outside)
    argv = ["train", "--config", str(recipe), "--output_dir", str(out), "--max_steps", "2"]
    assert main([*argv, "--resume_from_checkpoint", "true"]) == 2
    assert one_error_line(capsys) == (
        f"error: output directory {out} holds checkpoint-2 (a link to ../outside): a run writes only plain files and "
        "folders inside its output directory, never through a link. Remove the link (what it points to is kept) or "
        "choose another output directory."
    )
    assert tree(out) == before and tree(outside) == user


def test_h4_a_resume_never_deletes_a_checkpoint_no_run_recorded(tmp_path, capsys, finished):
    run, recipe = finished
    out = Path(shutil.copytree(run, tmp_path / "runI"))
    (out / "checkpoint-9").mkdir()
    (out / "checkpoint-9" / "notes.txt").write_text("my notes")
    before = tree(out)
    argv = ["train", "--config", str(recipe), "--output_dir", str(out), "--max_steps", "2"]
    assert main([*argv, "--resume_from_checkpoint", str(out / "checkpoint-1")]) == 2
    assert one_error_line(capsys) == (
        f"error: output directory {out} holds checkpoint-9, which no mempo-trl run recorded and a run would "
        "overwrite. Move them away or choose another output directory."
    )
    assert tree(out) == before


def test_r_a_a_resume_never_rewrites_a_hard_linked_snapshot(tmp_path, capsys, finished):
    """R-a: `cp -al run snapshot`, then resume the run: the snapshot keeps every byte."""
    run, recipe = finished
    out, snapshot = Path(shutil.copytree(run, tmp_path / "runH")), tmp_path / "snapshot"
    shutil.copytree(out, snapshot, copy_function=os.link)
    before = tree(snapshot)
    argv = ["train", "--config", str(recipe), "--output_dir", str(out), "--max_steps", "2"]
    assert main([*argv, "--resume_from_checkpoint", "true"]) == 0
    assert "step 2/2" in capsys.readouterr().out and (out / "checkpoint-2").is_dir()
    assert tree(snapshot) == before


# ------------------------------------------------------------------------------------------ H5, H6


def test_h5_merge_lora_refuses_an_output_dir_holding_the_adapters_base_model(tmp_path, capsys, tiny_model_dir):
    kit = tmp_path / "kitcopy"
    kit.mkdir()
    shutil.copytree(tiny_model_dir, kit / "model")
    (kit / "world").mkdir()
    (kit / "world" / "corpus.jsonl").write_text('{"id": "1", "contents": "x"}\n')
    record_as_run(kit, "model", "world")
    adapter = tmp_path / "lora_kc"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(kit / "model")}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    before = tree(kit)
    for output in (kit, kit / "model", kit / "model" / "merged"):
        argv = ["merge-lora", "--model_name_or_path", str(adapter), "--output_dir", str(output)]
        assert main([*argv, "--overwrite_output_dir", "true"]) == 2
        relation = "contains" if output == kit else "is" if output == kit / "model" else "lies inside"
        assert one_error_line(capsys) == (
            f"error: output directory {output} {relation} the adapter's base model {kit / 'model'}: results and "
            "inputs would mix. Choose another output directory."
        )
    assert tree(kit) == before


def test_h6_a_file_edited_in_place_keeping_its_size_is_the_users(tmp_path, capsys, demo_paths):
    out = tmp_path / "o"
    previous_run(out, "README.md", "compose.json")
    card = (out / "README.md").read_text()
    (out / "README.md").write_text(card.replace("p", "P", 1))  # same size, another text
    argv = ["compose", "--output_dir", str(out), "--objectives", "2", "--dataset_name", str(demo_paths.train)]
    assert main([*argv, "--overwrite_output_dir", "true"]) == 2
    assert one_error_line(capsys) == (
        f"error: output directory {out} holds README.md, which no mempo-trl run recorded and a run would overwrite. "
        "Move them away or choose another output directory."
    )
    assert (out / "README.md").read_text() == card.replace("p", "P", 1)


# ------------------------------------------------------------------------------------------ H9: splits


def test_h9_compose_refuses_splits_of_a_source_without_splits(tmp_path, capsys, demo_paths):
    argv = ["compose", "--output_dir", str(tmp_path / "k"), "--objectives", "2", "--dataset_split", "train", "test"]
    assert main([*argv, "--dataset_name", str(demo_paths.train)]) == 2
    assert one_error_line(capsys) == (
        f"error: {demo_paths.train} is one file, which has no splits: --dataset_split train test would compose its "
        "rows 2 times. Pass a directory holding train.jsonl and test.jsonl (FlashRAG-style), or compose each split "
        "from a file of its own."
    )
    same = tmp_path / "same"
    same.mkdir()
    shutil.copy(demo_paths.train, same / "train.jsonl")
    shutil.copy(demo_paths.train, same / "test.jsonl")
    assert main([*argv, "--dataset_name", str(same)]) == 2
    rows = sum(1 for line in demo_paths.train.read_text().splitlines() if line.strip())
    assert one_error_line(capsys) == (
        f"error: {same}: splits train and test hold the same {rows} rows, so one would test on the other's "
        "questions. Pass sources whose splits differ."
    )
    assert not (tmp_path / "k").exists()
