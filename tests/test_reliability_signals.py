"""Runs never lose work, part 3: stop signals around the final save and the evaluation after training, SIGHUP, a
kill during the final save, and stop signals through `--num_processes`.

Every run is a real `mempo-trl train` subprocess; the signal is sent when a given line of its output appears (each
wait is bounded). The held-out evaluation after training is the window of most cases: the tiny model plays the 50
test questions for seconds.
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
from helpers import cpu_recipe, one_error_line

from mempo_trl.checkpoints import FINAL_SAVE_MARKER, validate_checkpoint
from mempo_trl.cli import main


SRC = str(Path(__file__).resolve().parents[1] / "src")  # this checkout's code, whatever is installed
HELDOUT = {"heldout_questions": 50, "max_turns": 3, "max_completion_length": 32}
"""A held-out evaluation long enough (seconds) to be signalled."""


class Run:
    """A `mempo-trl` subprocess whose output lines are collected as they come."""

    def __init__(self, args: list[str], new_session: bool = False):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mempo_trl", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONPATH": SRC, "PYTHONUNBUFFERED": "1"},
            start_new_session=new_session,
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(iter(self.process.stdout.readline, "")))
        self.reader.daemon = True
        self.reader.start()

    def wait_for(self, text: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert self.process.poll() is None and time.monotonic() < deadline, self.output[-4000:]
            time.sleep(0.05)

    def finish(self, timeout: float = 300) -> int:
        rc = self.process.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return rc

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def errors(self) -> list[str]:
        assert "Traceback" not in self.output, self.output[-4000:]
        return [line.rstrip("\n") for line in self.lines if line.startswith("error: ")]


def train_args(tmp_path: Path, model_dir: Path, **fields) -> list[str]:
    fields = {"logging_steps": 1, "save_strategy": "no", **fields}
    return ["train", "--config", str(cpu_recipe(tmp_path, model_dir, **fields))]


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_during_the_evaluation_after_training_keeps_the_saved_model(tmp_path, tiny_model_dir, signame):
    out = tmp_path / "out"
    run = Run(train_args(tmp_path, tiny_model_dir, max_steps=1, **HELDOUT))
    run.wait_for("held-out evaluation after training")
    run.process.send_signal(getattr(signal, signame))
    assert run.finish() == 2, run.output[-4000:]
    assert run.errors() == [
        f"error: training finished and the model is saved in {out}; the evaluation after training was stopped by "
        f"{signame} (the metrics and model card leave it out)."
    ]
    assert (out / "model.safetensors").is_file() and (out / "mempo_agent.json").is_file()
    assert not (out / FINAL_SAVE_MARKER).exists()
    metrics = json.loads((out / "mempo_metrics.json").read_text())
    assert "heldout/em_before" in metrics and not any(k.endswith("_after") for k in metrics), metrics
    card = (out / "README.md").read_text()
    assert "before training (step 0) only (the evaluation after training was stopped)" in card
    assert "| metric | before |\n" in card


def test_a_signal_during_the_evaluation_before_training_skips_the_one_after(tmp_path, tiny_model_dir):
    run = Run(train_args(tmp_path, tiny_model_dir, max_steps=20, **HELDOUT))
    run.wait_for("held-out evaluation before training")
    run.process.send_signal(signal.SIGTERM)
    assert run.finish() == 2, run.output[-4000:]
    checkpoint = tmp_path / "out" / "checkpoint-1"
    assert run.errors() == [
        f"error: training stopped by SIGTERM after step 1/20. Saved {checkpoint}; rerun with --resume_from_checkpoint "
        f"{checkpoint} to continue."
    ]
    assert "held-out evaluation after training" not in run.output and "at step 1:" not in run.output
    assert validate_checkpoint(checkpoint)["global_step"] == 1


def test_sighup_saves_a_checkpoint_like_sigterm(tmp_path, tiny_model_dir):
    run = Run(train_args(tmp_path, tiny_model_dir, max_steps=500))
    run.wait_for("step 1/500")
    run.process.send_signal(signal.SIGHUP)
    assert run.finish() == 2, run.output[-4000:]
    (error,) = run.errors()
    step = int(error.split("after step ")[1].split("/")[0])
    checkpoint = tmp_path / "out" / f"checkpoint-{step}"
    assert error.startswith(f"error: training stopped by SIGHUP after step {step}/500. Saved {checkpoint};")
    assert validate_checkpoint(checkpoint)["global_step"] == step


def test_a_kill_during_the_final_save_is_detected_and_resume_finishes_it(tmp_path, tiny_model_dir, demo_paths, capsys):
    out = tmp_path / "out"
    args = train_args(tmp_path, tiny_model_dir, max_steps=2, save_strategy="steps", save_steps=1, **HELDOUT)
    run = Run(args)
    run.wait_for("held-out evaluation after training")  # the model is written, its metrics and card are not
    run.process.kill()
    assert run.finish() == -signal.SIGKILL
    assert (out / FINAL_SAVE_MARKER).is_file() and not (out / "mempo_metrics.json").exists()

    ask = ["ask", "Where was Alice born?", "--model_name_or_path", str(out), "--corpus", str(demo_paths.corpus)]
    assert main(ask) == 2
    assert one_error_line(capsys) == (
        f"error: {out} holds an incomplete final save (the run was stopped while saving the trained model, "
        f"{FINAL_SAVE_MARKER} is still there): rerun the training command with --resume_from_checkpoint true to "
        f"save it again from {out / 'checkpoint-2'}."
    )

    resumed = Run([*args, "--resume_from_checkpoint", "true", "--heldout_questions", "2"])
    assert resumed.finish() == 0, resumed.output[-4000:]
    assert f"mempo-trl: the final save in {out} was cut short: saving {out / 'checkpoint-2'} again." in resumed.output
    assert not (out / FINAL_SAVE_MARKER).exists() and (out / "mempo_metrics.json").is_file()
    assert main(ask) == 0


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("target", ["top", "group"])
def test_sigterm_to_a_two_process_launch_saves_a_checkpoint_and_ends_in_one_line(tmp_path, tiny_model_dir, target):
    """SIGTERM to `mempo-trl train` alone (`kill PID`, a container's PID 1) or to all its processes (Slurm, a
    terminal's process group)."""
    from helpers import free_port

    args = train_args(tmp_path, tiny_model_dir, max_steps=50, per_device_train_batch_size=2, num_generations=2)
    launch = ["--accelerate_config", "cpu_ddp", "--num_processes", "2", "--main_process_port", str(free_port())]
    run = Run([*args, *launch], new_session=True)  # a process group of its own
    run.wait_for("step 1/50", timeout=600)
    if target == "top":
        run.process.send_signal(signal.SIGTERM)
    else:
        os.killpg(run.process.pid, signal.SIGTERM)
    assert run.finish() == 2, run.output[-6000:]
    (error,) = run.errors()
    assert "ChildFailedError" not in run.output and "failed (exitcode" not in run.output, run.output[-6000:]
    step = int(error.split("after step ")[1].split("/")[0])
    checkpoint = tmp_path / "out" / f"checkpoint-{step}"
    assert error == (
        f"error: training stopped by SIGTERM after step {step}/50. Saved {checkpoint}; rerun with "
        f"--resume_from_checkpoint {checkpoint} to continue."
    )
    assert validate_checkpoint(checkpoint)["global_step"] == step
    assert (checkpoint / "rng_state_1.pth").is_file()  # saved by both processes


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("target", ["top", "launcher", "rank"])
def test_sigkill_to_a_two_process_launch_leaves_no_process(tmp_path, tiny_model_dir, target):
    """SIGKILL cannot be forwarded: to `mempo-trl train` (`kill -9`, `timeout -s KILL`, a scheduler) or to the
    launcher it started (the OOM killer), the processes below learn it from the parent-death signal (SIGTERM), save
    a checkpoint together and end; `mempo-trl train`, its launcher killed, exits 2 once they have. To a training
    process: the others end without a checkpoint. Either way none of the run's processes, followed through /proc, is
    left."""
    from helpers import ProcessTree, free_port

    args = train_args(tmp_path, tiny_model_dir, max_steps=100_000, per_device_train_batch_size=2, num_generations=2)
    launch = ["--accelerate_config", "cpu_ddp", "--num_processes", "2", "--main_process_port", str(free_port())]
    run = Run([*args, *launch], new_session=True)
    tree = ProcessTree(run.process.pid)
    try:
        run.wait_for("step 1/100000", timeout=600)
        (launcher,) = tree.root.children()
        ranks = launcher.children()
        assert len(ranks) == 2  # the training processes, in sessions of their own
        os.kill({"top": run.process.pid, "launcher": launcher.pid, "rank": ranks[-1].pid}[target], signal.SIGKILL)
        assert tree.wait_gone(timeout=240) == []
    finally:
        tree.kill()
    rc = run.finish()
    if target == "rank":
        return
    if target == "launcher":
        assert rc == 2, run.output[-4000:]  # as documented for a stopped run: the launcher's -9 is not the run's
    (error,) = run.errors()
    step = int(error.split("after step ")[1].split("/")[0])
    checkpoint = tmp_path / "out" / f"checkpoint-{step}"
    assert error.startswith(f"error: training stopped by SIGTERM after step {step}/100000. Saved {checkpoint};")
    assert validate_checkpoint(checkpoint)["global_step"] == step
    assert (checkpoint / "rng_state_1.pth").is_file()  # saved by both processes
