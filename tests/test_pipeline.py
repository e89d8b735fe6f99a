"""The paper's pipeline on a user's data, end to end through the CLI (README "Your data, the paper's pipeline"):
compose -> distill (the kit learner as teacher) -> sft (SmolLM2-135M-Instruct as the student, LoRA) -> merge-lora ->
train (one MemPO step) -> eval --objectives, at its smallest (slow: SmolLM2 is converted once, ~1.5 min)."""

import json
import os
import subprocess
import sys

import pytest

from mempo_trl.data import read_jsonl
from mempo_trl.protocol import TurnProtocol


def _mempo(*args: str, cwd, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, "-m", "mempo_trl", *args], capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env
    )
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-3000:])
    return done


@pytest.mark.slow
def test_compose_distill_sft_train_and_sweep_with_smollm2_as_the_student(tmp_path):
    world = tmp_path / "learner" / "world"
    _mempo("kit", "learner", "--output_dir", "learner", cwd=tmp_path)
    _mempo(
        "compose",
        "--dataset_name",
        str(world / "warm.jsonl"),
        "--objectives",
        "1",
        "2",
        "--max_rows",
        "6",
        "--output_dir",
        "composed",
        cwd=tmp_path,
    )
    rows = read_jsonl(tmp_path / "composed" / "k2" / "train.jsonl")
    assert len(rows) == 6 and all(len(r["sub_answers"]) == 2 for r in rows)
    (tmp_path / "warm.jsonl").write_text(
        "".join(
            json.dumps(r) + "\n" for k in (1, 2) for r in read_jsonl(tmp_path / "composed" / f"k{k}" / "train.jsonl")
        )
    )
    _mempo(
        "distill",
        "--model_name_or_path",
        "learner/model",
        "--dataset_name",
        "warm.jsonl",
        "--corpus",
        str(world / "corpus.jsonl"),
        "--output_dir",
        "distilled",
        "--keep",
        "format_valid",
        cwd=tmp_path,
    )
    report = json.loads((tmp_path / "distilled" / "distill_report.json").read_text())
    assert report["played"] == 12 and report["rows"] > 0

    _mempo("kit", "smollm2", "--output_dir", "smollm2", cwd=tmp_path)
    _mempo(
        "sft",
        "--model_name_or_path",
        "smollm2",
        "--dataset_name",
        "distilled",
        "--output_dir",
        "student",
        "--max_steps",
        "1",
        "--per_device_train_batch_size",
        "2",
        "--use_peft",
        "--lora_r",
        "4",
        "--lora_target_modules",
        "q_proj",
        "v_proj",
        "--use_cpu",
        "true",
        "--bf16",
        "false",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        cwd=tmp_path,
    )
    assert TurnProtocol.from_pretrained(tmp_path / "student") == TurnProtocol.from_pretrained(tmp_path / "distilled")
    _mempo("merge-lora", "--model_name_or_path", "student", "--output_dir", "student_merged", cwd=tmp_path)
    _mempo(
        "train",
        "--model_name_or_path",
        "student_merged",
        "--dataset_name",
        "composed/k2",
        "--corpus",
        str(world / "corpus.jsonl"),
        "--output_dir",
        "rl",
        "--max_steps",
        "1",
        "--num_generations",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--max_completion_length",
        "32",
        "--max_turns",
        "2",
        "--use_peft",
        "true",
        "--lora_r",
        "4",
        "--use_cpu",
        "true",
        "--bf16",
        "false",
        "--report_to",
        "none",
        "--heldout_questions",
        "0",
        "--save_strategy",
        "no",
        cwd=tmp_path,
    )
    assert "memory/scored_rounds" in json.loads((tmp_path / "rl" / "mempo_metrics.json").read_text())
    _mempo(
        "eval",
        "--model_name_or_path",
        "student_merged",
        "--dataset_name",
        str(world / "test.jsonl"),
        "--dataset_split",
        "test",
        "--corpus",
        str(world / "corpus.jsonl"),
        "--objectives",
        "1",
        "2",
        "--max_eval_samples",
        "2",
        "--max_completion_length",
        "32",
        "--context_mode",
        "both",
        "--output_dir",
        "sweep",
        "--disable_tqdm",
        "true",
        cwd=tmp_path,
    )
    table = json.loads((tmp_path / "sweep" / "objectives.json").read_text())["table"]
    assert {(r["objectives"], r["context_mode"]) for r in table} == {
        (k, mode) for k in (1, 2) for mode in ("memory", "full_history")
    }
    assert (tmp_path / "sweep" / "objectives.png").is_file()
