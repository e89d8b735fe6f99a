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


def test_a_process_whose_parent_is_already_gone_ends_at_once():
    code = "from mempo_trl.processes import end_with_parent; end_with_parent(); import time; time.sleep(60)"
    # It names a parent that is not its parent: that one died before it could ask for the signal.
    process = _start(code, **{PARENT_PID_ENV: str(os.getpid() + 1_000_000)})
    assert process.wait(timeout=60) == -signal.SIGTERM


@pytest.mark.parametrize("command", ["train", "sft"])
def test_the_training_commands_end_when_the_process_that_started_them_is_gone(command, tmp_path):
    """`mempo-trl train` and `mempo-trl sft` arm the signal first thing (a lab script or a user's wrapper starts them
    with `child_env`): named a parent that is gone, each ends by SIGTERM instead of going on (here: to the error
    about the missing model directory, exit 2)."""
    missing = tmp_path / "no_model"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mempo_trl",
            command,
            "--model_name_or_path",
            str(missing),
            "--output_dir",
            str(tmp_path),
        ],
        env={**ENV, PARENT_PID_ENV: str(os.getpid() + 1_000_000)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert process.wait(timeout=300) == -signal.SIGTERM


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
