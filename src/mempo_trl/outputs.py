"""Where a command writes: checked before any long work, so that a run never does the work and then loses it.

Every command calls one of these first: `claim_output_dir` (a directory of results: apart from the inputs, locked for
the run, and an existing one is resumed, overwritten on request or refused; `prepare_output_dir` checks without
claiming), `check_writable` (a cache or other directory that is expected to hold things already), `check_port` (a
port a server will listen on) and `check_report_to` (logging backends). Each raises `OutputError` with one sentence
naming the path and the fix.

A run records the entries it writes in `RUN_RECORD` when it ends. `--overwrite_output_dir` deletes only a previous
run's outputs (`run_outputs`): what its record names, `checkpoint-N`, and the files a run writes by name (weights,
config, tokenizer, card, ...) in a directory a run has written to; any other file is kept.
"""

import atexit
import errno
import fcntl
import importlib.util
import json
import os
import re
import shutil
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from mempo_trl.checkpoints import checkpoint_step, checkpoints_by_step, newest_complete_checkpoint


PROBE_PREFIX = ".mempo-write-probe-"
RUN_RECORD = "_mempo_outputs.json"
"""The entries runs wrote into an output directory (`_` keeps it off the Hub, as TRL's `push_to_hub` skips `_*`)."""
RUN_MARKERS = re.compile(
    r"checkpoint-\d+|mempo_metrics\.json|mempo_agent\.json|mempo_save_incomplete\.json|results\.json|"
    r"trajectories\.jsonl|" + re.escape(RUN_RECORD)
)
"""Names only a mempo-trl run writes: a directory holding one is a run's output directory."""
RUN_FILES = re.compile(
    r"README\.md|config\.json|generation_config\.json|(model|adapter_model)(-\d+-of-\d+)?\.safetensors|"
    r"(model|adapter_model)\.safetensors\.index\.json|pytorch_model.*\.bin|adapter_config\.json|"
    r"tokenizer(_config)?\.json|tokenizer\.model|special_tokens_map\.json|added_tokens\.json|vocab\.json|"
    r"merges\.txt|chat_template\.(jinja|json)|training_args\.bin|base_model|runs|context_tokens\.png"
)
"""Names a run writes that other things use too (a project's README.md): a run's only where a marker is."""
HELD_ENV = "MEMPO_OUTPUT_DIR_HELD"
"""Set by the process that holds the output directory's lock, for the processes it launches (they skip the lock)."""
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
        metadata={"help": "Replace the results of an earlier run in `output_dir` (they are deleted first; other files "
                  "there are kept), or write into a directory that holds other files."},
    )  # fmt: skip


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
    inputs: dict | None = None,
) -> Path:
    """Check that `directory` is apart from `inputs`, can be written, and holds no earlier results unless resuming
    or told to overwrite.

    `inputs` maps what each input is ("model") to its path; an output directory that is, contains or
    lies inside one of them is refused, as is one that resolves to `/`, the home directory or a directory above the
    current one. An existing directory with a previous run's outputs (`run_outputs`) is accepted when `resume` is set
    or `overwrite` is true; one with only other files when `overwrite` is true, unless one of them has a name a run
    writes (a project's README.md). `check_existing=False` checks only that it can be written (the other processes of
    a distributed run). Does not lock: `claim_output_dir` does.

    Example:
        >>> prepare_output_dir("outputs/run1")  # outputs/run1 holds a model from an earlier run
        Traceback (most recent call last):
        mempo_trl.outputs.OutputError: output directory outputs/run1 already holds results (README.md, ...). ...
    """
    if isinstance(resume, str) and resume.lower() != "true" and not Path(resume).is_dir():
        raise OutputError(f"checkpoint {resume} to resume from does not exist. Pass a checkpoint-N directory.")
    check_apart(directory, inputs or {})
    path = check_writable(directory)
    if check_existing:
        check_existing_entries(path, overwrite, resume)
    return path


def check_apart(directory: str | os.PathLike, inputs: dict) -> None:
    """`OutputError` if `directory` resolves to `/`, the home directory or a directory above the current one, or
    is, contains or lies inside an existing input path of `inputs` (what it is -> a path or a list of paths)."""
    path = Path(directory).expanduser()
    target = path.resolve()
    link = f" (a link to {target})" if path.is_symlink() else ""
    if target == Path(target.anchor) or target == Path.home().resolve() or target in Path.cwd().resolve().parents:
        raise OutputError(
            f"output directory {path}{link} is {target}, a directory that holds far more than results. "
            "Choose a directory of its own (outputs/run1)."
        )
    named = [(what, one) for what, given in inputs.items() for one in (given if isinstance(given, list) else [given])]
    for what, given in named:
        if not isinstance(given, str | os.PathLike) or not Path(given).expanduser().exists():
            continue  # a Hub id, a dataset name or a URL: nothing on disk to overlap
        source = Path(given).expanduser().resolve()
        relation = (
            "is" if target == source else "contains" if target in source.parents
            else "lies inside" if source in target.parents else None
        )  # fmt: skip
        if relation:
            raise OutputError(
                f"output directory {path}{link} {relation} the {what} {given}: results and inputs would mix. "
                "Choose another output directory."
            )


def check_existing_entries(path: Path, overwrite: bool, resume: bool | str | None) -> None:
    """`OutputError` if `path` holds a previous run's outputs and neither `overwrite` nor `resume` is set, holds
    other files and `overwrite` is not set, or holds other files with names a run writes."""
    names = entries(path)
    results = run_outputs(path)
    if not names or resume:
        return
    others = [name for name in names if name not in results]
    if not results and any(RUN_FILES.fullmatch(name) for name in others):
        clashing = [name for name in others if RUN_FILES.fullmatch(name)]
        raise OutputError(
            f"output directory {path} holds {shown(clashing)}, which no mempo-trl run recorded and a run would "
            "overwrite. Move them away or choose another output directory."
        )
    if overwrite:
        if path.is_symlink() and results:
            raise OutputError(
                f"output directory {path} is a link to {path.resolve()}: --overwrite_output_dir deletes nothing "
                f"through a link. Pass {path.resolve()} itself, or choose another output directory."
            )
        return
    target = path.resolve() if path.is_symlink() else path
    if results:
        newest = newest_complete_checkpoint(path)
        resume_hint = f"--resume_from_checkpoint {newest} to continue it, " if newest else ""
        raise OutputError(
            f"output directory {path} already holds results ({shown(results)}). Pass {resume_hint}"
            f"--overwrite_output_dir{f' with {target}' if target != path else ''} to replace them (other files "
            "there are kept), or choose another output directory."
        )
    raise OutputError(
        f"output directory {path} holds other files ({shown(names)}). Pass --overwrite_output_dir"
        f"{f' with {target}' if target != path else ''} to write into it (they are kept), or choose another "
        "output directory."
    )


def shown(names: list[str]) -> str:
    """The first three of `names`, comma-separated (then ", ...")."""
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def entries(path: Path) -> list[str]:
    """The names in `path`, sorted, without other processes' write probes."""
    return sorted(p.name for p in path.iterdir() if not p.name.startswith(PROBE_PREFIX))


def run_outputs(directory: str | os.PathLike) -> list[str]:
    """The names in `directory` that mempo-trl runs wrote: those `RUN_RECORD` lists, `RUN_MARKERS` (`checkpoint-N`,
    `mempo_metrics.json`, ...) and, where one of those is present, `RUN_FILES` (weights, config, tokenizer, card).

    Example:
        >>> run_outputs("outputs/run1")  # a finished run, plus the user's notes.txt
        ['README.md', '_mempo_outputs.json', 'config.json', 'mempo_agent.json', 'mempo_metrics.json', ...]
    """
    path = Path(directory)
    names = entries(path) if path.is_dir() else []
    recorded = set(read_record(path))
    marked = recorded.union(name for name in names if RUN_MARKERS.fullmatch(name))
    return [name for name in names if name in marked or (marked and RUN_FILES.fullmatch(name))]


def read_record(path: Path) -> list[str]:
    """The names `RUN_RECORD` of `path` lists (none when it is missing or unreadable)."""
    try:
        written = json.loads((path / RUN_RECORD).read_text(encoding="utf-8")).get("written", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [name for name in written if isinstance(name, str) and "/" not in name and name not in ("", ".", "..")]


def remove_run_outputs(directory: str | os.PathLike) -> list[str]:
    """Delete the previous runs' outputs of `directory` (`run_outputs`; a link is removed, never followed) and keep
    every other file. Returns the names removed."""
    path = Path(directory)
    removed = run_outputs(path)
    for name in removed:
        entry = path / name
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink(missing_ok=True)
    return removed


@dataclass
class OutputClaim:
    """An output directory this process holds locked (`fcntl.flock` on the directory itself; the OS releases it when
    the process ends, however it ends) and the entries it held when claimed."""

    path: Path
    fd: int
    before: set[str]

    def release(self) -> None:
        """Add the entries that appeared since the claim to `RUN_RECORD`, then unlock."""
        try:
            written = set(entries(self.path)) - self.before
            if written:
                names = sorted(written.union(read_record(self.path)) | {RUN_RECORD})
                (self.path / RUN_RECORD).write_text(json.dumps({"written": names}, indent=2) + "\n", encoding="utf-8")
        except OSError:
            pass  # the directory went away or cannot be written: nothing to record
        finally:
            os.close(self.fd)


CLAIMS: dict[Path, OutputClaim] = {}
"""The output directories this process holds, by resolved path."""


def claim_output_dir(
    directory: str | os.PathLike,
    overwrite: bool = False,
    resume: bool | str | None = None,
    inputs: dict | None = None,
) -> Path:
    """`prepare_output_dir`, holding `directory` locked against other runs until `release_output_dirs` (at the
    latest, when this process exits); with `overwrite` (and no `resume`), the previous run's outputs are deleted and
    named. A directory another process holds is refused. Processes launched by the holder (`HELD_ENV`) share its
    claim.

    Example:
        >>> claim_output_dir("outputs/run1")  # another `mempo-trl train` is writing there
        Traceback (most recent call last):
        mempo_trl.outputs.OutputError: output directory outputs/run1 is in use by another mempo-trl run ...
    """
    path = prepare_output_dir(directory, resume=resume, check_existing=False, inputs=inputs)
    key = path.resolve()
    if key not in CLAIMS and os.environ.get(HELD_ENV) != str(key):
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                raise OutputError(
                    f"output directory {path} is in use by another mempo-trl run. Wait for it to end, or choose "
                    "another output directory."
                ) from None
            print(f"mempo-trl: WARNING: output directory {path} cannot be locked ({e.strerror}): a second run into "
                  "it would not be refused.")  # fmt: skip
        CLAIMS[key] = OutputClaim(path, fd, set(entries(path)))
        os.environ[HELD_ENV] = str(key)
    check_existing_entries(path, overwrite, resume)
    if overwrite and not resume:
        removed = remove_run_outputs(path)
        if removed:
            print(f"--overwrite_output_dir: removed the previous run's {', '.join(removed)} from {path}")
            if key in CLAIMS:
                CLAIMS[key].before -= set(removed)
    return path


def release_output_dirs() -> None:
    """Release every output directory this process claimed (`OutputClaim.release`); also run at exit."""
    while CLAIMS:
        key, claim = CLAIMS.popitem()
        claim.release()
        if os.environ.get(HELD_ENV) == str(key):
            del os.environ[HELD_ENV]


atexit.register(release_output_dirs)


def drop_abandoned_checkpoints(output_dir: str | os.PathLike, resume: str | None) -> list[str]:
    """Delete the `checkpoint-N` of `output_dir` later than the checkpoint `resume` continues from: they belong to
    the branch of the run that resuming from an earlier step abandons, and `--resume_from_checkpoint true` must never
    pick them. Returns the names removed (and prints them)."""
    step = checkpoint_step(resume) if resume else None
    if step is None:
        return []
    later = [p for p in checkpoints_by_step(output_dir) if checkpoint_step(p) > step and not p.is_symlink()]
    for checkpoint in later:
        shutil.rmtree(checkpoint)
    if later:
        print(
            f"resuming from {resume}: removed the later {', '.join(p.name for p in later)} of the run it continued "
            "before (a branch this resume abandons)"
        )
    return [p.name for p in later]


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
