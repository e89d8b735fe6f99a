"""Runs never lose work, part 3: data, context limits and the retrieval server and client.

Every case goes through the real CLI (`mempo_trl.cli.main`, in process) or a real server subprocess on 127.0.0.1
spoken to with raw sockets. Each wait is bounded; nothing asserts a speed.
"""

import json

import pyarrow
import pyarrow.parquet
import pytest
from helpers import cpu_recipe, one_error_line

from mempo_trl.checkpoints import validate_checkpoint
from mempo_trl.cli import main


def write_rows(path, questions):
    """A QA .jsonl of ``questions`` (gold "Ulm" each); returns its path."""
    rows = [{"question": q, "golden_answers": ["Ulm"]} for q in questions]
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def train(tmp_path, model_dir, **fields) -> int:
    return main(["train", "--config", str(cpu_recipe(tmp_path, model_dir, **fields))])


# ------------------------------------------------------------------------------------------ data


@pytest.mark.parametrize(
    ("fields", "what"),
    [({"heldout_questions": 2}, "heldout_questions=2"), ({"eval_strategy": "steps"}, "eval_strategy=steps")],
)
def test_a_single_file_is_never_its_own_heldout_split(tmp_path, capsys, tiny_model_dir, demo_paths, fields, what):
    assert train(tmp_path, tiny_model_dir, dataset_name=str(demo_paths.train), **fields) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: {what} would evaluate on the training rows: dataset_test_split 'test' of "), line
    assert "--dataset_test_split path/test.jsonl" in line
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_an_empty_parquet_file_is_one_error_line(tmp_path, capsys, tiny_model_dir):
    empty = tmp_path / "empty.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"question": pyarrow.array([], pyarrow.string())}), empty)
    assert train(tmp_path, tiny_model_dir, dataset_name=str(empty)) == 2
    assert one_error_line(capsys) == f"error: {empty}: no rows. Give at least one question."


@pytest.mark.parametrize("question", ["\u200b\u200b", "\u3000", " \t "])
def test_a_question_without_visible_text_is_refused(tmp_path, capsys, tiny_model_dir, question):
    data = write_rows(tmp_path / "qa.jsonl", ["Where?", question])
    assert train(tmp_path, tiny_model_dir, dataset_name=str(data)) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: {data}, line 2: field 'question' must be a string with visible text"), line


# ------------------------------------------------------------------------------------------ context limits


@pytest.mark.parametrize(
    ("words", "fields", "limit"),
    [
        (5000, {}, "more than 4088 the generation backend takes (vllm_max_model_length or max_position_embeddings"),
        (400, {"max_context_tokens": 300}, "more than max_context_tokens=300: raise it"),
    ],
)
def test_a_question_too_long_for_the_context_is_refused_before_any_step(
    tmp_path, capsys, tiny_model_dir, words, fields, limit
):
    data = write_rows(tmp_path / "qa.jsonl", ["Where was Ada born?", "Where is " + "it " * words, "Who?"])
    assert train(tmp_path, tiny_model_dir, dataset_name=str(data), **fields) == 2
    line = one_error_line(capsys)
    assert line.startswith("error: train_dataset, row 2 (id '1'): the first context of question 'Where is it it"), line
    assert limit in line, line
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_an_error_mid_run_saves_a_checkpoint_first(tmp_path, capsys, tiny_model_dir, demo_paths):
    # A held-out file given as dataset_test_split is a real held-out source (accepted); the reward fails at step 2.
    fields = {"dataset_name": str(demo_paths.train), "dataset_test_split": str(demo_paths.test)}
    fields.update(heldout_questions=1, max_steps=3, reward_funcs=["helpers.reward_failing_after_step_1"])
    assert train(tmp_path, tiny_model_dir, **fields) == 2
    checkpoint = tmp_path / "out" / "checkpoint-1"
    assert one_error_line(capsys) == (
        f"error: training stopped: the reward service went away. Saved {checkpoint}; once that is fixed, rerun "
        f"with --resume_from_checkpoint {checkpoint}."
    )
    validate_checkpoint(checkpoint)


@pytest.mark.parametrize(
    ("words", "flags", "limit"),
    [
        (5000, [], "more than 4088 the generation backend takes"),
        (400, ["--max_context_tokens", "300"], "more than max_context_tokens=300: raise it"),
    ],
)
def test_eval_holds_contexts_to_the_same_limits_as_training(
    tmp_path, capsys, tiny_model_dir, demo_paths, words, flags, limit
):
    data = write_rows(tmp_path / "qa.jsonl", ["Where was Ada born?", "Where is " + "it " * words])
    argv = ["eval", "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(data), "--corpus"]
    argv += [str(demo_paths.corpus), "--output_dir", str(tmp_path / "ev"), "--max_completion_length", "8", *flags]
    assert main(argv) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: {data}, row 2 (id '1'): the first context of question 'Where is it it"), line
    assert limit in line, line
    assert not (tmp_path / "ev" / "results.json").exists()
