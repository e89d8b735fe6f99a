"""Where a command writes: checked before any long work, so that a run never does the work and then loses it.

Every command calls one of these first: `prepare_output_dir` (a directory of results: writable, and an existing
non-empty one is resumed, overwritten on request or refused), `check_writable` (a cache or other directory that is
expected to hold things already), `check_port` (a port a server will listen on) and `check_report_to` (logging
backends). Each raises `OutputError` with one sentence naming the path and the fix.
"""

import errno
import importlib.util
import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from mempo_trl.checkpoints import newest_complete_checkpoint


PROBE_PREFIX = ".mempo-write-probe-"
REPORT_TO_PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "trackio": ("trackio",),
    "mlflow": ("mlflow",), "comet_ml": ("comet_ml",), "clearml": ("clearml",), "neptune": ("neptune",),
    "dvclive": ("dvclive",), "swanlab": ("swanlab",), "codecarbon": ("codecarbon",), "azure_ml": ("azureml",),
}  # fmt: skip


class OutputError(ValueError):
    """An output that cannot be written, or an existing result that would be overwritten; the message says which."""


@dataclass
class OutputArguments:
    """`--overwrite_output_dir`, for commands that write an `output_dir` (training has it in its own arguments)."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Write into an `output_dir` that already holds results (nothing is deleted first)."},
    )


def check_writable(directory: str | os.PathLike, what: str = "output directory") -> Path:
    """Create `directory` (and its parents) if needed, then create and remove a probe file in it.

    Example:
        >>> check_writable("/proc/outputs")
        Traceback (most recent call last):
        mempo_trl.outputs.OutputError: output directory /proc/outputs cannot be written (...). Choose another ...
    """
    path = Path(directory).expanduser()
    if path.exists() and not path.is_dir():
        raise OutputError(f"{what} {path} is a file, not a directory. Choose a directory path.")
    probe = path / f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    try:
        path.mkdir(parents=True, exist_ok=True)  # kept: the processes of a distributed run probe it concurrently
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise OutputError(
            f"{what} {path} cannot be written ({reason}). Choose another path or fix its permissions."
        ) from None
    return path


def prepare_output_dir(
    directory: str | os.PathLike,
    overwrite: bool = False,
    resume: bool | str | None = None,
    check_existing: bool = True,
) -> Path:
    """Check that `directory` can be written and holds no earlier results unless resuming or told to overwrite.

    An existing non-empty directory is accepted when `resume` is set (training continues from its checkpoint) or
    `overwrite` is true (its files are replaced as they are written; nothing is deleted); otherwise `OutputError`
    says so. `check_existing=False` checks only that it can be written (the other processes of a distributed run).

    Example:
        >>> prepare_output_dir("outputs/run1")  # outputs/run1 holds a model from an earlier run
        Traceback (most recent call last):
        mempo_trl.outputs.OutputError: output directory outputs/run1 already holds results (README.md, ...). ...
    """
    if isinstance(resume, str) and resume.lower() != "true" and not Path(resume).is_dir():
        raise OutputError(f"checkpoint {resume} to resume from does not exist. Pass a checkpoint-N directory.")
    path = check_writable(directory)
    existing = sorted(p.name for p in path.iterdir() if not p.name.startswith(PROBE_PREFIX))
    if check_existing and existing and not overwrite and not resume:
        shown = ", ".join(existing[:3]) + (", ..." if len(existing) > 3 else "")
        newest = newest_complete_checkpoint(path)
        resume_hint = f"--resume_from_checkpoint {newest} to continue it, " if newest else ""
        raise OutputError(
            f"output directory {path} already holds results ({shown}). Pass {resume_hint}--overwrite_output_dir to "
            "replace them, or choose another output directory."
        )
    return path


def check_report_to(report_to: list[str] | str | None) -> None:
    """Check that the package of every `report_to` logging backend is installed (before the run, not at its end).

    Example:
        >>> check_report_to(["tensorboard"])  # tensorboard not installed
        Traceback (most recent call last):
        mempo_trl.outputs.OutputError: --report_to tensorboard needs the tensorboard package: pip install ...
    """
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    for name in names:
        packages = REPORT_TO_PACKAGES.get(name, ())
        if packages and not any(importlib.util.find_spec(package) for package in packages):
            raise OutputError(
                f"--report_to {name} needs the {packages[0]} package: pip install {packages[0]}, or log elsewhere "
                "(--report_to none)."
            )


def check_port(host: str, port: int) -> None:
    """Check that `port` is a valid TCP port that `host` can listen on now (bind a socket, then close it).

    Example:
        >>> check_port("127.0.0.1", 70000)
        Traceback (most recent call last):
        mempo_trl.outputs.OutputError: port 70000 is out of range: use 1-65535 (0 picks a free one).
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise OutputError(f"port {port!r} is out of range: use 1-65535 (0 picks a free one).")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OutputError(f"cannot listen on host {host!r}: {e.strerror}. Use an IP address or 'localhost'.") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            reason = "it is already in use" if e.errno == errno.EADDRINUSE else e.strerror
            raise OutputError(f"cannot listen on {host}:{port}: {reason}. Choose another --port or --host.") from None
