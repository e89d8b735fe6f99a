"""The HotpotQA student (`lab/hotpotqa_student.py`) end to end at ``--quick`` size on the tests' HotpotQA fixture,
with a random Qwen2.5-shaped model (the real tokenizer: HotpotQA's text in any script), and the baselines' parts."""

import doctest
import json
import subprocess
import sys
from pathlib import Path

import baselines
import hotpotqa_student


FIXTURE = Path(__file__).parents[2] / "tests" / "data" / "hotpotqa"


def test_doctests():
    assert doctest.testmod(hotpotqa_student).failed == 0
    assert doctest.testmod(baselines).failed == 0


def test_quick_run_end_to_end(tmp_path, qwen_model_dir):
    out = tmp_path / "run"
    command = [sys.executable, "lab/hotpotqa_student.py", "--model", str(qwen_model_dir), "--quick"]
    command += ["--data", str(FIXTURE), "--out", str(out), "--skip", "rl"]  # the RL stage: tests/test_train_cli.py
    root = Path(__file__).parents[2]
    finished = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=1500)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    summary = json.loads((out / "hotpotqa_student.json").read_text())
    assert summary["data"]["report"]["splits"].keys() >= {"train", "dev"}
    distilled = summary["distill"]
    assert distilled["played"] == 3  # 2 questions and 1 K = 2 row
    assert distilled["kept"] >= 2 and set(distilled["by_reason"]) <= {"kept", "format_invalid"}  # a give-up: invalid
    assert summary["rl"] is None and "after_rl" not in summary["evaluations"]
    for stage in ("before_sft", "after_sft"):
        cells = {(r["objectives"], r["context_mode"]) for r in summary["evaluations"][stage]}
        assert cells == {(k, m) for k in (1, 2) for m in ("memory", "full_history")}
    assert set(summary["baselines"]) == {"no_retrieval", "one_search"}
    assert summary["baselines"]["one_search"]["searches_per_question"] == 1.0
    assert (out / "hotpotqa_student.png").stat().st_size > 0
    # a rerun finds every stage done, and a run of other settings in the same folder is refused
    again = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "[sft] done" in again.stdout
    other = subprocess.run(command + ["--eval_questions", "1"], cwd=root, capture_output=True, text=True)
    assert other.returncode == 2 and other.stderr.startswith("error:") and "other settings" in other.stderr


class _Retriever:
    def search(self, queries, topk):
        from mempo_trl.retrieval.base import Passage

        return [[Passage(id="p1", title="Paris", text="Paris is the capital of France.")] for _ in queries]


def test_one_search_shows_the_passages_and_scores_the_first_line(qwen_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen_model_dir)
    model = AutoModelForCausalLM.from_pretrained(qwen_model_dir, dtype=torch.float32)
    rows = [{"id": "q1", "question": "What is the capital of France?", "golden_answers": ["Paris"]}]
    result = baselines.run_baseline(model, tokenizer, rows, _Retriever(), topk=1, max_new_tokens=4)
    record = result["records"][0]
    assert record["passage_ids"] == ["p1"]
    messages = baselines.baseline_messages(rows[0]["question"], [_Retriever().search(["q"], 1)[0][0]])
    assert "Doc 1(Title: Paris) Paris is the capital of France." in messages[1]["content"]
    from mempo_trl.rewards import exact_match

    assert record["em"] == exact_match(record["answer"], ["Paris"])
    assert result["metrics"]["num_questions"] == 1 and result["metrics"]["searches_per_question"] == 1.0
