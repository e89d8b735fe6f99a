"""The agent travels with its turn protocol: the trainer saves it, `MemPOAgent`, `eval` and `ask` read it."""

import doctest
import json
import logging
from dataclasses import fields

import pytest
from datasets import Dataset
from helpers import EchoRetriever

import mempo_trl.agent as agent_module
import mempo_trl.context as context_module
from mempo_trl import MemPOConfig, MemPOTrainer
from mempo_trl.agent import MemPOAgent
from mempo_trl.cli import main
from mempo_trl.kit.demo_world import demo_paths
from mempo_trl.kit.tiny import load_tiny
from mempo_trl.protocol import PROTOCOL_FILE, TurnProtocol


CUSTOM = dict(
    system_prompt="You are Orbix-bot.",
    instruction="Use the tags. Q: {question}",
    max_turns=1,
    retrieval_topk=2,
    context_mode="full_history",
    max_completion_length=6,
    max_context_tokens=2000,  # a context budget the trainer saves and the agent plays by (it never binds here)
)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMPO_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def trained_dir(tiny_model_dir, tmp_path):
    """A copy of the tiny model with custom settings saved by the trainer itself (`save_model`)."""
    model, tokenizer = load_tiny(tiny_model_dir)
    args = MemPOConfig(
        output_dir=str(tmp_path / "run"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=2,
        num_generations=2,
        **CUSTOM,
    )
    dataset = Dataset.from_list([{"question": "q?", "golden_answers": ["Ulm"]}])
    trainer = MemPOTrainer(model, EchoRetriever(), args=args, train_dataset=dataset, processing_class=tokenizer)
    out = tmp_path / "agent"
    trainer.save_model(str(out))
    tokenizer.save_pretrained(out)
    return out


def test_doctests():
    assert doctest.testmod(agent_module, optionflags=doctest.ELLIPSIS).failed == 0
    assert doctest.testmod(context_module, optionflags=doctest.ELLIPSIS).failed == 0


def test_trainer_saves_the_protocol_next_to_the_weights(trained_dir):
    saved = json.loads((trained_dir / PROTOCOL_FILE).read_text())
    assert saved == {**CUSTOM, "context_overflow": "end_episode", "action": "search", "chat_template_kwargs": None}
    assert (trained_dir / "config.json").is_file()
    assert TurnProtocol.from_pretrained(trained_dir) == TurnProtocol(**CUSTOM)


def test_protocol_round_trip_and_errors(tmp_path):
    assert TurnProtocol.from_pretrained(tmp_path) is None  # a model without settings: the defaults apply
    TurnProtocol(max_turns=3).save(tmp_path)
    assert TurnProtocol.from_pretrained(tmp_path).max_turns == 3
    (tmp_path / PROTOCOL_FILE).write_text('{"context_mode": "sideways"}')
    with pytest.raises(ValueError, match=f"{PROTOCOL_FILE}.*context_mode"):
        TurnProtocol.from_pretrained(tmp_path)
    config = MemPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, max_turns=5, max_completion_length=64)
    assert (TurnProtocol.from_config(config).max_turns, TurnProtocol.from_config(config).max_completion_length) == (
        5,
        64,
    )


def test_from_pretrained_plays_the_saved_protocol(trained_dir, caplog):
    retriever = EchoRetriever()
    with caplog.at_level(logging.WARNING, logger="mempo_trl.agent"):
        agent = MemPOAgent.from_pretrained(trained_dir, retriever, device="cpu")
    assert agent.protocol == TurnProtocol(**CUSTOM) and not [r for r in caplog.records if r.name == "mempo_trl.agent"]
    result = agent.run("Who founded Orbix?")
    prompt = agent.tokenizer.decode(result.episode.rounds[0].prompt_ids)
    assert "You are Orbix-bot." in prompt and "Q: Who founded Orbix?" in prompt
    assert result.num_turns == 1 and result.turns[0]["completion_tokens"] <= 6
    assert result.total_tokens == result.turns[0]["prompt_tokens"] + result.turns[0]["completion_tokens"]
    assert result.peak_context_tokens == result.total_tokens and result.question == "Who founded Orbix?"

    batch = agent.run_batch(["Who founded Orbix?", "Where is Ulm?"])
    assert [r.question for r in batch] == ["Who founded Orbix?", "Where is Ulm?"]
    assert batch[0].turns == result.turns  # greedy: the same turn alone or in a batch


def test_explicit_arguments_override_and_say_so(trained_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="mempo_trl.agent"):
        agent = MemPOAgent.from_pretrained(trained_dir, EchoRetriever(), device="cpu", max_turns=2, retrieval_topk=2)
    assert agent.protocol.max_turns == 2 and agent.protocol.system_prompt == CUSTOM["system_prompt"]
    assert [r.getMessage() for r in caplog.records if r.name == "mempo_trl.agent"] == [
        f"max_turns=2 overrides the saved max_turns=1 ({PROTOCOL_FILE} of {trained_dir})"
    ]


def test_eval_reads_the_saved_protocol(trained_dir, tmp_path, caplog):
    out = tmp_path / "eval"
    argv = ["eval", "--model_name_or_path", str(trained_dir), "--output_dir", str(out), "--max_eval_samples", "3"]
    argv += ["--dataset_name", str(demo_paths().test), "--corpus", str(demo_paths().corpus)]
    assert main([*argv, "--disable_tqdm", "true"]) == 0
    report = json.loads((out / "results.json").read_text())
    assert (
        report["settings"]["protocol"]
        == {**CUSTOM, "context_overflow": "end_episode", "action": "search", "chat_template_kwargs": None}
        and report["settings"]["protocol_saved"]
    )
    assert report["settings"]["context_modes"] == ["full_history"]
    records = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert all(r["num_turns"] == 1 and r["rounds"][0]["completion_tokens"] <= 6 for r in records)

    with caplog.at_level(logging.WARNING, logger="mempo_trl.agent"):
        assert main([*argv, "--overwrite_output_dir", "true", "--max_turns", "2", "--context_mode", "memory"]) == 0
    assert {r.getMessage().split(" (")[0] for r in caplog.records if r.name == "mempo_trl.agent"} == {
        "max_turns=2 overrides the saved max_turns=1",
        "context_mode='memory' overrides the saved context_mode='full_history'",
    }
    assert json.loads((out / "results.json").read_text())["settings"]["context_modes"] == ["memory"]


def test_ask_prints_turns_and_answer(trained_dir, capsys):
    corpus = str(demo_paths().corpus)
    assert main(["ask", "Who founded Orbix?", "--model_name_or_path", str(trained_dir), "--corpus", corpus]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("turn 1 <mem>") and out[-2].startswith("answer: ")
    assert out[-1].startswith("1 turns, 0 searches,")


def test_ask_without_question_is_one_error_line(trained_dir, capsys):
    assert main(["ask", "--model_name_or_path", str(trained_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no question")


@pytest.mark.parametrize(
    "override, message",
    [
        (["--max_context_tokens", "0"], "error: max_context_tokens must be a positive integer (or null), got 0."),
        (["--retrieval_topk", "0"], "error: retrieval_topk must be >= 1, got 0."),
        (["--instruction", "no placeholder"], "error: instruction must contain the `{question}` placeholder."),
        (["--context_overflow", "drop"], "invalid choice: 'drop' (choose from 'end_episode', 'truncate_information')"),
    ],
)
def test_agent_overrides_follow_the_turn_protocols_rules(override, message, tmp_path, capsys):
    """`ask`/`eval` take the protocol's overrides with `TurnProtocol`'s choices and checks, before loading anything."""
    code = main(["ask", "q?", "--model_name_or_path", str(tmp_path / "missing"), *override])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], lines


def test_agent_override_help_is_the_protocols(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for name in ("max_turns", "context_overflow", "max_context_tokens"):
        declared = next(f for f in fields(TurnProtocol) if f.name == name).metadata["help"]
        assert f"{declared} (default: the saved value)" in help_text, name


def test_an_agent_shuts_its_generators_engine_down_at_the_end_of_a_with_block(tiny_model_dir):
    """A generator with an engine of its own (`VLLMGenerator`) is closed at the end of the block; one without
    ``close`` (`HFGenerator`) is left alone."""
    closed = []

    class EngineGenerator:
        def __call__(self, prompts):
            return [[] for _ in prompts], None

        def close(self):
            closed.append(True)

    tokenizer = load_tiny(tiny_model_dir)[1]
    with MemPOAgent(tokenizer, EchoRetriever(), EngineGenerator()):
        assert closed == []
    assert closed == [True]
    with MemPOAgent(tokenizer, EchoRetriever(), lambda prompts: ([[] for _ in prompts], None)):
        pass
    assert closed == [True]
