"""`mempo-trl distill` and `mempo-trl sft` through the real CLI: a teacher (the kit learner on transformers, or our fake
OpenAI-compatible API) played as a MemPO agent, its kept turns as TRL prompt-completion rows, a student SFT'd on them
that `ask` and `eval` run with the protocol it was trained on; a stopped distill resumes without repeating requests."""

import doctest
import json
import warnings

import pytest
from fake_openai import FakeOpenAI
from helpers import one_error_line

import mempo_trl.distill as distill_module
from mempo_trl.cli import main
from mempo_trl.data import read_jsonl
from mempo_trl.distill import keep_reason, sft_rows
from mempo_trl.endpoint import request_key
from mempo_trl.protocol import PROTOCOL_FILE, TurnProtocol
from mempo_trl.turns import parse_turn


@pytest.fixture(autouse=True)
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    """`mempo-trl kit learner`'s output: the shipped learner (``model/``) and its world (``world/``)."""
    out = tmp_path_factory.mktemp("learner")
    assert main(["kit", "learner", "--output_dir", str(out)]) == 0
    return out


def test_doctests():
    assert doctest.testmod(distill_module, optionflags=doctest.ELLIPSIS).failed == 0


def _entry(em, valid=True, overflow=False, rounds=2):
    turns = [{"messages": [{"role": "user", "content": f"c{t}"}], "completion": f"t{t}"} for t in range(rounds)]
    return {"id": f"q{em}", "format_valid": valid, "context_overflow": overflow, "em": em, "rounds": turns}


def test_the_keep_rule_by_hand():
    # A 3-part row with 2 parts right has em 2/3: dropped by default, kept from min_share 0.6; a wrong answer stays
    # out whatever the share, an invalid or overflowed episode too, and format_valid keeps every valid one.
    assert keep_reason(_entry(1.0)) == "kept"
    assert keep_reason(_entry(2 / 3)) == "wrong_answer"
    assert keep_reason(_entry(0.5), min_share=0.5) == "kept"
    assert keep_reason(_entry(2 / 3), min_share=0.6) == "kept"
    assert keep_reason(_entry(0.0), min_share=0.6) == "wrong_answer"
    assert keep_reason(_entry(1.0, valid=False)) == "format_invalid"
    assert keep_reason(_entry(1.0, valid=False, overflow=True)) == "context_overflow"
    assert keep_reason(_entry(0.0), keep="format_valid") == "kept"
    assert keep_reason(_entry(None)) == "no_gold"
    rows = sft_rows([_entry(1.0, rounds=3), _entry(0.5), _entry(2 / 3)], min_share=0.6)
    assert [(r["id"], r["round"], r["completion"][0]["content"]) for r in rows] == [
        ("q1.0", 1, "t0"),
        ("q1.0", 2, "t1"),
        ("q1.0", 3, "t2"),
        (f"q{2 / 3}", 1, "t0"),
        (f"q{2 / 3}", 2, "t1"),
    ]


def test_distill_with_an_hf_teacher_then_sft_then_ask_and_eval_read_the_student(learner, tmp_path, capsys):
    world, out = learner / "world", tmp_path / "distilled"
    args = [
        "distill",
        "--model_name_or_path",
        str(learner / "model"),
        "--dataset_name",
        str(world / "warm.jsonl"),
        "--corpus",
        str(world / "corpus.jsonl"),
        "--output_dir",
        str(out),
        "--save_every",
        "8",
    ]
    assert main([*args, "--max_samples", "16"]) == 0
    assert main([*args, "--max_samples", "24"]) == 0  # continues: plays rows 17-24 only
    report = json.loads((out / "distill_report.json").read_text())
    assert (report["played"], report["episodes"]) == (8, 24)
    assert sum(report["by_reason"].values()) == 24 and report["kept"] == report["by_reason"]["kept"] > 0
    assert report["teacher"]["backend"] == "transformers" and report["versions"]["trl"]
    episodes = read_jsonl(out / "episodes.jsonl")
    assert [e["id"] for e in episodes] == [r["id"] for r in read_jsonl(world / "warm.jsonl")[:24]]
    kept = [e for e in episodes if e["format_valid"] and e["em"] == 1.0]
    assert len(kept) == report["kept"] and any(e["format_valid"] and e["em"] < 1.0 for e in episodes)

    # One TRL conversational prompt-completion row per round of the kept episodes, the prompt the context training
    # builds (system, question, then the previous round and its result) and the completion a valid turn.
    rows = read_jsonl(out / "train.jsonl")
    assert len(rows) == report["rows"] == sum(len(e["rounds"]) for e in kept)
    protocol = TurnProtocol.from_pretrained(out)
    assert protocol == TurnProtocol.from_pretrained(learner / "model")
    by_id = {r["id"]: r for r in read_jsonl(world / "warm.jsonl")}
    previous = None
    for row in rows:
        assert [m["role"] for m in row["completion"]] == ["assistant"]
        assert parse_turn(row["completion"][0]["content"]).valid
        base = protocol.initial_messages(by_id[row["id"]]["question"])
        if row["round"] == 1:
            assert row["prompt"] == base
        else:
            assert row["prompt"][:3] == [*base, previous["completion"][0]]
            assert row["prompt"][3]["role"] == "tool" and row["prompt"][3]["content"].startswith("<information>")
        previous = row

    # On a CPU, sft's defaults work (no --use_cpu, no --bf16 false) and print no deprecation warning.
    student = tmp_path / "student"
    sft = ["sft", "--model_name_or_path", str(learner / "model"), "--dataset_name", str(out)]
    sft += [
        "--output_dir",
        str(student),
        "--report_to",
        "none",
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main([*sft, "--save_strategy", "no"]) == 0
    assert not [w for w in caught if "checkpointing is deprecated" in str(w.message)]
    assert TurnProtocol.from_pretrained(student) == protocol
    question = read_jsonl(world / "test.jsonl")[0]["question"]
    capsys.readouterr()
    assert main(["ask", question, "--model_name_or_path", str(student), "--corpus", str(world / "corpus.jsonl")]) == 0
    assert "answer:" in capsys.readouterr().out
    assert (
        main(
            [
                "eval",
                "--model_name_or_path",
                str(student),
                "--dataset_name",
                str(world / "test.jsonl"),
                "--corpus",
                str(world / "corpus.jsonl"),
                "--output_dir",
                str(tmp_path / "eval"),
                "--max_eval_samples",
                "4",
                "--disable_tqdm",
                "true",
            ]
        )
        == 0
    )
    settings = json.loads((tmp_path / "eval" / "results.json").read_text())["settings"]
    assert settings["protocol_saved"] and TurnProtocol(**settings["protocol"]) == protocol


@pytest.fixture
def qa(demo_paths, tmp_path):
    """Six demo test rows and a fake API that answers them all right."""
    rows = read_jsonl(demo_paths.test)[:6]
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fake = FakeOpenAI({r["question"]: r["golden_answers"][0] for r in rows})
    yield path, rows, fake
    fake.close()


def _distill_api(fake, data, out, tiny_model_dir, demo_paths, *extra):
    return main(
        [
            "distill",
            "--model_name_or_path",
            str(tiny_model_dir),
            "--dataset_name",
            str(data),
            "--corpus",
            str(demo_paths.corpus),
            "--output_dir",
            str(out),
            "--openai_base_url",
            fake.url,
            "--openai_model",
            "teacher",
            "--openai_max_retries",
            "1",
            "--save_every",
            "4",
            *extra,
        ]
    )


def test_a_stopped_api_distill_resumes_without_repeating_a_request(qa, tiny_model_dir, demo_paths, tmp_path, capsys):
    data, rows, fake = qa
    out = tmp_path / "distilled"
    # A dropped connection is retried (request 1, then 2); the API breaks for good at its 11th request: group 1
    # (rows 1-4, 8 answers) is saved, and group 2 has one of its two searches answered.
    fake.faults.append("drop")
    fake.fail_from = 11
    assert _distill_api(fake, data, out, tiny_model_dir, demo_paths) == 2
    assert f"POST {fake.url}/chat/completions failed after 2 attempt(s)" in one_error_line(capsys)
    assert [e["id"] for e in read_jsonl(out / "episodes.jsonl")] == [r["id"] for r in rows[:4]]
    answered_before = len(fake.answered)
    assert answered_before == 8 + 1

    fake.fail_from = None
    assert _distill_api(fake, data, out, tiny_model_dir, demo_paths) == 0
    keys = [request_key(body) for body in fake.answered]
    assert len(keys) == len(set(keys)) == 2 * len(rows)  # every request answered once, over both runs
    report = json.loads((out / "distill_report.json").read_text())
    assert (report["played"], report["kept"], report["requests_sent"]) == (2, 6, 2 * 2 - 1)

    # A kill while episodes.jsonl was written leaves a cut last line: the rerun plays that row again, from the cache.
    lines = (out / "episodes.jsonl").read_text().splitlines()
    (out / "episodes.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:40])
    assert _distill_api(fake, data, out, tiny_model_dir, demo_paths) == 0
    assert len(fake.answered) == 2 * len(rows)
    assert json.loads((out / "distill_report.json").read_text())["played"] == 1
    assert list(distill_module.read_episodes(out / "episodes.jsonl")) == [r["id"] for r in rows]

    # The same rows as one uninterrupted run.
    fresh = FakeOpenAI(fake.answers)
    try:
        assert _distill_api(fresh, data, tmp_path / "once", tiny_model_dir, demo_paths) == 0
    finally:
        fresh.close()
    assert (tmp_path / "once" / "train.jsonl").read_text() == (out / "train.jsonl").read_text()


def test_distill_and_sft_refuse_bad_input_in_one_line(qa, tiny_model_dir, demo_paths, tmp_path, capsys):
    data, rows, fake = qa
    twice = tmp_path / "twice.jsonl"
    twice.write_text(data.read_text() + json.dumps(rows[0]) + "\n")
    assert _distill_api(fake, twice, tmp_path / "d1", tiny_model_dir, demo_paths) == 2
    assert f"rows 1 and 7 have the same id {rows[0]['id']!r}" in one_error_line(capsys)
    assert not fake.requests

    out = tmp_path / "d2"
    assert _distill_api(fake, data, out, tiny_model_dir, demo_paths, "--max_samples", "2") == 0
    assert _distill_api(fake, data, out, tiny_model_dir, demo_paths, "--temperature", "0.7") == 2
    assert "holds episodes distilled with other settings (teacher differ" in one_error_line(capsys)

    sft = [
        "sft",
        "--model_name_or_path",
        str(tiny_model_dir),
        "--output_dir",
        str(tmp_path / "s"),
        "--use_cpu",
        "true",
        "--bf16",
        "false",
        "--report_to",
        "none",
        "--max_steps",
        "1",
    ]
    assert main([*sft, "--dataset_name", str(out), "--max_length", "64"]) == 2
    assert f"{out / 'train.jsonl'}, row 1 (id {rows[0]['id']!r}):" in one_error_line(capsys)
    (out / PROTOCOL_FILE).unlink()
    assert main([*sft, "--dataset_name", str(out)]) == 2
    assert f"{out} has no {PROTOCOL_FILE}" in one_error_line(capsys)


def test_sft_trains_on_the_contexts_training_renders_and_the_turn_only(qwen_model_dir, tmp_path):
    """Under Qwen2.5's real tokenizer and chat template, TRL's tokenisation of a distilled round-2 row puts exactly
    the context `RolloutEngine` generates from (`render_prompt`) before the turn, and labels only the turn's tokens
    and the template's end of message."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from mempo_trl.context import render_prompt
    from mempo_trl.loading import load_tokenizer

    tokenizer = load_tokenizer(qwen_model_dir)
    protocol = TurnProtocol()
    turn_1 = "<mem> Nothing yet. </mem>\n<think> I must search. </think>\n<search> Orbix founder </search>"
    information = "<information>Doc 1(Title: Orbix) Orbix was founded by Ada Ulm.</information>"
    prompt = protocol.round_messages(protocol.initial_messages("Who founded Orbix?"), [(turn_1, information)])
    turn_2 = "<mem> Orbix: Ada Ulm. </mem>\n<think> I know the answer. </think>\n<answer> Ada Ulm </answer>"
    (row,) = sft_rows(
        [
            {
                "id": "q",
                "format_valid": True,
                "context_overflow": False,
                "em": 1.0,
                "rounds": [{"messages": prompt, "completion": turn_2}],
            }
        ]
    )
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", max_length=None)
    model = AutoModelForCausalLM.from_pretrained(qwen_model_dir)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list([row]), processing_class=tokenizer)
    example = trainer.train_dataset[0]
    context = render_prompt(tokenizer, prompt)
    labelled = [i for i, label in zip(example["input_ids"], example["labels"]) if label != -100]
    assert example["input_ids"][: len(context)] == context
    assert example["labels"][: len(context)] == [-100] * len(context)
    assert tokenizer.decode(labelled) == turn_2 + "<|im_end|>\n"
