"""Nothing of a run outlives it: every process a run starts ends when the process that started it dies.

Stop signals (SIGTERM, SIGINT, SIGHUP) are forwarded down the run's processes (`mempo_trl.commands.launch`). SIGKILL
(`kill -9`, the OOM killer, `timeout -s KILL`, a scheduler) cannot be caught, so it cannot be forwarded: instead each
process a run starts asks Linux for a parent-death signal (``prctl(PR_SET_PDEATHSIG)``). `mempo-trl train` names
itself to the launcher it starts, the launcher to the processes it starts (`child_env`), and each calls
`end_with_parent` first thing: when its parent dies, it receives SIGTERM and ends as on a stop signal (a launcher
forwards it; a training process saves a checkpoint with the others and exits 2). Elsewhere than on Linux nothing is
armed.

Processes a library starts for us, such as vLLM's engine (started through multiprocessing's spawn, where no code of
ours runs first), are handed to a `Reaper`: a small watchdog process that ends them once their owner is gone, however
it ended.
"""

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path


PARENT_PID_ENV = "MEMPO_PARENT_PID"
"""The environment variable by which a run's process names itself to the processes it starts."""

PR_SET_PDEATHSIG = 1
"""`prctl` option: the signal this process receives when its parent dies (linux/prctl.h)."""

PR_SET_CHILD_SUBREAPER = 36
"""`prctl` option: orphaned descendants of this process become its children, not init's (linux/prctl.h)."""


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) naming this process as the parent that children end with."""
    return {**(os.environ if env is None else env), PARENT_PID_ENV: str(os.getpid())}


def end_with_parent(signum: int = signal.SIGTERM) -> bool:
    """If a run's process started this one (`PARENT_PID_ENV` names this process's parent), receive ``signum`` when it
    dies (Linux only). The variable is removed, so that it names no one to this process's own children. Returns
    whether the signal is armed.

    A variable naming another process (a wrapper such as ``timeout`` or ``uv run`` sits between, or the variable was
    copied from a run's environment) is ignored, in one line. So is one naming a process that is gone, unless this
    process was orphaned (its parent is now init): the run's process died before this one could ask for the signal,
    and it is sent at once, with a line naming the variable. The kernel sends the signal when the thread that started
    this process ends: the run's processes start theirs from their main thread.
    """
    parent = os.environ.pop(PARENT_PID_ENV, "")
    if not parent.isdigit() or not sys.platform.startswith("linux"):
        return False
    if os.getppid() != int(parent):
        return _parent_gone(int(parent), signum)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        return False
    if os.getppid() != int(parent):  # it died before the request: nothing will send the signal
        return _parent_gone(int(parent), signum)
    return True


def _parent_gone(parent: int, signum: int) -> bool:
    """`end_with_parent` for a ``parent`` that is not this process's parent: ``signum`` to this process if it was
    orphaned and ``parent`` is gone, else nothing; one line either way. Returns False."""
    orphaned = os.getppid() == 1 and not _alive(parent)
    action = "ending, as it does when that process dies" if orphaned else "not ending with it"
    what = "is gone and this process was orphaned" if orphaned else "is not this process's parent"
    print(
        f"mempo-trl: {PARENT_PID_ENV}={parent} names the run's process that started this one, but that process "
        f"{what}: {action} (unset {PARENT_PID_ENV} if it was not meant for this command).",
        file=sys.stderr,
        flush=True,
    )
    if orphaned:
        os.kill(os.getpid(), signum)
    return False


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` runs (whoever owns it; a zombie, dead but not yet reaped, does not)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def adopt_orphans() -> bool:
    """Make this process the one its orphaned descendants are handed to (Linux only): when a process it started
    dies, that one's children become this process's, so `wait_adopted` can wait for them and read their exit codes.
    Returns whether it holds."""
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def wait_adopted() -> list[int]:
    """Wait until every child of this process (those `adopt_orphans` handed to it included) has ended; their exit
    codes, negative for a signal, as `subprocess` reports them."""
    codes = []
    while True:
        try:
            _, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return codes
        codes.append(os.waitstatus_to_exitcode(status))


def bound_collectives(seconds: int) -> None:
    """Give the default process group, if there is one, a timeout of ``seconds`` (`ddp_timeout`): a collective that
    waits longer for a process that ended or stopped answering (a machine gone) raises instead of hanging.

    transformers passes `ddp_timeout` to the process group it starts on GPUs but not with `use_cpu` (gloo), where
    torch's default of 30 minutes would apply.
    """
    from datetime import timedelta

    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))


ROOT = str(Path(__file__).resolve().parents[1])
"""The directory `mempo_trl` is imported from (a `Reaper` imports it from there too)."""

REAP_GRACE_SECONDS = 10.0
"""How long a `Reaper` waits for the processes it ends to finish after SIGTERM, before SIGKILL."""


def new_children(before: Collection[int]) -> list:
    """This process's descendants (`psutil.Process`) whose pids are not in ``before``, but multiprocessing's resource
    tracker: it ends by itself once the processes that use it have, and cleans up after them."""
    from multiprocessing import resource_tracker

    import psutil

    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.pid != tracker]


class Reaper:
    """A watchdog process that ends ``processes`` (`psutil.Process`es this process started) once this process is
    gone, however it ended (SIGKILL included): SIGTERM, then SIGKILL to those left after `REAP_GRACE_SECONDS`.

    It reads a pipe whose writing end only this process holds, so it learns of the end at once; it ignores the stop
    signals (a terminal's Ctrl-C reaches the whole process group) and ends after its work. `close` (after shutting
    the processes down the ordinary way) ends it the same way, at once if they are gone.
    """

    def __init__(self, processes: Collection):
        code = f"import sys; sys.path.insert(0, {ROOT!r}); from mempo_trl.processes import reap; reap(sys.stdin)"
        self.process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, text=True)
        self.process.stdin.write("".join(f"{p.pid} {p.create_time()!r}\n" for p in processes))
        self.process.stdin.flush()

    def close(self) -> None:
        """End the watchdog now (it ends what is left of its processes first); idempotent."""
        if not self.process.stdin.closed:
            self.process.stdin.close()
        self.process.wait()


def reap(lines) -> None:
    """The watchdog's side of `Reaper`: read ``pid create_time`` lines until the pipe ends, then end those processes
    that still run (a pid reused by another process since is left alone)."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    import psutil

    processes = []
    for line in lines:
        pid, created = line.split()
        try:
            process = psutil.Process(int(pid))
        except psutil.NoSuchProcess:
            continue
        if abs(process.create_time() - float(created)) < 0.01:
            processes.append(process)
    running = [p for p in processes if p.is_running()]
    for process in running:
        process.terminate()
    _, left = psutil.wait_procs(running, timeout=REAP_GRACE_SECONDS)
    for process in left:
        process.kill()
