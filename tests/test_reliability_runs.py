"""Runs never lose work, part 2: preemption, broken checkpoints, full disks, NaN, bad values, hostile retrievers.

Every case goes through the real CLI (`mempo_trl.cli.main`, in process) or a real subprocess (the SIGTERM run, the
retrieval servers on 127.0.0.1). A full disk is injected at the write call (torch.save / safetensors), not with a
real small file system. Each wait here is bounded.
"""

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import cpu_recipe, one_error_line
from safetensors.torch import load_file

from mempo_trl.checkpoints import newest_complete_checkpoint, resolve_resume, validate_checkpoint
from mempo_trl.cli import main
from mempo_trl.retrieval import HttpRetriever, RetrievalError, RetrieverOutage


CALLS = {"reward": 0}


def recipe(tmp_path: Path, model_dir: Path, raw: str = "", **fields) -> list[str]:
    """`mempo-trl train` arguments for a short CPU run of the tiny model; `raw` is appended to the YAML as is."""
    path = cpu_recipe(tmp_path, model_dir, raw, **{"logging_steps": 1, "save_strategy": "no", **fields})
    return ["train", "--config", str(path)]


# ------------------------------------------------------------------------------------------ bad values (5, 6, 7)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("memory_coef: .nan", "memory_coef must be a finite number, got nan."),
        ("memory_coef: .inf", "memory_coef must be a finite number, got inf."),
        ("beta: .nan", "beta must be a finite number, got nan."),
        ("memory_reward_eps: .nan", "memory_reward_eps must be a finite number, got nan."),
        ("retrieval_topk: 2.7", "retrieval_topk must be an integer, got 2.7."),
        ("num_generations: 0", "num_generations must be >= 1, got 0."),
        ('instruction: "{question} {other}"', "instruction may only use the `{question}` placeholder, got {other}"),
    ],
)
def test_bad_config_values_are_one_error_line(tmp_path, capsys, tiny_model_dir, raw, message):
    assert main(recipe(tmp_path, tiny_model_dir, raw)) == 2  # a repeated YAML key: the last one counts
    line = one_error_line(capsys)
    assert line.startswith("error: Invalid MemPOConfig: - ") and message in line, line
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize(
    ("second", "field", "problem"),
    [
        ({"golden_answers": ["。"]}, "golden_answers[0]", "is '。', which normalises to an empty answer"),
        ({"golden_answers": ["—"]}, "golden_answers[0]", "is '—', which normalises to an empty answer"),
        ({"golden_answers": ["Ulm", "\u200b"]}, "golden_answers[1]", "which normalises to an empty answer"),
        ({"golden_answers": ["Ulm"], "level": "hard"}, "level", "is a string ('hard') but a number on line 1"),
    ],
)
def test_bad_qa_rows_name_file_line_and_field(tmp_path, capsys, tiny_model_dir, second, field, problem):
    data = tmp_path / "qa.jsonl"
    rows = [{"question": "Where?", "golden_answers": ["Ulm"], "level": 3}, {"question": "Which?", **second}]
    data.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    assert main(recipe(tmp_path, tiny_model_dir, dataset_name=str(data))) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: {data}, line 2: field '{field}' ") and problem in line, line


def test_a_punctuation_answer_never_matches_a_real_gold():
    from mempo_trl.data import has_answer_text
    from mempo_trl.rewards import exact_match

    assert [has_answer_text(g) for g in ("。", "—", "\u200b", "¿?", "Ulm", "1874", "東京")] == [False] * 4 + [True] * 3
    assert exact_match("。", ["Ulm"]) == 0.0


def test_corpus_with_a_lone_surrogate_is_refused_at_start(tmp_path, capsys, monkeypatch):
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: None)  # a server that started would return 0 here
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": "1", "contents": "\\"A\\"\\nfine"}\n{"id": "2", "contents": "\\"B\\"\\nbad \\ud800"}\n')
    assert main(["serve-retriever", "--corpus", str(corpus), "--retriever_cache_dir", str(tmp_path / "c")]) == 2
    assert one_error_line(capsys) == (
        f"error: {corpus}, line 2: field 'contents' holds '\\ud800' at character 8, a lone surrogate that is not "
        "valid Unicode. Fix the escape in the file (a surrogate pair must be complete) or drop the row."
    )


# ------------------------------------------------------------------------------------------ checkpoints (2, 3)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model_dir):
    """An output directory of a finished 2-step run with checkpoint-1 and checkpoint-2."""
    tmp_path = tmp_path_factory.mktemp("finished")
    assert main(recipe(tmp_path, tiny_model_dir, max_steps=2, save_strategy="steps", save_steps=1)) == 0
    return tmp_path / "out"


@pytest.fixture
def run_copy(tmp_path, finished_run):
    out = tmp_path / "out"
    shutil.copytree(finished_run, out)
    return out


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        ("optimizer.pt", "optimizer.pt is missing"),
        ("scheduler.pt", "scheduler.pt is missing"),
        ("rng_state.pth", "rng_state.pth is missing"),
        ("model.safetensors:-100", "model.safetensors is truncated ("),
        ("optimizer.pt:-100", "optimizer.pt is truncated or corrupt (File is not a zip file)"),
        ("trainer_state.json:-0", "trainer_state.json is not valid JSON (Expecting value: line 1 column 1 (char 0))"),
    ],
)
def test_resuming_a_broken_checkpoint_names_the_file_before_any_work(
    tmp_path, capsys, tiny_model_dir, run_copy, damage, problem
):
    checkpoint = run_copy / "checkpoint-2"
    name, _, cut = damage.partition(":")  # ":-N": cut the last N bytes (":-0": all of them)
    if cut:
        size = (checkpoint / name).stat().st_size
        with (checkpoint / name).open("r+b") as f:
            f.truncate(size + int(cut) if int(cut) else 0)
    else:
        (checkpoint / name).unlink()
    argv = recipe(tmp_path, tiny_model_dir, max_steps=3, resume_from_checkpoint=str(checkpoint))
    assert main(argv) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: checkpoint {checkpoint} is incomplete: {checkpoint / problem.split()[0]}"), line
    assert problem in line and f"resume from an earlier checkpoint ({run_copy / 'checkpoint-1'})" in line, line
    assert not (run_copy / "checkpoint-3").exists()


def test_newest_complete_checkpoint_is_by_step_number(tmp_path, capsys, tiny_model_dir, run_copy):
    shutil.copytree(run_copy / "checkpoint-1", run_copy / "checkpoint-9")
    shutil.copytree(run_copy / "checkpoint-2", run_copy / "checkpoint-10")
    (run_copy / "checkpoint-10" / "optimizer.pt").unlink()  # a save cut short by a kill
    assert newest_complete_checkpoint(run_copy) == run_copy / "checkpoint-9"
    assert resolve_resume("true", run_copy) == str(run_copy / "checkpoint-9")
    shutil.copytree(run_copy / "checkpoint-2", run_copy / "checkpoint-11")
    assert resolve_resume(True, run_copy) == str(run_copy / "checkpoint-11")  # 11 > 10 > 9 though "11" < "9"
    shutil.rmtree(run_copy / "checkpoint-11")
    assert main(recipe(tmp_path, tiny_model_dir)) == 2  # the rerun hint of a used output directory
    assert f"Pass --resume_from_checkpoint {run_copy / 'checkpoint-9'} to continue it" in one_error_line(capsys)


def test_a_multi_process_checkpoint_needs_every_rank_rng_state(run_copy):
    from mempo_trl.checkpoints import saved_world_size

    checkpoint = run_copy / "checkpoint-2"
    for rank in (0, 1):  # as 2 processes save it
        shutil.copy(checkpoint / "rng_state.pth", checkpoint / f"rng_state_{rank}.pth")
    (checkpoint / "rng_state.pth").unlink()
    assert validate_checkpoint(checkpoint)["global_step"] == 2 and saved_world_size(checkpoint) == 2
    (checkpoint / "rng_state_1.pth").unlink()  # rank 1 was killed before it saved
    with pytest.raises(ValueError, match="rng_state_1.pth is missing"):
        validate_checkpoint(checkpoint)


def test_resume_true_continues_from_the_newest_complete_checkpoint(tmp_path, capsys, tiny_model_dir, run_copy):
    (run_copy / "checkpoint-2" / "rng_state.pth").unlink()  # incomplete: true must fall back to checkpoint-1
    assert main(recipe(tmp_path, tiny_model_dir, max_steps=3, resume_from_checkpoint="true")) == 0
    out = capsys.readouterr().out
    assert "step 2/3" in out and "step 3/3" in out and "step 1/3" not in out, out


def test_resuming_a_finished_run_says_so_and_changes_nothing(tmp_path, capsys, tiny_model_dir, run_copy):
    before = {p: p.stat().st_mtime_ns for p in run_copy.rglob("*")}
    assert main(recipe(tmp_path, tiny_model_dir, max_steps=2, resume_from_checkpoint="true")) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{run_copy / 'checkpoint-2'} is already at the end of training (step 2 of 2): nothing")
    assert {p: p.stat().st_mtime_ns for p in run_copy.rglob("*")} == before  # no phantom step 3/2, no new card


# ------------------------------------------------------------------------------------------ SIGTERM (1)


def test_sigterm_saves_a_complete_checkpoint_and_says_how_to_resume(tmp_path, tiny_model_dir):
    argv = recipe(tmp_path, tiny_model_dir, max_steps=500)
    src = str(Path(__file__).resolve().parents[1] / "src")  # this checkout's code, whatever is installed
    process = subprocess.Popen(
        [sys.executable, "-m", "mempo_trl", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": src, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while not any("step 1/500" in line for line in lines):
        assert process.poll() is None and time.monotonic() < deadline, "".join(lines)[-4000:]
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=300) == 2
    reader.join(timeout=10)
    output = "".join(lines)
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in output, output[-4000:]
    assert "mempo-trl: SIGTERM received: finishing step" in output
    step = int(errors[0].split("after step ")[1].split("/")[0])
    checkpoint = tmp_path / "out" / f"checkpoint-{step}"
    assert errors[0] == (
        f"error: training stopped by SIGTERM after step {step}/500. Saved {checkpoint}; rerun with "
        f"--resume_from_checkpoint {checkpoint} to continue.\n"
    )
    assert validate_checkpoint(checkpoint)["global_step"] == step
    assert not (tmp_path / "out" / "model.safetensors").exists()  # not mistaken for a finished run


def test_sigint_is_caught_once_and_a_forwarded_repeat_is_ignored(capsys):
    from transformers import TrainerControl

    from mempo_trl.interruptions import SaveOnSignalCallback

    accelerator = SimpleNamespace(num_processes=1, device="cpu")
    trainer = SimpleNamespace(
        accelerator=accelerator, state=SimpleNamespace(global_step=6), is_world_process_zero=lambda: True
    )
    callback, control = SaveOnSignalCallback(trainer), TrainerControl()
    before = signal.getsignal(signal.SIGINT)
    callback.on_train_begin(None, None, control)
    try:
        callback.on_step_end(None, None, control)
        assert not control.should_save and callback.received is None
        signal.raise_signal(signal.SIGINT)  # Ctrl-C: no KeyboardInterrupt in the middle of the step ...
        signal.raise_signal(signal.SIGINT)  # ... nor when the launcher forwards it again
        callback.on_step_end(None, None, control)
    finally:
        callback.on_train_end(None, None, control)
    assert control.should_save and control.should_training_stop and callback.received == "SIGINT"
    assert signal.getsignal(signal.SIGINT) is before
    assert capsys.readouterr().out == (
        "mempo-trl: SIGINT received: finishing step 7, then saving a checkpoint and stopping.\n"
    )


# ------------------------------------------------------------------------------------------ non-finite values (5)


def infinite_after_first_step(prompts, completions, **kwargs):
    """A custom reward that turns infinite from the second step on (4 completions per step)."""
    CALLS["reward"] += 1
    return [float("inf") if CALLS["reward"] > 1 else 0.5] * len(completions)


@pytest.mark.parametrize("where", ["advantage", "loss"])
def test_non_finite_values_stop_training_and_keep_the_last_good_checkpoint(
    tmp_path, capsys, tiny_model_dir, monkeypatch, where
):
    from trl import GRPOTrainer

    CALLS["reward"] = 0
    fields = {"max_steps": 3}
    if where == "advantage":
        fields["reward_funcs"] = [f"{__name__}.infinite_after_first_step"]
    else:
        training_step = GRPOTrainer.training_step

        def nan_loss_at_step_2(self, *args, **kwargs):
            loss = training_step(self, *args, **kwargs)
            return loss * float("nan") if self.state.global_step == 1 else loss

        monkeypatch.setattr(GRPOTrainer, "training_step", nan_loss_at_step_2)
    assert main(recipe(tmp_path, tiny_model_dir, **fields)) == 2
    checkpoint = tmp_path / "out" / "checkpoint-1"
    line = one_error_line(capsys)
    assert line.startswith(f"error: training stopped: step 2: the {where} is not finite (nan on "), line
    assert line.endswith(f"Saved {checkpoint}; once that is fixed, rerun with --resume_from_checkpoint {checkpoint}.")
    weights = load_file(checkpoint / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert not (tmp_path / "out" / "model.safetensors").exists()


# ------------------------------------------------------------------------------------------ full disk (4)


def test_too_little_free_space_stops_before_training(tmp_path, capsys, tiny_model_dir, monkeypatch):
    from mempo_trl import checkpoints

    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda path: SimpleNamespace(total=10**9, free=1000))
    assert main(recipe(tmp_path, tiny_model_dir)) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: {tmp_path / 'out'} has 1000 B free but the final model (") and "GiB" not in line
    assert "and one checkpoint (" in line and "Free space or choose another output_dir" in line
    assert not any((tmp_path / "out").glob("checkpoint-*")) and "step 1/1" not in capsys.readouterr().out


def disk_full_when(monkeypatch, module, name: str, failing) -> None:
    """Make `module.name` (a save function whose 2nd argument is the path) fail as a full disk does when
    `failing(path)`."""
    original = getattr(module, name)

    def save(obj, path, *args, **kwargs):
        if failing(str(path)):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return original(obj, path, *args, **kwargs)

    monkeypatch.setattr(module, name, save)


def test_a_full_disk_at_the_final_save_keeps_the_model(tmp_path, capsys, tiny_model_dir, monkeypatch):
    import tempfile

    import transformers.modeling_utils

    out = tmp_path / "out"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the rescued model goes
    disk_full_when(monkeypatch, transformers.modeling_utils, "safe_save_file", lambda p: p.startswith(str(out)))
    assert main(recipe(tmp_path, tiny_model_dir)) == 2
    line = one_error_line(capsys)
    rescued = next(tmp_path.glob("mempo-trl-model-*"))
    assert line == (
        f"error: saving the trained model to {out} failed (the disk is full); it was saved to {rescued} instead. "
        "Move it where it belongs (the metrics and model card were not written)."
    )
    assert load_file(rescued / "model.safetensors") and (rescued / "mempo_agent.json").is_file()


def test_a_full_disk_during_a_checkpoint_names_the_last_complete_one(tmp_path, capsys, tiny_model_dir, monkeypatch):
    out = tmp_path / "out"
    disk_full_when(monkeypatch, torch, "save", lambda p: "checkpoint-2" in p)  # optimizer.pt of checkpoint-2
    assert main(recipe(tmp_path, tiny_model_dir, max_steps=3, save_strategy="steps", save_steps=1)) == 2
    assert one_error_line(capsys) == (
        f"error: training stopped at step 2: saving {out / 'checkpoint-2'} failed: the disk is full. Free space, then "
        f"rerun with --resume_from_checkpoint {out / 'checkpoint-1'} (the newest complete checkpoint; a partial "
        "one is ignored)."
    )


# ------------------------------------------------------------------------------------------ retriever client (8)


def test_client_deadline_bounds_a_server_trickling_headers(bad_server):
    client = HttpRetriever(bad_server("trickle_headers"), timeout=1.0, max_retries=0)
    start = time.monotonic()
    with pytest.raises(RetrieverOutage, match="did not send its whole answer within 1s"):
        client.search(["hamlet"], topk=1)
    assert time.monotonic() - start < 5  # one byte every 0.1 s for a minute: only the overall deadline stops it


def test_client_honours_retry_after(bad_server, caplog):
    client = HttpRetriever(bad_server("ratelimit"), max_retries=3, backoff=0.0)
    with caplog.at_level("WARNING", logger="mempo_trl.retrieval.http_client"):
        assert client.search(["hamlet"], topk=1) == [[]]
    retries = [r.getMessage() for r in caplog.records if "failed, retrying" in r.getMessage()]
    assert len(retries) == 1 and "retrying in 1s" in retries[0] and "HTTP 429" in retries[0], retries  # not 0 s


def test_client_gives_up_at_once_on_a_retry_after_beyond_its_budget(bad_server):
    client = HttpRetriever(bad_server("ratelimit_long"), max_retries=None, retry_budget=30)
    start = time.monotonic()
    with pytest.raises(RetrieverOutage, match="HTTP 429 .* asked to be retried after 3600s, beyond the retry budget"):
        client.search(["hamlet"], topk=1)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (
            "redirect",
            "answered HTTP 307, a redirect to 'http://elsewhere.invalid/retrieve'; redirects are not followed",
        ),
        ("nested", "answered with JSON nested too deeply to read"),
    ],
)
def test_client_refuses_redirects_and_deeply_nested_answers(bad_server, mode, message):
    url = bad_server(mode)
    with pytest.raises(RetrievalError) as info:
        HttpRetriever(url, max_retries=0).search(["hamlet"], topk=1)
    assert not isinstance(info.value, RetrieverOutage) and message in str(info.value) and url in str(info.value)


def test_a_retriever_error_mid_training_saves_a_checkpoint_first(tmp_path, capsys, tiny_model_dir, monkeypatch):
    from mempo_trl.trainer import MemPOTrainer

    play = MemPOTrainer._play_episodes

    def rate_limited_at_step_2(self, inputs):
        if self.state.global_step == 1:
            raise RetrievalError("POST http://127.0.0.1:9/retrieve answered HTTP 429 (is rate-limiting this client)")
        return play(self, inputs)

    monkeypatch.setattr(MemPOTrainer, "_play_episodes", rate_limited_at_step_2)
    assert main(recipe(tmp_path, tiny_model_dir, max_steps=3)) == 2
    checkpoint = tmp_path / "out" / "checkpoint-1"
    assert one_error_line(capsys) == (
        "error: training stopped: POST http://127.0.0.1:9/retrieve answered HTTP 429 (is rate-limiting this client). "
        f"Saved {checkpoint}; once that is fixed, rerun with --resume_from_checkpoint {checkpoint}."
    )
    assert validate_checkpoint(checkpoint)["global_step"] == 1


# ------------------------------------------------------------------------------------------ retrieval server (9)


def test_server_closes_idle_and_slow_connections(tmp_path):
    from helpers import free_port, start_retriever, stop

    port = free_port()
    server = start_retriever(tmp_path, port, "--request_timeout", "1")
    try:
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"POST /retrieve HTTP/1.1\r\nhost: x\r\n")
        stop_trickle = threading.Event()

        def trickle():
            while not stop_trickle.wait(0.1):
                try:
                    slow.sendall(b"x")
                except OSError:
                    return

        threading.Thread(target=trickle, daemon=True).start()
        for sock in [*idle, slow]:
            sock.settimeout(10)
            assert sock.recv(100) == b""  # closed by the server
        stop_trickle.set()
        with HttpRetriever(f"http://127.0.0.1:{port}") as client:  # a normal client is still served
            assert [p.id for p in client.search(["hamlet"], topk=1)[0]] == ["1"]
    finally:
        stop(server)


def test_an_empty_learner_world_marker_is_rewritten(tmp_path):
    from mempo_trl.kit.learner import write_learner_world

    world, sizes = {"seed": 1, "num_entities": 60, "num_questions": 90}, {"test": 20, "rl": 30}
    paths = write_learner_world(tmp_path, world, sizes)
    (tmp_path / "world.json").write_text("")  # a write cut short
    assert write_learner_world(tmp_path, world, sizes) == paths
    assert json.loads((tmp_path / "world.json").read_text()) == {"world": world, "sizes": sizes}
