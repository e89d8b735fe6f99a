"""Where a command writes: checked before any long work, so that a run never does the work and then loses it.

Every command calls one of these first: `claim_output_dir` (a directory of results: apart from the inputs, locked for
the run, and an existing one is resumed, overwritten on request or refused; `prepare_output_dir` checks without
claiming), `check_writable` (a cache or other directory that is expected to hold things already), `check_port` (a
port a server will listen on) and `check_report_to` (logging backends). Each raises `OutputError` with one sentence
naming the path and the fix.

A run notes what was in the directory when it claims it (`RUN_GOING`) and records the entries it wrote, each with its
`fingerprint`, when it ends (`RUN_RECORD`). `--overwrite_output_dir` deletes only a previous run's outputs
(`run_outputs`), and only once the new run's inputs are checked: recorded entries that still match their fingerprint
and, after a run that never ended (killed), the entries with a name a run writes that appeared after it began. Names
alone prove nothing: a name a run writes that no run recorded is refused, and any other file is kept.
"""

import atexit
import errno
import fcntl
import hashlib
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
RUN_GOING = "_mempo_run_going.json"
"""The entries that were in an output directory before the run writing there now: removed when the run ends, so
one left behind names what a killed run found."""
RECORDS = (RUN_RECORD, RUN_GOING)
RUN_NAMES = re.compile(
    r"checkpoint-\d+|mempo_metrics\.json|mempo_agent\.json|mempo_save_incomplete\.json|results\.json|"
    r"trajectories\.jsonl|_mempo_outputs\.json|_mempo_run_going\.json|"
    r"README\.md|config\.json|generation_config\.json|(model|adapter_model)(-\d+-of-\d+)?\.safetensors|"
    r"(model|adapter_model)\.safetensors\.index\.json|pytorch_model.*\.bin|adapter_config\.json|"
    r"tokenizer(_config)?\.json|tokenizer\.model|special_tokens_map\.json|added_tokens\.json|vocab\.json|"
    r"merges\.txt|chat_template\.(jinja|json)|training_args\.bin|base_model|runs|rollouts|context_tokens\.png"
)
"""Names a run writes (many used by other things too: a project's README.md). One that no run recorded is never
deleted, and never written over: a directory holding one is refused."""
HELD_ENV = "MEMPO_OUTPUT_DIR_HELD"
"""Set by the process that holds the output directory's lock, for the processes it launches (they skip the lock)."""
REPORT_TO_PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboardX"),
    "wandb": ("wandb",),
    "trackio": ("trackio",),
    "mlflow": ("mlflow",),
    "comet_ml": ("comet_ml",),
    "clearml": ("clearml",),
    "neptune": ("neptune",),
    "dvclive": ("dvclive",),
    "swanlab": ("swanlab",),
    "codecarbon": ("codecarbon",),
    "azure_ml": ("azureml",),
}


class OutputError(ValueError):
    """An output that cannot be written, or an existing result that would be overwritten; the message says which."""


@dataclass
class OutputArguments:
    """`--overwrite_output_dir`, for commands that write an `output_dir` (training has it in its own arguments)."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Replace the results of an earlier run in `output_dir` (they are deleted first; other files "
            "there are kept), or write into a directory that holds other files."
        },
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
    inputs: dict | None = None,
) -> Path:
    """Check that `directory` is apart from `inputs`, can be written, and holds no earlier results unless resuming
    or told to overwrite.

    `inputs` maps what each input is ("model") to its path; an output directory that is, contains or
    lies inside one of them is refused, as is one that resolves to `/`, the home directory or a directory above the
    current one. An existing directory with a previous run's outputs (`run_outputs`) is accepted when `resume`
    continues that run (`resumes_inside`) or `overwrite` is true; one with only other files when `overwrite` is true,
    unless one of them has a name a run writes that no run recorded (a project's README.md). `check_existing=False`
    checks only that it can be written (the other processes of a distributed run). Does not lock: `claim_output_dir`
    does.

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
            "is"
            if target == source
            else "contains"
            if target in source.parents
            else "lies inside"
            if source in target.parents
            else None
        )
        if relation:
            raise OutputError(
                f"output directory {path}{link} {relation} the {what} {given}: results and inputs would mix. "
                "Choose another output directory."
            )


def resumes_inside(directory: str | os.PathLike, resume: bool | str | None) -> bool:
    """Whether `resume` continues the run of `directory`: `true` (its newest checkpoint) or a checkpoint in it.

    Example:
        >>> resumes_inside("runB", "runA/checkpoint-1"), resumes_inside("runB", "runB/checkpoint-2")
        (False, True)
    """
    if resume is True or (isinstance(resume, str) and resume.lower() == "true"):
        return True
    if not isinstance(resume, str | os.PathLike) or not str(resume) or str(resume).lower() == "false":
        return False
    return Path(resume).expanduser().resolve().parent == Path(directory).expanduser().resolve()


def check_existing_entries(path: Path, overwrite: bool, resume: bool | str | None) -> None:
    """`OutputError` if `path` holds a name a run writes that no run recorded (`run_outputs`), holds a previous
    run's outputs and neither `overwrite` nor a `resume` of that run (`resumes_inside`) is set, or holds other files
    and `overwrite` is not set. A checkpoint of another directory resumes into `path` as a new run would."""
    names = entries(path)
    results = run_outputs(path)
    if resumes_inside(path, resume) or not [name for name in names if name not in RECORDS or name not in results]:
        return  # its own run continues, or nothing is there but records of nothing
    clashing = [name for name in names if name not in results and RUN_NAMES.fullmatch(name)]
    if clashing:
        newest = newest_complete_checkpoint(path)
        fix = f"Pass --resume_from_checkpoint {newest} to continue it, move" if newest else "Move"
        raise OutputError(
            f"output directory {path} holds {shown(clashing)}, which no mempo-trl run recorded and a run would "
            f"overwrite. {fix} them away or choose another output directory."
        )
    if overwrite:
        if path.is_symlink() and results:
            raise OutputError(
                f"output directory {path} is a link to {path.resolve()}: --overwrite_output_dir deletes nothing "
                f"through a link. Pass {path.resolve()} itself, or choose another output directory."
            )
        return
    target = path.resolve() if path.is_symlink() else path
    if set(results) - set(RECORDS):
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


def fingerprint(path: Path, times: bool = False) -> str:
    """What `path` holds, in 16 hex digits: the relative path, kind and size of each entry under it (links are not
    followed), and with `times` their modification times. A copy (`cp -r`) has the same without `times`; an edit
    that changes a size, an added or removed file do not.

    Example:
        >>> fingerprint(Path("outputs/run1/config.json"))
        '3f1c0a9d5e7b2c44'
    """
    digest = hashlib.sha256()
    walked = [(path, "")]
    if path.is_dir() and not path.is_symlink():
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for name in sorted(dirs + files):
                walked.append((Path(root, name), str(Path(root, name).relative_to(path))))
    for entry, relative in walked:
        info = entry.lstat()
        kind = "l" if entry.is_symlink() else "d" if entry.is_dir() else "f"
        size = os.readlink(entry) if kind == "l" else info.st_size if kind == "f" else ""
        stamp = info.st_mtime_ns if times else ""
        digest.update(f"{relative}\0{kind}\0{size}\0{stamp}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()[:16]


def fingerprints(path: Path, times: bool = False) -> dict[str, str]:
    """`fingerprint` of each entry of `path` but the `RECORDS` (entries that vanish meanwhile are left out)."""
    found = {}
    for name in entries(path):
        try:
            if name not in RECORDS:
                found[name] = fingerprint(path / name, times)
        except OSError:
            continue
    return found


def read_json(path: Path, key: str, kind: type):
    """The `kind` value of `key` in the JSON object of `path`, or None when missing, unreadable or of another type."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))[key]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, kind) else None


def read_record(path: Path) -> dict[str, str | None] | None:
    """The entries `RUN_RECORD` of `path` lists, with their fingerprints (None in a record of an older version,
    which lists names only); None when it is missing or unreadable.

    Example:
        >>> read_record(Path("outputs/run1"))  # a finished run
        {'README.md': '9c2e41f0a8d3b7e1', 'checkpoint-2': '04b7d2c6e1f9a385', ...}
    """
    written = read_json(path / RUN_RECORD, "written", list | dict)
    if written is None:
        return None
    if isinstance(written, list):
        written = dict.fromkeys(written)
    return {
        name: fp if isinstance(fp, str) else None
        for name, fp in written.items()
        if isinstance(name, str) and "/" not in name and "\0" not in name and name not in ("", ".", "..")
    }


def run_outputs(directory: str | os.PathLike) -> list[str]:
    """The names in `directory` that mempo-trl runs provably wrote there: the entries its `RUN_RECORD` lists that
    still match their fingerprint (a record without fingerprints: those with a name a run writes, `RUN_NAMES`), and
    after a run that never ended (`RUN_GOING` left behind), the entries with a name a run writes that appeared after
    it began; with the `RECORDS` themselves.

    Example:
        >>> run_outputs("outputs/run1")  # a finished run, plus the user's notes.txt
        ['README.md', '_mempo_outputs.json', 'config.json', 'mempo_agent.json', 'mempo_metrics.json', ...]
    """
    path = Path(directory)
    written = read_record(path) if path.is_dir() else None
    kept = read_json(path / RUN_GOING, "kept", list) if path.is_dir() else None
    ours = [RUN_RECORD] * (written is not None) + [RUN_GOING] * (kept is not None)
    for name in entries(path) if ours else []:
        if name in RECORDS:
            continue
        if name in (written or {}):
            try:
                proven = fingerprint(path / name) == written[name] if written[name] else RUN_NAMES.fullmatch(name)
            except OSError:
                proven = False
        else:
            proven = kept is not None and name not in kept and RUN_NAMES.fullmatch(name)
        if proven:
            ours.append(name)
    return sorted(ours)


def remove_run_outputs(directory: str | os.PathLike) -> list[str]:
    """Delete the previous runs' outputs of `directory` (`run_outputs` but the record, which the claim rewrites; a
    link is removed, never followed) and keep every other file; say what was removed. Returns the names removed."""
    path = Path(directory)
    removed = [name for name in run_outputs(path) if name not in RECORDS]
    for name in removed:
        entry = path / name
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink(missing_ok=True)
    if removed:
        print(f"--overwrite_output_dir: removed the previous run's {', '.join(removed)} from {path}")
    claim = CLAIMS.get(path.resolve())
    if claim is not None:
        claim.forget(removed)
    return removed


def write_json(path: Path, value: dict) -> None:
    """Write `value` as the JSON file `path` at once (a temporary file renamed), unless it holds `value` already."""
    if path.is_file() and read_json(path, next(iter(value)), object) == next(iter(value.values())):
        return
    temporary = path.parent / f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    temporary.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, path)


@dataclass
class OutputClaim:
    """An output directory this process holds locked (`fcntl.flock` on the directory itself; the OS releases it when
    the process ends, however it ends), the fingerprints of its entries when claimed (with times: a rewrite shows),
    which of them earlier runs wrote (`run_outputs`), whether the claim created it and whether it replaces them (`--overwrite_output_dir`)."""

    path: Path
    fd: int
    before: dict[str, str]
    earlier: set[str]
    created: bool
    replace: bool = False

    def begin(self) -> None:
        """Write `RUN_GOING`: what was there besides earlier runs' outputs, so that a run killed before `release`
        still tells its outputs from the other files."""
        write_json(self.path / RUN_GOING, {"kept": sorted(set(self.before) - self.earlier)})

    def forget(self, removed: list[str]) -> None:
        """Drop `removed` (deleted by `remove_run_outputs`) from what was there."""
        for name in removed:
            self.before.pop(name, None)
        self.earlier -= set(removed)

    def release(self) -> None:
        """If this run wrote, changed or removed anything, record the entries it wrote or changed, with those of
        earlier runs it left as they were, in `RUN_RECORD` (none: no record); a run that changed nothing (refused,
        or a failed load) leaves the record as it was, and a directory this claim created and left empty is
        removed. Remove `RUN_GOING`, then unlock."""
        try:
            now, sizes = fingerprints(self.path, times=True), fingerprints(self.path)
            changed = [name for name, fp in now.items() if self.before.get(name) != fp]
            if changed or set(self.before) - set(now):
                written = {name: sizes[name] for name in {*changed, *self.earlier} if name in sizes}
                if written:
                    write_json(self.path / RUN_RECORD, {"written": dict(sorted(written.items()))})
                else:
                    (self.path / RUN_RECORD).unlink(missing_ok=True)
            (self.path / RUN_GOING).unlink(missing_ok=True)
            if self.created and not entries(self.path):
                self.path.rmdir()
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
    latest, when this process exits), and recording what is there (`OutputClaim.begin`). Deletes nothing: with
    `overwrite`, the command calls `remove_run_outputs` once its inputs are checked. A directory another process
    holds is refused. Processes launched by the holder (`HELD_ENV`) share its claim.

    Example:
        >>> claim_output_dir("outputs/run1")  # another `mempo-trl train` is writing there
        Traceback (most recent call last):
        mempo_trl.outputs.OutputError: output directory outputs/run1 is in use by another mempo-trl run ...
    """
    created = not Path(directory).expanduser().is_dir()
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
            print(
                f"mempo-trl: WARNING: output directory {path} cannot be locked ({e.strerror}): a second run into "
                "it would not be refused."
            )
        try:
            check_existing_entries(path, overwrite, resume)
        except OutputError:
            os.close(fd)
            raise
        earlier = set(run_outputs(path)) - set(RECORDS)
        replace = overwrite and not resumes_inside(path, resume)
        CLAIMS[key] = OutputClaim(path, fd, fingerprints(path, times=True), earlier, created, replace)
        os.environ[HELD_ENV] = str(key)
        CLAIMS[key].begin()
    else:
        check_existing_entries(path, overwrite, resume)
    return path


def replace_run_outputs(directory: str | os.PathLike) -> list[str]:
    """`remove_run_outputs` of `directory` if this process claimed it with `overwrite` (once the command's inputs
    are checked); returns the names removed."""
    path = Path(directory)
    claim = CLAIMS.get(path.resolve())
    return remove_run_outputs(path) if claim is not None and claim.replace else []


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
    pick them. A checkpoint of another directory abandons nothing here. Returns the names removed (and prints them)."""
    step = checkpoint_step(resume) if resume and resumes_inside(output_dir, resume) else None
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
