"""Nothing of a run outlives it (`mempo_trl.processes`): a process started by a run's process ends when that one is
killed, even by SIGKILL, and a `Reaper` ends what a library started for its owner (vLLM's engine, through
multiprocessing's spawn). Every process is real; what is left is followed through /proc (`helpers.ProcessTree`).
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ProcessTree

from mempo_trl.processes import PARENT_PID_ENV, ROOT


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")

ENV = {**os.environ, "PYTHONPATH": ROOT}


def _start(code: str, **env: str) -> subprocess.Popen:
    """A Python process running ``code``; it prints ``ready`` once set up."""
    return subprocess.Popen(
        [sys.executable, "-c", code], env={**ENV, **env}, stdout=subprocess.PIPE, text=True, start_new_session=True
    )


def _wait_ready(process: subprocess.Popen) -> None:
    assert process.stdout.readline().strip() == "ready", process.poll()


def test_a_process_whose_parent_died_before_it_asked_ends_at_once():
    """The run's process dies before its child asks for the signal (the child waits until it is orphaned): the child
    ends at once by SIGTERM, saying why."""
    child = (
        "import os, time; from mempo_trl.processes import PARENT_PID_ENV, end_with_parent\n"
        "while os.getppid() == int(os.environ[PARENT_PID_ENV]): time.sleep(0.01)\n"
        "end_with_parent(); print('not ended', flush=True); time.sleep(60)"
    )
    parent = (
        "import os, subprocess, sys; from mempo_trl.processes import child_env; "
        f"subprocess.Popen([sys.executable, '-c', {child!r}], env=child_env()); os._exit(0)"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", parent], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = process.communicate(timeout=60)  # EOF: the orphaned child, which holds the pipes, has ended too
    assert out == ""
    assert f"{PARENT_PID_ENV}=" in err and "is gone and this process was orphaned: ending" in err


@pytest.mark.parametrize(("command", "named"), [("train", "init"), ("sft", "gone")])
def test_a_stray_parent_pid_does_not_stop_the_training_commands(command, named, tmp_path):
    """`mempo-trl train` and `mempo-trl sft` arm the signal first thing (a lab script starts them with `child_env`).
    A variable naming another process than their parent (a wrapper sits between, or it was copied from a run's
    environment) is ignored in one line, whether that process runs (init) or is gone: the command goes on (here: to
    the error about the missing model directory, exit 2) instead of ending silently by SIGTERM."""
    pid = 1 if named == "init" else os.getpid() + 1_000_000
    process = subprocess.run(
        [
            sys.executable,
            "-m",
            "mempo_trl",
            command,
            "--model_name_or_path",
            str(tmp_path / "no_model"),
            "--output_dir",
            str(tmp_path / "out"),
        ],
        env={**ENV, PARENT_PID_ENV: str(pid)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert process.returncode == 2, process.stderr[-3000:]
    assert (
        f"mempo-trl: {PARENT_PID_ENV}={pid} names the run's process that started this one, but that process is not "
        f"this process's parent: not ending with it (unset {PARENT_PID_ENV} if it was not meant for this command)."
    ) in process.stderr
    assert "error: " in process.stdout + process.stderr


def test_a_child_ends_with_its_parent_killed_by_sigkill():
    child = (
        "from mempo_trl.processes import end_with_parent; end_with_parent(); import time; print('ready', flush=True); "
        "time.sleep(120)"
    )  # it says so once armed
    parent = (
        "import subprocess, sys, time; from mempo_trl.processes import child_env; "
        f"subprocess.Popen([sys.executable, '-c', {child!r}], env=child_env()); time.sleep(120)"
    )
    process = _start(parent)
    tree = ProcessTree(process.pid)
    try:
        _wait_ready(process)
        tree.wait_seen(1)
        os.kill(process.pid, signal.SIGKILL)
        assert tree.wait_gone(timeout=60) == []
    finally:
        tree.kill()
        process.wait()


def test_a_reaper_ends_what_its_owner_started_when_the_owner_is_killed(tmp_path):
    """The owner starts a process through multiprocessing's spawn (as vLLM starts its engine on a CPU): no code of
    ours runs in it first, and it has a child of its own. SIGKILL to the owner: the reaper ends both, then itself, and
    multiprocessing's resource tracker ends by itself."""
    script = Path(tmp_path, "owner.py")
    script.write_text(
        "import multiprocessing, subprocess, sys, time\n"
        "from mempo_trl.processes import Reaper, new_children\n"
        "def engine():\n"
        "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "    time.sleep(120)\n"
        "if __name__ == '__main__':\n"
        "    multiprocessing.get_context('spawn').Process(target=engine).start()\n"
        "    while len(new_children(set())) < 2:\n"
        "        time.sleep(0.1)\n"
        "    reaper = Reaper(new_children(set()))\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(120)\n"
    )
    process = subprocess.Popen(
        [sys.executable, str(script)], env=ENV, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    tree = ProcessTree(process.pid)
    try:
        _wait_ready(process)
        tree.wait_seen(4)  # the engine, its child, the reaper and multiprocessing's resource tracker
        os.kill(process.pid, signal.SIGKILL)
        assert tree.wait_gone(timeout=60) == []
    finally:
        tree.kill()
        process.wait()
