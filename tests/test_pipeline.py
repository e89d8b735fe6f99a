"""The paper's pipeline on a user's data, end to end through the CLI (README "Your data, the paper's pipeline"):
compose -> distill (the kit learner as teacher) -> sft (SmolLM2-135M-Instruct as the student, LoRA) -> merge-lora ->
train (one MemPO step) -> eval --objectives, at its smallest (slow: SmolLM2 is converted once, ~1.5 min)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mempo_trl.data import read_jsonl
from mempo_trl.protocol import TurnProtocol


@pytest.mark.slow
def test_compose_distill_sft_train_and_sweep_with_smollm2_as_the_student(tmp_path):
    """Through the GPU script's CPU dry run (`scripts/gpu_long_horizon.sh pipeline-dry-run`), which a lent GPU runs as
    `pipeline` at a larger size; every step is the CLI's, and the results are collected as the GPU call collects
    them."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_long_horizon.sh"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        ["bash", str(script), "pipeline-dry-run", str(tmp_path)], capture_output=True, text=True, env=env, timeout=1800
    )
    assert done.returncode == 0 and "pipeline: exit" not in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "collected").iterdir()) == [
        "distill_report.json",
        "mempo_metrics.json",
        "objectives.json",
        "objectives.png",
    ]
    world = tmp_path / "learner" / "world"
    assert world.is_dir()
    rows = read_jsonl(tmp_path / "composed" / "k2" / "train.jsonl")
    assert len(rows) == 6 and all(len(r["sub_answers"]) == 2 for r in rows)
    report = json.loads((tmp_path / "distilled" / "distill_report.json").read_text())
    assert report["played"] == 12 and report["rows"] > 0
    assert TurnProtocol.from_pretrained(tmp_path / "student") == TurnProtocol.from_pretrained(tmp_path / "distilled")
    assert "memory/scored_rounds" in json.loads((tmp_path / "rl" / "mempo_metrics.json").read_text())
    table = json.loads((tmp_path / "sweep" / "objectives.json").read_text())["table"]
    assert {(r["objectives"], r["context_mode"]) for r in table} == {
        (k, mode) for k in (1, 2) for mode in ("memory", "full_history")
    }
    assert (tmp_path / "sweep" / "objectives.png").is_file()


def test_the_pipeline_script_never_deletes_a_folder_it_did_not_write(tmp_path):
    """A DIR holding a folder named like one of the steps that the script did not start is refused in one line, and
    the folder is left as it was (a step the script started and a limit cut is started again from scratch)."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_long_horizon.sh"
    mine = tmp_path / "learner" / "mine.txt"
    mine.parent.mkdir()
    mine.write_text("keep me")
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(script), "pipeline-dry-run", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert "pipeline: exit 2" in done.stdout, done.stdout + done.stderr
    assert f"error: {tmp_path}/learner exists and was not written by this script" in done.stderr
    assert mine.read_text() == "keep me"
