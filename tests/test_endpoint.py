"""The OpenAI-compatible endpoint backend (`mempo_trl.endpoint`) against our fake server (`fake_openai`): the same
contexts as training, the stripped closing tag put back, retries and one `error:` line, through `eval` and `ask`."""

import doctest
import json

import pytest
from fake_openai import FakeOpenAI
from helpers import one_error_line

import mempo_trl.endpoint as endpoint_module
from mempo_trl.cli import main
from mempo_trl.data import read_jsonl
from mempo_trl.endpoint import EndpointError, OpenAIChatGenerator
from mempo_trl.protocol import TurnProtocol
from mempo_trl.retrieval import BM25Retriever
from mempo_trl.rollout import RolloutEngine


SECRET = "sk-test-never-shown-0123"


@pytest.fixture(autouse=True)
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MEMPO_OPENAI_API_KEY", SECRET)


@pytest.fixture
def rows(demo_paths):
    """Four demo test rows: a 2-hop, a 1-hop, a comparison and a multi-objective one."""
    found = read_jsonl(demo_paths.test)
    return [
        next(r for r in found if r["data_source"] == s)
        for s in ("demo_2hop", "demo_1hop", "demo_compare", "demo_multi")
    ]


@pytest.fixture
def server(rows):
    """The fake API answering every row right but the comparison (``"nobody"``)."""
    answers = {r["question"]: r["golden_answers"][0] for r in rows}
    answers[rows[2]["question"]] = "nobody"
    fake = FakeOpenAI(answers, delay=2.0)
    yield fake
    fake.close()


def test_doctests():
    assert doctest.testmod(endpoint_module, optionflags=doctest.ELLIPSIS).failed == 0


def test_eval_and_ask_play_an_api_model_as_memory_and_full_history_agents(
    server, rows, demo_paths, tiny_model_dir, tmp_path, capsys
):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "eval"
    args = [
        "--model_name_or_path",
        str(tiny_model_dir),
        "--corpus",
        str(demo_paths.corpus),
        "--openai_base_url",
        server.url,
        "--openai_model",
        "teacher",
    ]
    assert (
        main(
            [
                "eval",
                *args,
                "--dataset_name",
                str(data),
                "--output_dir",
                str(out),
                "--context_mode",
                "both",
                "--disable_tqdm",
                "true",
            ]
        )
        == 0
    )
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["openai_base_url"] == server.url
    for mode in ("memory", "full_history"):
        overall = results["modes"][mode]["overall"]
        assert (overall["em"], overall["format_valid"], overall["turns_per_question"]) == (0.75, 1.0, 2.0)
    assert len(server.requests) == 2 * 2 * len(rows)  # 2 rounds, 2 modes
    protocol = TurnProtocol()
    trajectories = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    for body in server.requests:
        assert body["model"] == "teacher" and body["stop"] == ["</search>", "</answer>"]
        assert body["max_tokens"] == protocol.max_completion_length and body["temperature"] == 0.0
    # Round 2's context is the one training builds: system, question, round 1's output (its stripped </search> put
    # back) and its <information>, in the role training renders it with.
    first = trajectories[0]
    round_1 = first["rounds"][0]
    assert round_1["completion"].endswith("</search>") and round_1["valid"]
    expected = protocol.round_messages(
        protocol.initial_messages(rows[0]["question"]), [(round_1["completion"], round_1["information"])]
    )
    assert expected[-1]["role"] == "tool"
    assert expected in [body["messages"] for body in server.requests]
    assert {h["authorization"] for h in server.headers} == {f"Bearer {SECRET}"}

    assert main(["ask", rows[1]["question"], *args]) == 0
    printed = capsys.readouterr()
    assert f"answer: {rows[1]['golden_answers'][0]}" in printed.out
    written = "".join(p.read_text(errors="replace") for p in out.rglob("*") if p.is_file())
    assert SECRET not in written + printed.out + printed.err


@pytest.mark.parametrize("stop_reason", [False, True], ids=["openai", "vllm"])
def test_turns_from_the_api_parse_under_the_real_tokenizers(real_tokenizer, stop_reason, rows, demo_paths):
    """The text comes back without its closing tag; tokenised with Qwen2.5's or SmolLM2's tokenizer (tags split into
    several tokens, Qwen's ``><`` merge), the rebuilt turn is the scripted turn, valid, and ends on the action."""
    fake = FakeOpenAI({r["question"]: r["golden_answers"][0] for r in rows}, stop_reason=stop_reason)
    try:
        generate = OpenAIChatGenerator(fake.url, "teacher", real_tokenizer, max_concurrency=2)
        protocol = TurnProtocol()
        engine = RolloutEngine(
            real_tokenizer,
            protocol,
            BM25Retriever.from_corpus(str(demo_paths.corpus)),
            eos_token_ids=protocol.stop_token_ids(real_tokenizer),
        )
        episodes = engine.play(rows, generate).episodes
    finally:
        fake.close()
    for row, episode in zip(rows, episodes):
        assert [r.turn.action for r in episode.rounds] == ["search", "answer"]
        assert all(r.turn.valid and not r.truncated for r in episode.rounds)
        assert (
            episode.rounds[0].text == f"<mem> Nothing yet. </mem>\n<think> I must search. </think>\n<search> "
            f"{row['question']} </search>"
        )
        assert episode.answer == row["golden_answers"][0]
        assert episode.rounds[0].prompt_ids == engine.fit_prompt(type(episode)(row, episode.base_messages))


@pytest.mark.parametrize(
    ("fault", "attempts"), [("timeout", 2), ("429", 2), ("500", 2), ("drop", 2), ("malformed", 1)]
)
def test_a_failed_request_is_retried_or_ends_in_one_error(fault, attempts, server, rows, tiny_model_dir):
    from mempo_trl.loading import load_tokenizer

    generate = OpenAIChatGenerator(server.url, "teacher", load_tokenizer(tiny_model_dir), timeout=0.5, backoff=0.01)
    messages = TurnProtocol().initial_messages(rows[0]["question"])
    server.faults.append(fault)
    if fault == "malformed":
        with pytest.raises(EndpointError, match=f"POST {server.url}/chat/completions answered 200 with no chat"):
            generate.complete(messages)
    else:
        assert generate.complete(messages)[0].endswith("</search>")
    assert len(server.requests) == attempts


def test_an_endpoint_that_keeps_failing_ends_eval_in_one_error_line(
    server, rows, demo_paths, tiny_model_dir, tmp_path, capsys
):
    server.fail_from = 1
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(rows[0]) + "\n")
    rc = main(
        [
            "eval",
            "--model_name_or_path",
            str(tiny_model_dir),
            "--corpus",
            str(demo_paths.corpus),
            "--dataset_name",
            str(data),
            "--output_dir",
            str(tmp_path / "out"),
            "--disable_tqdm",
            "true",
            "--openai_base_url",
            server.url,
            "--openai_model",
            "teacher",
            "--openai_max_retries",
            "2",
        ]
    )
    assert rc == 2
    line = one_error_line(capsys)
    assert f"POST {server.url}/chat/completions failed after 3 attempt(s)" in line and "HTTP 500" in line
    assert len(server.requests) == 3


def test_endpoint_settings_are_checked_before_any_work(tiny_model_dir, demo_paths, capsys):
    assert (
        main(
            [
                "ask",
                "q?",
                "--model_name_or_path",
                str(tiny_model_dir),
                "--corpus",
                "x.jsonl",
                "--openai_base_url",
                "http://127.0.0.1:9/v1",
            ]
        )
        == 2
    )
    assert "--openai_base_url needs --openai_model NAME" in one_error_line(capsys)
    assert (
        main(
            [
                "ask",
                "q?",
                "--model_name_or_path",
                str(tiny_model_dir),
                "--corpus",
                str(demo_paths.corpus),
                "--openai_base_url",
                "ftp://host/v1",
                "--openai_model",
                "m",
            ]
        )
        == 2
    )
    assert "must start with http:// or https://" in one_error_line(capsys)
