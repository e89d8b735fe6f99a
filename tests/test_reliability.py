"""Runs never lose work: every case goes through the real CLI or a real server subprocess (127.0.0.1 only).

Retriever client and server: outages ridden out or ended with `RetrieverOutage`, trickling and oversized answers
bounded, server limits and API key. Each loop and wait here is bounded by a timeout.
"""

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers import cpu_recipe, free_port, one_error_line, record_as_run, start_retriever, stop, write_corpus

from mempo_trl.cli import main
from mempo_trl.retrieval import HttpRetriever, RetrievalError, RetrieverOutage


# ------------------------------------------------------------------------------------------ retriever client


def test_client_rides_out_a_server_restart(tmp_path, caplog):
    port = free_port()
    server = start_retriever(tmp_path, port)
    try:
        client = HttpRetriever(
            f"http://127.0.0.1:{port}", max_retries=None, retry_budget=60, backoff=0.1, max_backoff=0.5
        )
        assert [p.id for p in client.search(["hamlet"], topk=1)[0]] == ["1"]
    finally:
        stop(server)
    restarted = []
    restart = threading.Timer(1.0, lambda: restarted.append(start_retriever(tmp_path, port)))
    restart.start()
    try:
        with caplog.at_level(logging.WARNING, logger="mempo_trl.retrieval.http_client"):
            hits = client.search(["hamlet"], topk=1)  # sent while the server is down
        assert [p.id for p in hits[0]] == ["1"]
    finally:
        restart.join(timeout=90)
        for process in restarted:
            stop(process)
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) >= 3, messages  # each failed attempt is logged ...
    assert all("refused the connection" in m and "retry budget left" in m for m in messages[:-1])
    assert "answered again after" in messages[-1]  # ... and so is the recovery


def test_client_outage_budget_exhausted_names_the_url(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    client = HttpRetriever(url, max_retries=None, retry_budget=1.0, backoff=0.1, max_backoff=0.2)
    start = time.monotonic()
    with pytest.raises(RetrieverOutage) as info:
        client.search(["hamlet"], topk=1)
    assert 1.0 <= time.monotonic() - start < 5
    assert f"POST {url}/retrieve failed after" in str(info.value) and "refused the connection" in str(info.value)


def test_client_deadline_stops_a_trickling_server(bad_server):
    url = bad_server("trickle")  # sends one byte every 0.1 s, each read well within the timeout
    client = HttpRetriever(url, timeout=1.0, max_retries=0)
    start = time.monotonic()
    with pytest.raises(RetrieverOutage) as info:
        client.search(["hamlet"], topk=1)
    assert time.monotonic() - start < 3
    assert "did not send its whole answer within 1s" in str(info.value)


@pytest.mark.parametrize(("mode", "what"), [("huge", "sent more than"), ("huge_declared", "announced 1073741824")])
def test_client_caps_the_response_size(bad_server, mode, what):
    url = bad_server(mode)
    client = HttpRetriever(url, max_response_bytes=2**20, max_retries=3, backoff=0)
    with pytest.raises(RetrievalError) as info:
        client.search(["hamlet"], topk=1)
    assert not isinstance(info.value, RetrieverOutage)  # not retried: asking again gets the same answer
    assert what in str(info.value) and "max_response_bytes=1048576" in str(info.value) and url in str(info.value)


# ------------------------------------------------------------------------------------------ retrieval server


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A server with an API key (from the environment), small body/response limits."""
    port = free_port()
    flags = ("--max_body_bytes", "2000", "--max_response_bytes", "300")
    process = start_retriever(
        tmp_path_factory.mktemp("guarded"), port, *flags, env={"MEMPO_RETRIEVER_API_KEY": "s3cret"}
    )
    yield f"http://127.0.0.1:{port}"
    stop(process)


def test_server_requires_the_api_key(guarded):
    anonymous = httpx.post(f"{guarded}/retrieve", json={"queries": ["hamlet"], "topk": 1})
    assert anonymous.status_code == 401 and "Authorization: Bearer" in anonymous.json()["error"]
    wrong = httpx.post(f"{guarded}/retrieve", json={"queries": ["x"]}, headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert httpx.get(f"{guarded}/health").json()["status"] == "ok"  # readiness probes need no key
    with HttpRetriever(guarded, api_key="s3cret") as client:
        assert [p.id for p in client.search(["hamlet"], topk=1)[0]] == ["1"]
    with HttpRetriever(guarded, api_key="nope") as client, pytest.raises(RetrievalError, match="HTTP 401.*API key"):
        client.search(["hamlet"], topk=1)


def test_server_limits_request_and_response_size(guarded):
    key = {"authorization": "Bearer s3cret"}
    big = httpx.post(f"{guarded}/retrieve", json={"queries": ["hamlet " * 400], "topk": 1}, headers=key)
    assert big.status_code == 413 and "--max_body_bytes" in big.json()["error"]
    chunked = httpx.post(f"{guarded}/retrieve", content=iter([b'{"queries": ["hamlet"]}']), headers=key)
    assert chunked.status_code == 411
    long_answer = httpx.post(f"{guarded}/retrieve", json={"queries": ["hamlet paris"] * 4, "topk": 2}, headers=key)
    assert long_answer.status_code == 422 and "--max_response_bytes" in long_answer.json()["error"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max_topk", "0"], "error: --max_topk must be an integer >= 1, got 0."),
        (["--max_queries", "-1"], "error: --max_queries must be an integer >= 1, got -1."),
        (["--port", "70000"], "error: port 70000 is out of range"),
        (["--port", "http"], "error: argument --port: invalid int value: 'http' (see `mempo-trl serve-retriever"),
    ],
)
def test_serve_retriever_checks_its_settings_at_start(tmp_path, capsys, flags, message):
    assert main(["serve-retriever", "--corpus", str(write_corpus(tmp_path)), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_serve_retriever_refuses_a_port_in_use(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert main(["serve-retriever", "--corpus", str(write_corpus(tmp_path)), "--port", port]) == 2
    assert capsys.readouterr().err == f"error: cannot listen on 127.0.0.1:{port}: it is already in use. " + (
        "Choose another --port or --host.\n"
    )


def test_serve_retriever_warns_on_a_public_address_without_a_key(tmp_path, monkeypatch, caplog):
    import uvicorn

    from mempo_trl.commands import retrieval as retrieval_cli

    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: calls.append(kwargs))
    monkeypatch.setattr(retrieval_cli, "check_port", lambda host, port: None)  # never bind a public address here
    monkeypatch.delenv("MEMPO_RETRIEVER_API_KEY", raising=False)
    corpus = str(write_corpus(tmp_path))
    monkeypatch.setenv("MEMPO_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="mempo_trl.retrieval.server"):
        assert main(["serve-retriever", "--corpus", corpus, "--host", "0.0.0.0"]) == 0
        assert main(["serve-retriever", "--corpus", corpus, "--host", "0.0.0.0", "--api_key", "k"]) == 0
        assert main(["serve-retriever", "--corpus", corpus, "--host", "127.0.0.1"]) == 0
    assert [c["host"] for c in calls] == ["0.0.0.0", "0.0.0.0", "127.0.0.1"]
    warnings = [r.getMessage() for r in caplog.records if r.name == "mempo_trl.retrieval.server"]
    assert len(warnings) == 1 and "0.0.0.0 without an API key" in warnings[0]


def test_build_index_fails_when_it_cannot_write_its_cache(tmp_path, capsys):
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache directory should be")
    assert main(["build-index", "--corpus", str(write_corpus(tmp_path)), "--retriever_cache_dir", str(blocked)]) == 2
    assert (
        capsys.readouterr().err
        == f"error: index cache {blocked} is a file, not a directory. Choose a directory path.\n"
    )


# ------------------------------------------------------------------------------------------ data and rewards


def train_settings(tmp_path: Path, model_dir: Path, **fields) -> list[str]:
    """`mempo-trl train` arguments for a 1-step CPU run of the tiny model (as a recipe file plus `fields`)."""
    return ["train", "--config", str(cpu_recipe(tmp_path, model_dir, **fields))]


@pytest.mark.parametrize(
    ("gold", "field", "problem"),
    [
        (["Ulm", "the"], "golden_answers[1]", "'the', which normalises to an empty answer"),
        (["?"], "golden_answers[0]", "'?', which normalises to an empty answer"),
        ([None], "golden_answers[0]", "must be a non-empty string, got None"),
        ([1874], "golden_answers[0]", "must be a non-empty string, got 1874"),
        ([["Ulm"]], "golden_answers[0]", "must be a non-empty string, got ['Ulm']"),
    ],
)
def test_train_rejects_bad_golds_naming_file_line_and_field(tmp_path, capsys, tiny_model_dir, gold, field, problem):
    data = tmp_path / "qa.jsonl"
    rows = [{"question": "Where?", "golden_answers": ["Ulm"]}, {"question": "Which?", "golden_answers": gold}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(train_settings(tmp_path, tiny_model_dir, dataset_name=str(data))) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: {data}, line 2: field '{field}' ") and problem in line, line


def test_reward_functions_check_their_arguments():
    from mempo_trl.rewards import mempo_format_reward, mempo_outcome_reward

    done = "<mem>m</mem><think>t</think><answer>Ulm</answer>"
    with pytest.raises(ValueError, match="golden_answers has 1 entries but there are 2 completions"):
        mempo_outcome_reward(["q", "q"], [done, done], [["Ulm"]])
    with pytest.raises(ValueError, match="format_valid has 3 entries but there are 2 completions"):
        mempo_outcome_reward(["q", "q"], [done, done], [["Ulm"], ["Ulm"]], format_valid=[True] * 3)
    with pytest.raises(ValueError, match="format_valid has 1 entries but there are 2 completions"):
        mempo_format_reward(["q", "q"], [done, done], format_valid=[True])
    with pytest.raises(TypeError, match="golden answers must be a string or a list of strings, got \\[None\\]"):
        mempo_outcome_reward(["q"], [done], [[None]])
    with pytest.raises(TypeError, match="golden answers must be .* got 1874"):
        mempo_outcome_reward(["q"], [done], [1874])
    with pytest.raises(TypeError, match="completions must be a list"):
        mempo_outcome_reward(["q"], done, [["Ulm"]])
    assert mempo_outcome_reward(["q", "q"], [done, done], [["ulm"], "Paris"]) == [1.0, 0.0]


# ------------------------------------------------------------------------------------------ outputs and CLI errors


def test_train_refuses_an_output_dir_it_cannot_write_before_any_work(tmp_path, capsys, tiny_model_dir):
    blocked = tmp_path / "out"
    blocked.write_text("a file where the output directory should be")
    assert main(train_settings(tmp_path, tiny_model_dir, output_dir=str(blocked))) == 2
    assert one_error_line(capsys) == f"error: output directory {blocked} is a file, not a directory. " + (
        "Choose a directory path."
    )
    assert main(train_settings(tmp_path, tiny_model_dir, output_dir="/proc/mempo-out")) == 2
    assert one_error_line(capsys).startswith("error: output directory /proc/mempo-out cannot be written")


def test_train_refuses_to_overwrite_earlier_results_unless_told(tmp_path, capsys, tiny_model_dir):
    out = tmp_path / "out"
    (out / "checkpoint-3").mkdir(parents=True)  # empty: not a checkpoint to resume (test_reliability_runs.py)
    (out / "model.safetensors").write_text("an earlier model")
    record_as_run(out, "checkpoint-3", "model.safetensors")
    assert main(train_settings(tmp_path, tiny_model_dir)) == 2
    assert one_error_line(capsys) == (
        f"error: output directory {out} already holds results (_mempo_outputs.json, checkpoint-3, model.safetensors). "
        "Pass --overwrite_output_dir to replace them (other files there are kept), or choose another output directory."
    )
    assert (out / "model.safetensors").read_text() == "an earlier model"
    assert main([*train_settings(tmp_path, tiny_model_dir), "--overwrite_output_dir", "true"]) == 0
    assert (out / "mempo_metrics.json").is_file() and (out / "model.safetensors").stat().st_size > 1000


@pytest.mark.parametrize(
    ("command", "flag"),
    [
        (["kit", "build-tiny-model"], "--output_dir"),
        (["kit", "build-demo"], "--output_dir"),
        (["eval", "--model_name_or_path", "MODEL", "--dataset_name", "qa.jsonl"], "--output_dir"),
        (["merge-lora", "--model_name_or_path", "MODEL"], "--output_dir"),
    ],
)
def test_every_command_checks_its_output_dir_first(tmp_path, capsys, tiny_model_dir, command, flag):
    argv = [str(tiny_model_dir) if arg == "MODEL" else arg for arg in command]
    if command[0] == "merge-lora":
        (tmp_path / "adapter").mkdir()
        (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
        argv[argv.index(str(tiny_model_dir))] = str(tmp_path / "adapter")
    blocked = tmp_path / "blocked"
    blocked.write_text("a file")
    assert main([*argv, flag, str(blocked)]) == 2
    assert one_error_line(capsys) == f"error: output directory {blocked} is a file, not a directory. " + (
        "Choose a directory path."
    )
    used = tmp_path / "used"
    used.mkdir()
    (used / "results.json").write_text("{}")
    record_as_run(used, "results.json")
    assert main([*argv, flag, str(used)]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: output directory {used} already holds results (_mempo_outputs.json, results.json)")


def test_warm_start_checks_the_model_dir_first(tmp_path, capsys):
    assert main(["kit", "warm-start", "--model_name_or_path", str(tmp_path / "none")]) == 2
    assert one_error_line(capsys).startswith(f"error: model path {tmp_path / 'none'} does not exist.")


@pytest.mark.parametrize(
    ("fields", "extra", "message"),
    [
        ({}, ["--max_steps", "ten"], "error: argument --max_steps/--max-steps: invalid int value: 'ten' (see "),
        ({"model_name_or_path": "/no/such/model"}, [], "error: model path /no/such/model does not exist."),
        ({"model_name_or_path": "CONFIG"}, [], "is a file, not a model directory"),
        ({"report_to": ["tensorboard"]}, [], "error: --report_to tensorboard needs the tensorboard package"),
        ({"resume_from_checkpoint": "/no/checkpoint-9"}, [], "error: checkpoint /no/checkpoint-9 to resume from"),
    ],
)
def test_train_cli_errors_are_one_line(tmp_path, capsys, tiny_model_dir, fields, extra, message):
    import importlib.util

    if "report_to" in fields and importlib.util.find_spec("tensorboard"):
        pytest.skip("tensorboard is installed here")
    if fields.get("model_name_or_path") == "CONFIG":
        fields = {"model_name_or_path": str(tiny_model_dir / "config.json")}
    assert main([*train_settings(tmp_path, tiny_model_dir, **fields), *extra]) == 2
    assert message in one_error_line(capsys)
    assert not (tmp_path / "out").exists()  # nothing was built or written


def test_yaml_syntax_error_is_one_line(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("max_steps: [1\noutput_dir: out\n")
    assert main(["train", "--config", str(recipe)]) == 2
    line = one_error_line(capsys)
    assert line.startswith("error: invalid YAML: while parsing a flow sequence") and str(recipe) in line


def test_unknown_subcommand_flag_is_one_line(capsys):
    assert main(["serve-retriever", "--corpus", "c.jsonl", "--max-topk-typo", "3"]) == 2
    assert (
        one_error_line(capsys)
        == "error: unrecognized arguments: --max-topk-typo 3 (see `mempo-trl serve-retriever --help`)"
    )


def test_an_error_line_is_one_write_so_ranks_cannot_interleave(monkeypatch):
    """Two ranks share stderr under `accelerate launch`: text and newline written apart let their lines mix."""
    writes = []

    class Recorder:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Recorder())
    assert main(["serve-retriever", "--corpus", "c.jsonl", "--max-topk-typo", "3"]) == 2
    assert len(writes) == 1 and writes[0].startswith("error: unrecognized arguments") and writes[0].endswith(")\n")


# ------------------------------------------------------------------------------------------ fault injection


def launch_training(argv: list[str], cwd: Path) -> tuple[subprocess.Popen, list[str]]:
    """`torchrun --nproc_per_node 2 -m mempo_trl <argv>` (CPU, gloo); its output lines are collected as they come."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [*torchrun, str(free_port()), "-m", "mempo_trl", *argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    lines: list[str] = []

    def collect() -> None:
        with (cwd / "training.log").open("a") as log:  # kept for a failed test's post-mortem
            for line in iter(process.stdout.readline, ""):
                lines.append(line)
                log.write(line)

    threading.Thread(target=collect, daemon=True).start()
    return process, lines


def wait_for(lines: list[str], needle: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not any(needle in line for line in lines):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"no {needle!r} in the output:\n{''.join(lines)[-6000:]}")
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_process_training_saves_on_a_retriever_outage_and_resumes(tmp_path, warm_model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out = tmp_path / "out"
    argv = train_settings(
        tmp_path,
        warm_model_dir,
        retriever_url=url,
        retriever_retry_budget=2.0,
        max_steps=3,
        max_turns=2,
        per_device_train_batch_size=2,
        num_generations=4,
        max_completion_length=48,
        logging_steps=1,
        save_strategy="no",
        temperature=1.0,
    )
    processes = [start_retriever(tmp_path, port)]
    try:
        training, lines = launch_training(argv, tmp_path)
        processes.append(training)
        wait_for(lines, "step 1/3", training, timeout=600)
        stop(processes[0])  # the retrieval server dies in the middle of the run
        training.wait(timeout=120)
        output = "".join(lines)
        assert training.returncode != 0, output[-6000:]
        stopped = [line for line in lines if line.startswith("error: training stopped: POST ")]
        assert stopped and "refused the connection" in stopped[0], output[-6000:]
        checkpoint = Path(stopped[0].split("rerun with --resume_from_checkpoint ")[1].rstrip(".\n"))
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        assert checkpoint.parent == out and state["global_step"] in (1, 2)
        assert {"optimizer.pt", "model.safetensors", "rng_state_0.pth", "rng_state_1.pth"} <= {
            p.name for p in checkpoint.iterdir()
        }

        processes.append(start_retriever(tmp_path, port))  # back on the same address: the run continues
        resumed, lines = launch_training([*argv, "--resume_from_checkpoint", str(checkpoint)], tmp_path)
        processes.append(resumed)
        assert resumed.wait(timeout=600) == 0, "".join(lines)[-6000:]
    finally:
        for process in processes:
            stop(process)
    output = "".join(lines)
    assert "step 3/3" in output and f"model saved to {out}" in output
    assert f"step {state['global_step']}/3" not in output  # the finished steps were not trained again
    assert (out / "mempo_metrics.json").is_file()
