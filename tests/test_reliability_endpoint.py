"""Runs never lose work, part 5: the OpenAI-compatible endpoint client (`mempo_trl.endpoint`, behind `distill`, `eval`
and `ask`) is bounded and says what went wrong, against a real local server (`fake_openai`) that misbehaves: a
trickled answer ends at the attempt's deadline or the request's, an endless one at the size cap, an echoed API key is
masked, a `content: null` reply is named and not cached, a redirect names its target and a `Retry-After` beyond the
budget is reported as such (issue 60, cases H7, H8, H10, H13, H15 of the round-6 probe)."""

import json

import pytest
from fake_openai import REDIRECT_TARGET, FakeOpenAI
from helpers import one_error_line

from mempo_trl.cli import main
from mempo_trl.endpoint import EndpointError, OpenAIChatGenerator
from mempo_trl.protocol import TurnProtocol


SECRET = "sk-test-never-shown-0123"
QUESTION = "Where was Alice born?"
MESSAGES = TurnProtocol().initial_messages(QUESTION)


class Tokenizer:
    eos_token_id = 0


@pytest.fixture
def server():
    fake = FakeOpenAI({QUESTION: "Ulm"})
    yield fake
    fake.close()


def generator(server: FakeOpenAI, **settings) -> OpenAIChatGenerator:
    return OpenAIChatGenerator(server.url, "teacher", Tokenizer(), api_key=SECRET, backoff=0.01, **settings)


@pytest.mark.parametrize(
    ("settings", "within"),
    [
        ({"timeout": 1.0, "max_retries": 0}, "1s (--openai_timeout)"),
        ({"timeout": 60.0, "total_timeout": 1.5, "max_retries": 3}, "the 1.5s of --openai_total_timeout"),
    ],
)
def test_a_trickled_answer_ends_at_the_deadline_of_its_attempt_or_request(server, settings, within):
    """H7: one byte every 0.1 s keeps each read under `timeout`; the deadline covers the whole answer (the body's
    ~300 bytes would take 30 s), and `total_timeout` bounds the attempt too."""
    server.faults.append("trickle")
    with pytest.raises(EndpointError) as error:
        generator(server, **settings).complete(MESSAGES)
    assert str(error.value).startswith(f"POST {server.url}/chat/completions failed after 1 attempt(s)")
    assert f"the endpoint did not send its whole answer within {within}." in str(error.value)
    assert len(server.requests) == 1


@pytest.mark.parametrize("announced", [False, True])
def test_an_answer_over_the_size_cap_is_not_read(server, announced):
    """H8: an endless 200 body is read up to the cap (1 MiB here), then refused in one error; one announced larger
    than the cap (`Content-Length`) is refused before its body is read."""
    server.faults.append("huge")
    cap = 2**20
    if announced:
        server.faults[-1] = "trickle"  # a 300-byte answer, announced: over a cap of 100 bytes
        cap = 100
    with pytest.raises(EndpointError) as error:
        generator(server, timeout=30.0, max_response_bytes=cap).complete(MESSAGES)
    what = "announced" if announced else f"sent more than {cap} bytes"
    assert str(error.value).startswith(f"POST {server.url}/chat/completions {what}")
    assert f"over the client's cap of {cap} bytes" in str(error.value)
    assert len(server.requests) == 1  # not retried


def test_an_api_key_echoed_by_the_server_is_masked(server):
    """H10: a gateway echoing the request's headers in its error body."""
    server.faults.append("echo_auth")
    with pytest.raises(EndpointError) as error:
        generator(server).complete(MESSAGES)
    assert server.headers[0]["authorization"] == f"Bearer {SECRET}"  # it was sent
    assert SECRET not in str(error.value)
    assert 'answered HTTP 400: \'{"error": "bad request", "you_sent": "Bearer ***"}\'' in str(error.value)


def test_an_echoed_api_key_is_masked_in_evals_error_line(
    server, demo_paths, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """H10 through the CLI: the key from the environment, the error line of `eval`."""
    monkeypatch.setenv("MEMPO_OPENAI_API_KEY", SECRET)
    monkeypatch.setenv("MEMPO_CACHE", str(tmp_path / "cache"))
    server.faults.append("echo_auth")
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"id": "q1", "question": QUESTION, "golden_answers": ["Ulm"]}) + "\n")
    args = ["--model_name_or_path", str(tiny_model_dir), "--corpus", str(demo_paths.corpus), "--dataset_name"]
    args += [str(data), "--output_dir", str(tmp_path / "out"), "--disable_tqdm", "true"]
    args += ["--openai_base_url", server.url, "--openai_model", "teacher", "--max_turns", "1"]
    assert main(["eval", *args]) == 2
    line = one_error_line(capsys)
    assert SECRET not in line and "Bearer ***" in line and "answered HTTP 400" in line


def test_a_reply_without_text_is_named_and_not_cached(server, tmp_path):
    """H13: `content: null` (a tool call; reasoning servers answer so when all text went to `reasoning_content`) is
    an error naming it, and the request stays out of the cache: a rerun against a fixed server asks again."""
    cache = tmp_path / "requests.jsonl"
    server.faults.append("null_content")
    with pytest.raises(EndpointError) as error:
        generator(server, cache_path=cache).complete(MESSAGES)
    assert str(error.value).startswith(
        f"POST {server.url}/chat/completions answered 200 with content: null: the endpoint sent no text: tool-call "
        "or reasoning reply (tool_calls set); nothing was cached."
    )
    assert not cache.exists() or cache.read_text() == ""
    text, finished = generator(server, cache_path=cache).complete(MESSAGES)
    assert text.endswith("</search>") and finished and len(server.requests) == 2
    assert len(cache.read_text().splitlines()) == 1


def test_distill_stops_on_a_reply_without_text_and_its_rerun_asks_again(
    server, demo_paths, tiny_model_dir, tmp_path, capsys
):
    """H13 through the CLI: `distill` used to keep 0 episodes ("format_invalid"), exit 0 and cache the empty answers,
    so its rerun never asked again."""
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"id": "q1", "question": QUESTION, "golden_answers": ["Ulm"]}) + "\n")
    out = tmp_path / "distilled"
    args = ["distill", "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(data), "--corpus"]
    args += [str(demo_paths.corpus), "--output_dir", str(out), "--openai_base_url", server.url]
    args += ["--openai_model", "teacher", "--max_turns", "2"]
    server.faults.append("null_content")
    assert main(args) == 2
    assert "answered 200 with content: null: the endpoint sent no text" in one_error_line(capsys)
    assert not (out / "requests.jsonl").exists() or (out / "requests.jsonl").read_text() == ""
    assert main(args) == 0
    assert len(server.requests) == 3  # the null reply, then the search and the answer
    assert len((out / "requests.jsonl").read_text().splitlines()) == 2


def test_a_redirect_names_its_target(server):
    """H15: a 307 is not followed (it would send the key elsewhere) and not blamed on --openai_model."""
    server.faults.append("redirect")
    with pytest.raises(EndpointError) as error:
        generator(server).complete(MESSAGES)
    assert str(error.value) == (
        f"POST {server.url}/chat/completions answered HTTP 307, a redirect to {REDIRECT_TARGET!r}; redirects are not "
        "followed. Point --openai_base_url at the server itself."
    )


def test_a_retry_after_beyond_the_budget_is_reported_with_its_value(server):
    """H15: a 429 asking for an hour ends at once (no retry, no sleep), naming the hour and the budget."""
    server.faults.append("429")
    server.retry_after = "3600"
    with pytest.raises(EndpointError) as error:
        generator(server).complete(MESSAGES)
    message = str(error.value)
    assert message.startswith(f"POST {server.url}/chat/completions failed after 1 attempt(s)")
    assert "It asked to be retried after 3600s, beyond what is left of --openai_total_timeout (900s, " in message
    assert "raise --openai_timeout" not in message
    assert len(server.requests) == 1
