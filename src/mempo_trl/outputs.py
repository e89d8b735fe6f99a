"""Where a command writes: checked before any long work, so that a run never does the work and then loses it.

Every command calls one of these first: `claim_output_dir` (a directory of results: apart from the inputs, locked for
the run, and an existing one is resumed, overwritten on request or refused; `prepare_output_dir` checks without
claiming), `check_writable` (a cache or other directory that is expected to hold things already), `check_port` (a
port a server will listen on) and `check_report_to` (logging backends). Each raises `OutputError` with one sentence
naming the path and the fix.

A run notes what was in the directory when it claims it (`RUN_GOING`) and records the entries it wrote, each with its
`fingerprint`, when it ends (`RUN_RECORD`). Only a previous run's outputs (`run_outputs`) are ever replaced: recorded
entries that still match their fingerprint and, after a run that never ended (killed), the entries with a name a run
writes that appeared after it began. Names alone prove nothing: a name a run writes that no run recorded, or one that
is a symbolic link, is refused, by a new run and a resume alike, and any other file is kept.

What a run replaces (the previous run's outputs with `--overwrite_output_dir`, the later checkpoints a resume from an
earlier one abandons) is never deleted up front, in any command: the claim sets it aside (`PREVIOUS_RUN`, a rename
inside the directory), and it is deleted only once the new run has results of its own in place (`drop_set_aside`:
a checkpoint, or a successful end with outputs written), or put back when the run ends without (`OutputClaim.release`)
or was killed before (the next claim of the directory, `finish_interrupted`).
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
import stat
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from mempo_trl.checkpoints import (
    CheckpointError,
    checkpoint_step,
    checkpoints_by_step,
    newest_complete_checkpoint,
    validate_checkpoint,
)


PROBE_PREFIX = ".mempo-write-probe-"
RUN_RECORD = "_mempo_outputs.json"
"""The entries runs wrote into an output directory (`_` keeps it off the Hub, as TRL's `push_to_hub` skips `_*`)."""
RUN_GOING = "_mempo_run_going.json"
"""The entries that were in an output directory before the run writing there now: removed when the run ends, so
one left behind names what a killed run found."""
RECORDS = (RUN_RECORD, RUN_GOING)
PREVIOUS_RUN = "_mempo_previous_run"
"""The folder inside an output directory holding what the run there replaces until it has results of its own."""
REPLACED = "_mempo_replaced_run"
"""`PREVIOUS_RUN` renamed while it is deleted: a deletion cut short is finished by the next claim."""
SET_ASIDE_NOTE = "_mempo_set_aside.json"
"""Inside `PREVIOUS_RUN`: the lines to print when its entries are deleted or put back."""
RECORD_VERSION = 2
"""`RUN_RECORD`s of version 2 fingerprint small files by content (`fingerprint`); older ones by size alone."""
HASHED_SIZE = 1 << 20
"""Files up to this size (bytes) are fingerprinted by their content's sha256; larger ones (weights, optimizer
states) by their size: hashing gigabytes at every claim would cost minutes."""
CHECKPOINT = re.compile(r"checkpoint-\d+")
"""The name of a checkpoint folder a run saves."""

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
            "help": "Replace the results of an earlier run in `output_dir` (set aside, deleted once this run has "
            "results of its own and put back if it ends without; other files there are kept), or write into a "
            "directory that holds other files."
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
        finish_interrupted_unless_held(path)
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
    """`OutputError` if `path` holds a name a run writes that is a symbolic link or that no run recorded
    (`run_outputs`), whether the run is new or resumes; or, unless a `resume` continues its run (`resumes_inside`),
    holds a previous run's outputs and `overwrite` is not set, or holds other files and `overwrite` is not set. A
    checkpoint of another directory resumes into `path` as a new run would."""
    aside = path / PREVIOUS_RUN
    pending = [name for name in entries(aside) if name != SET_ASIDE_NOTE] if aside.is_dir() else []
    names = sorted({*entries(path), *pending})  # what a run now writing there set aside counts as still there
    results = sorted({*run_outputs(path), *pending})
    if not [name for name in names if name not in RECORDS or name not in results]:
        return  # nothing is there but records of nothing
    linked = [name for name in names if RUN_NAMES.fullmatch(name) and (path / name).is_symlink()]
    if linked:
        links = ", ".join(f"{name} (a link to {os.readlink(path / name)})" for name in linked[:3])
        raise OutputError(
            f"output directory {path} holds {links}: a run writes only plain files and folders inside its output "
            "directory, never through a link. Remove the link (what it points to is kept) or choose another output "
            "directory."
        )
    resuming = resumes_inside(path, resume)
    clashing = [name for name in names if name not in results and RUN_NAMES.fullmatch(name)]
    if clashing:
        newest = None if resuming else newest_complete_checkpoint(path)
        fix = f"Pass --resume_from_checkpoint {newest} to continue it, move" if newest else "Move"
        raise OutputError(
            f"output directory {path} holds {shown(clashing)}, which no mempo-trl run recorded and a run would "
            f"overwrite. {fix} them away or choose another output directory."
        )
    if resuming:
        return
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
    """The names in `path`, sorted, without other processes' write probes and what a run set aside (`PREVIOUS_RUN`,
    `REPLACED`)."""
    hidden = (PREVIOUS_RUN, REPLACED)
    return sorted(p.name for p in path.iterdir() if not p.name.startswith(PROBE_PREFIX) and p.name not in hidden)


def file_digest(path: Path) -> str:
    """The sha256 of the file `path`'s bytes, in hex."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fingerprint(path: Path, times: bool = False, content: bool = True) -> str:
    """What `path` holds, in 16 hex digits: the relative path, kind and size of each entry under it (links are not
    followed), with `content` the sha256 of each regular file up to `HASHED_SIZE` bytes (not with `times`), and with
    `times` their modification times. A copy (`cp -r`) has the same without `times`; an edit (of a small file, even
    one that keeps its size), an added or removed file do not. `content=False` is the fingerprint of records before
    `RECORD_VERSION` 2.

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
        kind = "l" if stat.S_ISLNK(info.st_mode) else "d" if stat.S_ISDIR(info.st_mode) else "f"
        size = os.readlink(entry) if kind == "l" else info.st_size if kind == "f" else ""
        line = f"{relative}\0{kind}\0{size}\0{info.st_mtime_ns if times else ''}"
        if content and not times:
            hashed = stat.S_ISREG(info.st_mode) and info.st_size <= HASHED_SIZE
            line += f"\0{file_digest(entry) if hashed else ''}"
        digest.update(f"{line}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()[:16]


def fingerprint_forms(path: Path, legacy: bool) -> tuple[str, ...]:
    """The fingerprints of `path` a record can hold: by content, and in a record of an older version (`legacy`, no
    `RECORD_VERSION`) also by size alone."""
    return (fingerprint(path), fingerprint(path, content=False)) if legacy else (fingerprint(path),)


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


def write_record(path: Path, written: dict[str, str]) -> None:
    """Write `RUN_RECORD` of `path`: `written` maps each entry to its `fingerprint` (`RECORD_VERSION`)."""
    write_json(path / RUN_RECORD, {"written": dict(sorted(written.items())), "version": RECORD_VERSION})


def run_outputs(directory: str | os.PathLike) -> list[str]:
    """The names in `directory` that mempo-trl runs provably wrote there: the entries its `RUN_RECORD` lists that
    still match their fingerprint (a record without fingerprints: those with a name a run writes, `RUN_NAMES`; a
    listed `checkpoint-N` folder whatever it holds now, as a save cut short: checkpoints are validated before use), and
    after a run that never ended (`RUN_GOING` left behind), the entries with a name a run writes that appeared after
    it began; with the `RECORDS` themselves.

    Example:
        >>> run_outputs("outputs/run1")  # a finished run, plus the user's notes.txt
        ['README.md', '_mempo_outputs.json', 'config.json', 'mempo_agent.json', 'mempo_metrics.json', ...]
    """
    path = Path(directory)
    written = read_record(path) if path.is_dir() else None
    kept = read_json(path / RUN_GOING, "kept", list) if path.is_dir() else None
    legacy = path.is_dir() and (read_json(path / RUN_RECORD, "version", int) or 1) < RECORD_VERSION
    ours = [RUN_RECORD] * (written is not None) + [RUN_GOING] * (kept is not None)
    for name in entries(path) if ours else []:
        if name in RECORDS:
            continue
        if name in (written or {}):
            try:
                recorded = written[name]
                proven = recorded in fingerprint_forms(path / name, legacy) if recorded else RUN_NAMES.fullmatch(name)
                proven = proven or bool(
                    CHECKPOINT.fullmatch(name) and (path / name).is_dir() and not (path / name).is_symlink()
                )
            except OSError:
                proven = False
        else:
            proven = kept is not None and name not in kept and RUN_NAMES.fullmatch(name)
        if proven:
            ours.append(name)
    return sorted(ours)


def remove_entry(path: Path) -> None:
    """Delete the file, link or folder `path` (a link is removed, never followed)."""
    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)


def set_aside(path: Path, names: list[str], why: str, what: str) -> None:
    """Move `names` of `path` into `path/PREVIOUS_RUN` (renames inside the directory: nothing is copied) until the
    run writing there has results of its own, and say so; `why` (the flag or resume) and `what` (they are) word the
    lines printed now and when they are deleted (`drop_set_aside`) or put back (`restore_set_aside`)."""
    if not names:
        return
    aside = path / PREVIOUS_RUN
    aside.mkdir(exist_ok=True)
    listed = ", ".join(names)
    write_json(
        aside / SET_ASIDE_NOTE,
        {
            "removed": f"{why}: removed {what.format(names=listed)} from {path}",
            "restored": f"{why}: this run ended without results of its own; put {what.format(names=listed)} back in "
            f"{path}",
        },
    )
    for name in names:
        os.rename(path / name, aside / name)
    print(
        f"{why}: set {what.format(names=shown(names))} aside in {aside} until this run has results of its own "
        "(deleted then; put back if it ends without)",
        flush=True,
    )


def drop_set_aside(directory: str | os.PathLike) -> list[str]:
    """The run writing into `directory` has results of its own in place (a checkpoint, its outputs): delete what it
    set aside (`PREVIOUS_RUN`) and say what. Any process of the run may call it, as often as it likes; returns the
    names deleted (none when nothing is set aside)."""
    path = Path(directory)
    aside = path / PREVIOUS_RUN
    if not aside.is_dir() or aside.is_symlink():
        return []
    names = [name for name in entries(aside) if name != SET_ASIDE_NOTE]
    said = read_json(aside / SET_ASIDE_NOTE, "removed", str)
    if (path / REPLACED).exists():
        remove_entry(path / REPLACED)
    os.rename(aside, path / REPLACED)  # one step: a kill now leaves a deletion to finish, never half a previous run
    shutil.rmtree(path / REPLACED)
    print(said or f"removed {', '.join(names)} from {path}", flush=True)
    return names


def restore_set_aside(path: Path, written: set[str], new: set[str]) -> list[str]:
    """Put back what `path` set aside (`PREVIOUS_RUN`) when the run writing there ends without results of its own.
    First the entries of `written` (what that run wrote) that take a set-aside name, or that are `new` and have a
    name a run writes (a partial save), are deleted. A set-aside entry whose name is still taken stays aside, said in
    one line. Returns the names put back."""
    aside = path / PREVIOUS_RUN
    if not aside.is_dir() or aside.is_symlink():
        return []
    names = [name for name in entries(aside) if name != SET_ASIDE_NOTE]
    said = read_json(aside / SET_ASIDE_NOTE, "restored", str)
    for name in entries(path):
        if name in written and name not in RECORDS and (name in names or name in new and RUN_NAMES.fullmatch(name)):
            remove_entry(path / name)
    back = [name for name in names if not os.path.lexists(path / name)]
    for name in back:
        os.rename(aside / name, path / name)
    left = [name for name in names if name not in back]
    if left:
        print(
            f"mempo-trl: WARNING: {aside} still holds {', '.join(left)} of the previous run: their names are taken "
            f"in {path}. Move them yourself."
        )
    else:
        (aside / SET_ASIDE_NOTE).unlink(missing_ok=True)
        aside.rmdir()
    print(said or f"put {', '.join(back)} back in {path}", flush=True)
    return back


def has_results(path: Path, names: set[str]) -> bool:
    """Whether `names` of `path` include results a run can go on from: a complete `checkpoint-N`."""
    for name in names:
        if checkpoint_step(name) is not None and (path / name).is_dir() and not (path / name).is_symlink():
            try:
                validate_checkpoint(path / name)
            except CheckpointError:
                continue
            return True
    return False


def finish_interrupted(path: Path) -> None:
    """Finish what a run killed while writing into `path` left half done (`kill -9` runs no cleanup): the deletion
    of what it had set aside (`REPLACED`), and what it had set aside (`PREVIOUS_RUN`): deleted when the killed run
    had results of its own (`has_results`), else put back (`restore_set_aside`, the killed run's entries being those
    that appeared after it began, `RUN_GOING`, and are not a previous run's recorded outputs)."""
    if (path / REPLACED).exists():
        remove_entry(path / REPLACED)
    if not (path / PREVIOUS_RUN).is_dir():
        return
    kept = read_json(path / RUN_GOING, "kept", list)
    recorded = read_record(path) or {}
    earlier = {name for name in run_outputs(path) if name in recorded}
    written = set() if kept is None else {name for name in entries(path) if name not in kept and name not in earlier}
    if has_results(path, written):
        drop_set_aside(path)
    else:
        restore_set_aside(path, written, written)


def finish_interrupted_unless_held(path: Path) -> None:
    """`finish_interrupted` of `path` unless a run (this process's included) holds it now (`claim_output_dir`) or
    may: the run that set things aside there (`RUN_GOING`) ran on another machine (a lock may not reach across a
    network file system), or its process is alive."""
    host, pid = read_json(path / RUN_GOING, "host", str), read_json(path / RUN_GOING, "pid", int)
    if (path / PREVIOUS_RUN).exists() and (host != socket.gethostname() or pid is None or process_alive(pid)):
        return  # the next claim, which holds the lock, finishes it
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # held (or cannot be locked): the holder, or the next claim, finishes it
    else:
        finish_interrupted(path)
    finally:
        os.close(fd)


def process_alive(pid: int) -> bool:
    """Whether a process `pid` exists on this machine (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def write_json(path: Path, value: dict) -> None:
    """Write `value` as the JSON file `path` at once (a temporary file renamed), unless it holds `value` already."""
    try:
        if json.loads(path.read_text(encoding="utf-8")) == value:
            return
    except (OSError, ValueError):
        pass
    temporary = path.parent / f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    temporary.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, path)


@dataclass
class OutputClaim:
    """An output directory this process holds locked (`fcntl.flock` on the directory itself; the OS releases it when
    the process ends, however it ends), the fingerprints of its entries once claimed (with times: a rewrite shows),
    which of them earlier runs wrote and stay (`run_outputs`), and whether the claim created it."""

    path: Path
    fd: int
    before: dict[str, str]
    earlier: set[str]
    created: bool

    def release(self, ok: bool = False) -> None:
        """End the run's hold: what it set aside (`PREVIOUS_RUN`) is deleted if it ended `ok` having written
        something (`drop_set_aside`), else put back (`restore_set_aside`). Then, if this run wrote, changed or
        removed anything, record the entries it wrote or changed, with those of earlier runs it left as they were,
        in `RUN_RECORD` (none: no record); a run that changed nothing (refused, or a failed load) leaves the record
        as it was, and a directory this claim created and left empty is removed. Remove `RUN_GOING`, then unlock."""
        try:
            now = fingerprints(self.path, times=True)
            changed = [name for name, fp in now.items() if self.before.get(name) != fp]
            if (self.path / PREVIOUS_RUN).is_dir():
                if ok and changed:
                    drop_set_aside(self.path)
                else:
                    restore_set_aside(self.path, set(changed), set(changed) - set(self.before))
                    now = fingerprints(self.path, times=True)
                    changed = [name for name, fp in now.items() if self.before.get(name) != fp]
            if changed or set(self.before) - set(now):
                sizes = fingerprints(self.path)
                written = {name: sizes[name] for name in {*changed, *self.earlier} if name in sizes}
                if written:
                    write_record(self.path, written)
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
    latest, when this process exits), and noting what is there (`RUN_GOING`). Deletes nothing: what the run replaces
    (with `overwrite`, the previous run's outputs; resuming an earlier checkpoint of `directory`, the later ones) is
    set aside (`set_aside`) until the run has results of its own. What a killed run left half done there is finished
    first (`finish_interrupted`). A directory another process holds is refused. Processes launched by the holder
    (`HELD_ENV`) share its claim.

    Example:
        >>> claim_output_dir("outputs/run1")  # another `mempo-trl train` is writing there
        Traceback (most recent call last):
        mempo_trl.outputs.OutputError: output directory outputs/run1 is in use by another mempo-trl run ...
    """
    created = not Path(directory).expanduser().is_dir()
    path = prepare_output_dir(directory, resume=resume, check_existing=False, inputs=inputs)
    key = path.resolve()
    if key in CLAIMS or os.environ.get(HELD_ENV) == str(key):
        check_existing_entries(path, overwrite, resume)
        return path
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
        finish_interrupted(path)
        check_existing_entries(path, overwrite, resume)
    except (OutputError, OSError):
        os.close(fd)
        raise
    earlier = set(run_outputs(path)) - set(RECORDS)
    CLAIMS[key] = claim = OutputClaim(path, fd, {}, earlier, created)
    os.environ[HELD_ENV] = str(key)
    kept = sorted(set(entries(path)) - set(RECORDS) - earlier)
    write_json(path / RUN_GOING, {"kept": kept, "host": socket.gethostname(), "pid": os.getpid()})
    if overwrite and not resumes_inside(path, resume):
        set_aside(path, sorted(earlier), "--overwrite_output_dir", "the previous run's {names}")
    else:
        later = abandoned_checkpoints(path, resume)
        what = "the later {names} of the run it continued before (a branch this resume abandons)"
        set_aside(path, later, f"resuming from {resume}", what)
    claim.earlier = set(run_outputs(path)) - set(RECORDS)
    unshare_hard_links(path, sorted(claim.earlier))
    claim.before = fingerprints(path, times=True)
    return path


UNSHARED_SIZE = 64 << 20
"""Hard-linked files up to this size (bytes) are copied before a run writes beside them (`unshare_hard_links`)."""


def unshare_hard_links(path: Path, names: list[str]) -> list[str]:
    """Replace each regular file of `names` in `path` (a previous run's outputs a run going on there may rewrite)
    that has other hard links (a `cp -al` or `rsync --link-dest` snapshot) and at most `UNSHARED_SIZE` bytes by a
    copy of its own, so that the snapshot is never rewritten in place (transformers writes the weights to new files,
    and a run never writes into a finished checkpoint). Returns the names copied (and says how many)."""
    copied = []
    for name in names:
        info = (path / name).lstat()
        if stat.S_ISREG(info.st_mode) and info.st_nlink > 1 and info.st_size <= UNSHARED_SIZE:
            copy = path / f"{PROBE_PREFIX}{uuid.uuid4().hex}"
            shutil.copy2(path / name, copy)
            os.replace(copy, path / name)
            copied.append(name)
    if copied:
        print(
            f"mempo-trl: {path}: copied {shown(copied)}, hard-linked elsewhere, so that this run writes none through"
        )
    return copied


def release_output_dirs(ok: bool = False) -> None:
    """Release every output directory this process claimed (`OutputClaim.release`; `ok`: the command succeeded);
    also run at exit (as a failure: a command that succeeded released them before)."""
    while CLAIMS:
        key, claim = CLAIMS.popitem()
        claim.release(ok)
        if os.environ.get(HELD_ENV) == str(key):
            del os.environ[HELD_ENV]


atexit.register(release_output_dirs)


def abandoned_checkpoints(output_dir: str | os.PathLike, resume: bool | str | None) -> list[str]:
    """The `checkpoint-N` of `output_dir` later than the checkpoint `resume` continues from: they belong to the
    branch of the run that resuming from an earlier step abandons, and `--resume_from_checkpoint true` must never
    pick them. A checkpoint of another directory, or `true`, abandons nothing here."""
    step = (
        checkpoint_step(resume)
        if isinstance(resume, str | os.PathLike) and resumes_inside(output_dir, resume)
        else None
    )
    if step is None:
        return []
    return [p.name for p in checkpoints_by_step(output_dir) if checkpoint_step(p) > step and not p.is_symlink()]


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
