"""Helpers and test doubles shared by the tests and their worker scripts (fixtures live in conftest.py).

Importable by name (``from helpers import ...``): pytest puts ``tests/`` on ``sys.path`` (``pythonpath`` in
pyproject.toml), and `worker_env` puts it on the ``PYTHONPATH`` of the scripts under ``tests/scripts``.
"""

import math
import os
import socket
from pathlib import Path

import torch

from mempo_trl.retrieval import Passage


TESTS_DIR = Path(__file__).resolve().parent

CPU_CONFIG = {
    "per_device_train_batch_size": 4,
    "num_generations": 2,
    "max_completion_length": 32,
    "max_turns": 3,
    "max_steps": 1,
    "use_cpu": True,
    "bf16": False,
    "activation_checkpointing": False,
    "report_to": "none",
    "save_strategy": "no",
    "logging_steps": 1,
    "seed": 0,
}
"""What `cpu_config` sets: a one-step fp32 run on the CPU, logging every step, saving and reporting nothing."""


def cpu_config(output_dir, **overrides):
    """A `MemPOConfig` for a short CPU run into ``output_dir``: `CPU_CONFIG` with ``overrides``."""
    from mempo_trl import MemPOConfig

    return MemPOConfig(output_dir=str(output_dir), **{**CPU_CONFIG, **overrides})


CPU_RECIPE = {
    "use_cpu": True,
    "bf16": False,
    "report_to": "none",
    "max_steps": 1,
    "per_device_train_batch_size": 4,
    "num_generations": 4,
    "max_completion_length": 8,
    "max_turns": 1,
}
"""What `cpu_recipe` sets: one short fp32 step on the CPU, reporting nothing."""


def cpu_recipe(directory: Path, model_dir, raw: str = "", **fields) -> Path:
    """Write ``directory/recipe.yaml``, a `mempo-trl train` recipe for a short CPU run of ``model_dir`` into
    ``directory/out`` on the demo world (its rows and corpus; none with an ``environment``): `CPU_RECIPE` with
    ``fields``, then the YAML ``raw`` as is. Returns its path."""
    import json

    from mempo_trl.kit.demo_world import demo_paths

    demo = demo_paths()
    data = {} if "environment" in fields else {"dataset_name": str(demo.train.parent), "corpus": str(demo.corpus)}
    settings = {"model_name_or_path": str(model_dir), "output_dir": str(directory / "out"), **data, **CPU_RECIPE}
    settings.update(fields)
    path = directory / "recipe.yaml"
    path.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in settings.items()) + "\n" + raw)
    return path


def one_error_line(capsys) -> str:
    """The one ``error:`` line a failed command wrote to stderr (asserting there is one, and no traceback)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of a script under ``tests/scripts``: this one, offline, ``tests/`` first on PYTHONPATH."""
    path = os.pathsep.join(p for p in (str(TESTS_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path, **extra}


SERVER_CORPUS = [("1", "Hamlet", "Hamlet is a tragedy by William Shakespeare."), ("2", "Paris", "Paris is in France.")]
"""The corpus of `write_corpus`: (id, title, text) rows."""


def write_corpus(directory: Path) -> Path:
    """Write `SERVER_CORPUS` as ``directory/corpus.jsonl``; return its path."""
    import json

    corpus = directory / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "contents": f'"{t}"\n{x}'}) + "\n" for i, t, x in SERVER_CORPUS))
    return corpus


def start_retriever(directory: Path, port: int, *flags: str, env: dict | None = None):
    """`mempo-trl serve-retriever` over `write_corpus` on 127.0.0.1:`port`, up and answering (or the test fails with
    its log); returns the process (end it with `stop`)."""
    import subprocess
    import sys
    import time

    import pytest

    from mempo_trl.retrieval import HttpRetriever, RetrievalError

    corpus = write_corpus(directory)
    command = [sys.executable, "-m", "mempo_trl", "serve-retriever", "--corpus", str(corpus), "--port", str(port)]
    command += ["--retriever_cache_dir", str(directory / "cache"), "--log_level", "warning", *flags]
    log = directory / f"server-{port}-{time.monotonic_ns()}.log"
    with log.open("w") as log_file:
        process = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    try:
        with HttpRetriever(f"http://127.0.0.1:{port}") as client:
            client.wait_ready(timeout=60)
    except RetrievalError:
        process.kill()
        pytest.fail(f"the retrieval server did not come up; its log:\n{log.read_text()}")
    return process


def stop(process) -> None:
    """Kill a process and wait for it."""
    process.kill()
    process.wait(timeout=10)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (just released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_lines(path: Path, lines: list[str]) -> Path:
    """Write `lines` to `path`, one per line; return `path`."""
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


class EchoRetriever:
    """One passage per query, ``Passage(id=q, title="T q", text="about q")``; records the queries (``queries``, all of
    them; ``calls``, one list per `search` call)."""

    def __init__(self):
        self.queries = []
        self.calls = []

    def search(self, queries, topk):
        self.queries += queries
        self.calls.append(list(queries))
        return [[Passage(id=q, title=f"T {q}", text=f"about {q}")] for q in queries]


def scripted_scorers(tokenizer, probability):
    """Stand-ins for `answer_token_logps` and `shared_prefix_answer_logps` (patch them into `mempo_trl.trainer`):
    every gold token of an item gets ``log probability(model, decoded context)``, so that P = that probability."""

    def answer_token_logps(model, items, pad_token_id, batch_size=8, num_chunks=None):
        width = max((len(it.answer_ids) for it in items), default=0)
        logps, mask = torch.zeros(len(items), width), torch.zeros(len(items), width, dtype=torch.bool)
        for i, it in enumerate(items):
            n = sum(it.answer_mask)
            logps[i, :n] = math.log(probability(model, tokenizer.decode(it.context_ids, skip_special_tokens=False)))
            mask[i, :n] = True
        return logps, mask

    def shared_prefix_answer_logps(model, items, group_keys, pad_token_id, batch_size=8, num_chunks=None):
        return answer_token_logps(model, items, pad_token_id, batch_size, num_chunks)

    return answer_token_logps, shared_prefix_answer_logps


def reward_failing_after_step_1(completions, trainer_state, **kwargs):
    """A reward function (give its import path, ``helpers.reward_failing_after_step_1``) that scores 0 at step 1 and
    raises `ValueError` from step 2 on: an error that ends training mid-run."""
    if trainer_state.global_step >= 1:
        raise ValueError("the reward service went away")
    return [0.0] * len(completions)


class ProcessTree:
    """Every process ever seen below ``pid``, found through /proc's parent links (never by name) by a thread that
    looks every 0.1 s from its creation until `wait_gone`: a process stays counted once its parent dies and it is
    reparented (each is a `psutil.Process`, pid and start time, so a reused pid is not it)."""

    def __init__(self, pid: int):
        import threading

        import psutil

        self.root = psutil.Process(pid)
        self.seen: dict[tuple[int, float], psutil.Process] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        import psutil

        while not self._done.is_set():
            for process in [self.root, *self.seen.values()]:
                try:
                    for child in process.children(recursive=True):
                        self.seen.setdefault((child.pid, child.create_time()), child)
                except psutil.Error:  # gone; what it started was seen while it ran
                    pass
            self._done.wait(0.1)

    def wait_seen(self, count: int, timeout: float = 60) -> None:
        """Wait until at least ``count`` processes have been seen below the root (at most ``timeout`` seconds)."""
        import time

        deadline = time.monotonic() + timeout
        while len(self.seen) < count:
            assert time.monotonic() < deadline, f"{len(self.seen)} of {count} processes seen"
            time.sleep(0.05)

    def alive(self) -> list[str]:
        """``pid command`` of each process seen that still runs (zombies, ended and waiting to be reaped, do not)."""
        import psutil

        found = []
        for process in list(self.seen.values()):
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    found.append(f"{process.pid} {' '.join(process.cmdline())[:300]}")
            except psutil.Error:
                pass
        return found

    def wait_gone(self, timeout: float) -> list[str]:
        """Wait until no process seen runs, at most ``timeout`` seconds; returns those still running (see `alive`)."""
        import time

        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        self._done.set()
        self._thread.join()
        return self.alive()

    def kill(self) -> None:
        """SIGKILL every process seen that still runs (a test's clean-up: nothing it started outlives it)."""
        import psutil

        for process in list(self.seen.values()):
            try:
                if process.is_running():
                    process.kill()
            except psutil.Error:
                pass


def record_as_run(directory: Path, *names: str) -> None:
    """Write ``directory/_mempo_outputs.json`` as a run that wrote `names` there records them (with fingerprints)."""
    from mempo_trl.outputs import fingerprint, write_record

    write_record(directory, {name: fingerprint(directory / name) for name in names})


def turn(mem: str, action: str, content: str) -> str:
    """A scripted MemPO turn: ``<mem>`` ``mem``, a one-letter think, then ``<action>content</action>``."""
    return f"<mem>{mem}</mem><think>t</think><{action}>{content}</{action}>"


SCRIPT = {
    "Where is Alpha?": [
        [turn("a1", "search", "alpha"), turn("a1b", "answer", "Paris")],
        [turn("a2", "answer", "Lyon")],
    ],
    "Where is Beta?": [
        [turn("b1", "answer", "Rome")],
        [turn("b2", "search", "beta"), turn("b2b", "search", "beta 2"), turn("b2c", "answer", "Rome")],
    ],
}
"""Question -> the scripted turns of its G = 2 trajectories (2, 1, 1 and 3 rounds), for scripted trainers."""
GOLDS = {"Where is Alpha?": ["Paris"], "Where is Beta?": ["Rome"]}
"""The gold answers of `SCRIPT`'s questions."""


def play_script(trainer, tokenizer, monkeypatch) -> None:
    """Make ``trainer`` generate `SCRIPT`'s turns: each context is matched to its question and to the scripted turns it
    already shows, and a new trajectory takes the question's next script (round-robin over steps)."""
    started: dict[str, int] = {}

    def scripted_generate(prompt_ids, *args, **kwargs):
        outs = []
        for ids in prompt_ids:
            text = tokenizer.decode(ids, skip_special_tokens=False)
            question = next(q for q in SCRIPT if q in text)
            seen = [(k, j) for k, script in enumerate(SCRIPT[question]) for j, t in enumerate(script) if t in text]
            if seen:
                ((k, j),) = seen
            else:
                k, j = (started.setdefault(question, -1) + 1) % len(SCRIPT[question]), -1
                started[question] = k
            outs.append(tokenizer(SCRIPT[question][k][j + 1], add_special_tokens=False)["input_ids"])
        return outs, None

    monkeypatch.setattr(trainer, "_generate_single_turn", scripted_generate)


def scripted_p_mem(memory: str) -> float:
    """A scripted P_mem in [0.05, 0.94], fixed by the ``<mem>`` text ``memory`` (a worker's scorer and its test)."""
    import zlib

    return 0.05 + zlib.crc32(memory.encode()) % 90 / 100


def reward_by_length(completions, **kwargs):
    """A reward function (give its import path, ``helpers.reward_by_length``) that scores each episode by the length
    of its completion (characters / 100): rewards that differ within a group, so that every step moves the weights
    even of a model that never answers."""
    return [len(str(completion)) / 100 for completion in completions]
