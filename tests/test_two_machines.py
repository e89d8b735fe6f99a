"""Two machines on one host, for real: two `mempo-trl train --num_machines 2 --machine_rank R` launches (one process
each, gloo on the CPU, `--num_processes 2` counting both) into one shared output directory, as on a cluster with a
shared file system. Only the main machine (machine_rank 0) claims, locks and cleans the directory and writes the
model, card and metrics; a stop signal to either machine saves one checkpoint and ends both, one line each; a machine
that dies or hangs ends the other in one line (within `ddp_timeout`) and leaves no process; resuming from the
checkpoint on two machines gives the same weights, bit for bit, as training straight through.
"""

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import TESTS_DIR, ProcessTree, cpu_recipe, free_port, record_as_run
from safetensors.torch import load_file

from mempo_trl.checkpoints import validate_checkpoint


pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SRC = str(Path(__file__).resolve().parents[1] / "src")  # this checkout's code, whatever is installed
MAX_STEPS = 30
FIELDS = {
    "max_steps": MAX_STEPS,
    "per_device_train_batch_size": 2,
    "num_generations": 2,
    "logging_steps": 1,
    "save_strategy": "no",
    "learning_rate": 1e-3,
    "seed": 7,
    "reward_funcs": ["helpers.reward_by_length"],
}
"""A run that moves the weights at every step (`reward_by_length`) and is long enough (steps of ~0.2 s) to stop."""


class Machine:
    """One machine's launch: `mempo-trl train ... --machine_rank rank` (or ``command``, a bare `accelerate
    launch`), in a session of its own, its output lines collected and its processes followed (`ProcessTree`)."""

    def __init__(self, rank: int, args: list[str], port: int, command: list[str] | None = None):
        machines = f"--num_machines 2 --machine_rank {rank} --main_process_ip 127.0.0.1 --main_process_port {port}"
        machines = [*machines.split(), "--num_processes", "2"]
        command = command or [sys.executable, "-m", "mempo_trl", "train", "--accelerate_config", "cpu_ddp"]
        env = {
            **os.environ,
            "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),  # DeepSpeed's ninja
            "PYTHONPATH": os.pathsep.join((SRC, str(TESTS_DIR))),
            "PYTHONUNBUFFERED": "1",
        }
        self.process = subprocess.Popen(
            [*command, *machines, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.tree = ProcessTree(self.process.pid)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(iter(self.process.stdout.readline, "")))
        self.reader.daemon = True
        self.reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    @property
    def last_words(self) -> str:
        """The last line with text: the launch's processes share the pipe, so a bare newline one of them writes at
        exit (a closed progress bar) can land after the command's own last line."""
        return next((line for line in reversed(self.lines) if line.strip()), "")

    def wait_for(self, text: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            assert self.process.poll() is None and time.monotonic() < deadline, self.output[-4000:]
            time.sleep(0.05)

    def finish(self, timeout: float = 600) -> int:
        rc = self.process.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return rc

    def errors(self) -> list[str]:
        assert "Traceback" not in self.output and "ChildFailedError" not in self.output, self.output[-4000:]
        return [line.rstrip("\n") for line in self.lines if line.startswith("error: ")]

    def all_processes(self) -> list:
        return [self.tree.root, *self.tree.root.children(recursive=True)]


def two_machines(args: list[str], first: int = 0, between=None, command=None) -> list[Machine]:
    """Start machine ``first``, call ``between(machine)`` once it has launched, then start the other."""
    port = free_port()
    started = {first: Machine(first, args, port, command)}
    try:
        if between is not None:
            between(started[first])
    except BaseException:
        started[first].tree.kill()  # it would wait for the other machine for minutes
        raise
    started[1 - first] = Machine(1 - first, args, port, command)
    return [started[0], started[1]]


def finish_both(machines: list[Machine]) -> list[int]:
    try:
        return [machine.finish() for machine in machines]
    finally:
        for machine in machines:
            machine.tree.kill()


def is_locked(directory: Path) -> bool:
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_model_dir):
    """A two-machine run straight to `MAX_STEPS`, machine 1 started first, into a directory holding an earlier run's
    output and a file of the user's (`--overwrite_output_dir true`). Returns (recipe, machines, what was seen while
    machine 1 waited for machine 0, and once machine 0 had started)."""
    tmp_path = tmp_path_factory.mktemp("straight")
    out = tmp_path / "out"
    out.mkdir()
    (out / "trajectories.jsonl").write_text("{}\n")
    record_as_run(out, "trajectories.jsonl")
    (out / "notes.txt").write_text("mine")
    recipe = cpu_recipe(tmp_path, tiny_model_dir, **FIELDS, overwrite_output_dir=True)
    seen = {}

    def look(machine_1):
        machine_1.wait_for("mempo-trl: launching")  # its checks are done; its launcher waits for machine 0
        seen["while machine 1 waits"] = sorted(p.name for p in out.iterdir()), is_locked(out)

    machines = two_machines(["--config", str(recipe)], first=1, between=look)
    try:
        machines[0].wait_for("mempo-trl: launching")
        seen["machine 0 started"] = is_locked(out)
        rcs = finish_both(machines)
    finally:
        for machine in machines:  # machine 0 refused: machine 1 would wait for it for minutes
            machine.tree.kill()
    assert rcs == [0, 0], machines[0].output[-3000:] + machines[1].output[-3000:]
    return recipe, machines, seen


def test_two_machines_share_one_output_directory_and_only_the_main_one_claims_it(straight, tiny_model_dir):
    recipe, (main, other), seen = straight
    out = recipe.parent / "out"
    # Machine 1 checked the directory but neither locked it nor deleted the earlier run's output; machine 0 locks it.
    assert seen["while machine 1 waits"] == (["_mempo_outputs.json", "notes.txt", "trajectories.jsonl"], False)
    assert seen["machine 0 started"] is True
    assert "world_size=2 distributed_type=MULTI_CPU model=DistributedDataParallel" in main.output
    assert f"model saved to {out}" in main.output and "model saved to" not in other.output
    assert other.last_words == (
        f"trained {MAX_STEPS} steps; the main machine (machine_rank 0) saved the model, metrics and model card "
        f"to {out}\n"
    )
    assert main.errors() == other.errors() == []
    names = {p.name for p in out.iterdir()}
    assert {"README.md", "mempo_metrics.json", "model.safetensors", "notes.txt"} <= names
    assert "trajectories.jsonl" not in names and "_mempo_run_going.json" not in names  # replaced, and released
    assert any(not torch.equal(t, weights(tiny_model_dir)[k]) for k, t in weights(out).items())  # it trained


def test_the_bare_accelerate_launch_on_two_machines_trains_the_same_weights(straight, tmp_path):
    recipe, _, _ = straight
    config = Path(SRC) / "mempo_trl" / "accelerate_configs" / "cpu_ddp.yaml"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    args = ["-m", "mempo_trl", "train", "--config", str(recipe), "--output_dir", str(tmp_path / "out")]
    machines = two_machines(args, command=[*command])
    assert finish_both(machines) == [0, 0], machines[0].output[-3000:] + machines[1].output[-3000:]
    assert f"model saved to {tmp_path / 'out'}" in machines[0].output
    reference = weights(recipe.parent / "out")
    assert all(torch.equal(t, reference[k]) for k, t in weights(tmp_path / "out").items())


def test_deepspeed_zero3_with_lora_on_two_machines(tmp_path, tiny_model_dir):
    recipe = cpu_recipe(tmp_path, tiny_model_dir, **{**FIELDS, "max_steps": 2})
    lora = ["--use_peft", "true", "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj"]
    command = [sys.executable, "-m", "mempo_trl", "train", "--accelerate_config", "cpu_zero3"]
    main, other = two_machines(["--config", str(recipe), *lora], command=command)
    assert finish_both([main, other]) == [0, 0], main.output[-3000:] + other.output[-3000:]
    assert "distributed_type=DEEPSPEED model=DeepSpeedEngine(PeftModelForCausalLM) zero_stage=3" in main.output
    out = tmp_path / "out"
    assert other.last_words.startswith("trained 2 steps; the main machine (machine_rank 0) saved the model")
    adapter = load_file(out / "adapter_model.safetensors")
    assert any(t.abs().max() > 0 for name, t in adapter.items() if "lora_B" in name)  # B starts at 0: it trained


@pytest.mark.parametrize("stopped", [0, 1])
def test_sigterm_to_either_machine_saves_one_checkpoint_ends_both_and_resumes_bit_exact(straight, tmp_path, stopped):
    recipe, _, _ = straight
    args = ["--config", str(recipe), "--output_dir", str(tmp_path / "out"), "--overwrite_output_dir", "false"]
    machines = two_machines(args)
    machines[0].wait_for(f"step 1/{MAX_STEPS}")
    machines[stopped].process.send_signal(signal.SIGTERM)
    assert finish_both(machines) == [2, 2], machines[0].output[-3000:] + machines[1].output[-3000:]
    (line,) = machines[0].errors()
    assert machines[1].errors() == [line]  # one line each
    step = int(line.split("after step ")[1].split("/")[0])
    checkpoint = tmp_path / "out" / f"checkpoint-{step}"
    assert line == (
        f"error: training stopped by SIGTERM after step {step}/{MAX_STEPS}. Saved {checkpoint}; rerun with "
        f"--resume_from_checkpoint {checkpoint} to continue."
    )
    assert step < MAX_STEPS and validate_checkpoint(checkpoint)["global_step"] == step
    assert (checkpoint / "rng_state_1.pth").is_file()  # machine 1's process saved its part
    assert [p.name for p in (tmp_path / "out").glob("checkpoint-*")] == [checkpoint.name]
    if stopped == 0:
        return  # the checkpoint is the same whichever machine got the signal: one resume checks it

    resumed = two_machines([*args, "--resume_from_checkpoint", str(checkpoint)])
    assert finish_both(resumed) == [0, 0], resumed[0].output[-3000:] + resumed[1].output[-3000:]
    reference = weights(recipe.parent / "out")
    assert all(torch.equal(t, reference[k]) for k, t in weights(tmp_path / "out").items())


@pytest.mark.parametrize("what", ["SIGKILL to machine 1's top process", "machine 0 killed", "machine 1 hangs"])
def test_a_machine_killed_or_hung_ends_the_other_in_one_line_and_leaves_no_process(straight, tmp_path, what):
    """A SIGKILL to one machine's `mempo-trl train` reaches its processes as SIGTERM (the parent-death signal): the
    group is whole, so both machines save a checkpoint. A machine killed whole (every process: a machine lost) or
    hung (stopped: a machine unreachable) leaves the other's processes in a collective that fails at once
    (connection reset or closed) or after `ddp_timeout` (10 s here, 1800 s by default): they end with one line. The
    main machine survives the hang (and a kill of machine 1 the same way, by the same `PeerLost` path); machine 1
    survives the main machine's death."""
    recipe, _, _ = straight
    args = ["--config", str(recipe), "--output_dir", str(tmp_path / "out"), "--overwrite_output_dir", "false"]
    machines = two_machines([*args, "--max_steps", "100000", "--ddp_timeout", "10"])
    victim = 0 if what == "machine 0 killed" else 1
    survivor = machines[1 - victim]
    try:
        machines[0].wait_for("step 2/100000")
        if what == "SIGKILL to machine 1's top process":
            machines[1].process.kill()
        else:
            for process in machines[victim].all_processes():
                if what == "machine 1 hangs":
                    process.suspend()
                else:
                    process.kill()
        assert survivor.finish() == 2, survivor.output[-3000:]
        if what == "machine 1 hangs":  # the machine comes back, or its job is cancelled: it ends too
            for process in machines[victim].all_processes():
                process.kill()
        assert [machine.tree.wait_gone(timeout=120) for machine in machines] == [[], []]
    finally:
        finish_both(machines)
    (line,) = survivor.errors()
    if what == "SIGKILL to machine 1's top process":
        step = int(line.split("after step ")[1].split("/")[0])
        assert line.startswith(f"error: training stopped by SIGTERM after step {step}/100000. Saved")
        assert validate_checkpoint(tmp_path / "out" / f"checkpoint-{step}")["global_step"] == step
        return
    step = int(line.split("after step ")[1].split(":")[0])
    # gloo names a lost peer's socket as reset or closed, whichever its read or write sees first
    reasons = ["Timed out waiting 10000ms"] if what == "machine 1 hangs" else ["reset by peer", "closed by peer"]
    assert line.startswith(f"error: training stopped after step {step}: another process of the run ended or stopped")
    assert any(reason in line for reason in reasons) and "ddp_timeout=10 s" in line, line
    assert line.endswith("Nothing can be saved without it: no checkpoint was saved yet, start every machine again.")
