"""Checkpoint safety: which `checkpoint-N` directories are complete, what to resume from, and room on the disk.

A checkpoint is *complete* when every file `Trainer` needs to resume it exactly is there and whole: readable
`trainer_state.json`, the model weights (safetensors files as long as their headers say), and the optimizer,
scheduler and RNG states (torch zip archives whose index is intact). A save cut short (a kill, a full disk) leaves a
directory that fails this check; it is never named as the one to resume from, and resuming from it explicitly stops
before any work with one `CheckpointError` naming the file. "Newest" means the highest step number, not the
name's sort order (`checkpoint-10` after `checkpoint-9`).
"""

import errno
import json
import os
import re
import shutil
import struct
import zipfile
from pathlib import Path


FINAL_SAVE_MARKER = "mempo_save_incomplete.json"
"""Written into `output_dir` before the final save and removed once the model, metrics and card are all written: a
directory that holds it was cut short while saving (`check_final_save`)."""
CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
RNG_PATTERN = re.compile(r"^rng_state_(\d+)\.pth$")
TRAINER_STATE = "trainer_state.json"
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "adapter_model.safetensors",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.bin",
)
TORCH_STATES = ("optimizer.pt", "scheduler.pt")
DISK_FULL_MARKERS = ("No space left on device", "StorageFull", "Disk quota exceeded", "file write failed")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed; the message names the file and what to do."""


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step number of a `checkpoint-N` directory name, or None for any other name.

    Example:
        >>> checkpoint_step("out/checkpoint-10"), checkpoint_step("out/checkpoint-10.tmp")
        (10, None)
    """
    match = CHECKPOINT_PATTERN.match(Path(path).name)
    return int(match.group(1)) if match else None


def checkpoints_by_step(output_dir: str | os.PathLike) -> list[Path]:
    """The `checkpoint-N` directories of `output_dir`, by step number (oldest first)."""
    directory = Path(output_dir)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if checkpoint_step(p) is not None and p.is_dir()]
    return sorted(found, key=checkpoint_step)


def read_trainer_state(checkpoint: str | os.PathLike) -> dict:
    """The checkpoint's `trainer_state.json` as a dict with an integer `global_step`, or `CheckpointError`."""
    path = Path(checkpoint, TRAINER_STATE)
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({' '.join(str(e).split()) or 'empty file'})") from None
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        raise CheckpointError(f"{path} has no integer 'global_step'")
    return state


def check_safetensors(path: Path) -> dict:
    """Raise `CheckpointError` unless `path` is a whole safetensors file (size = header + the tensors it lists);
    return its header (tensor name -> dtype, shape, offsets)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        header_size = struct.unpack("<Q", raw)[0] if len(raw) == 8 else None
        if header_size is None or 8 + header_size > size:
            raise CheckpointError(f"{path} is truncated ({size} bytes, shorter than its header)")
        try:
            header = json.loads(f.read(header_size))
        except ValueError:
            raise CheckpointError(f"{path} has an unreadable header (truncated or not a safetensors file)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has an unreadable header (truncated or not a safetensors file)")
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    expected = 8 + header_size + max(ends, default=0)
    if size < expected:
        raise CheckpointError(f"{path} is truncated ({size} of {expected} bytes)")
    return header


def check_torch_file(path: Path) -> None:
    """Raise `CheckpointError` unless `path` is a torch archive whose zip index (written last) is intact."""
    try:
        with zipfile.ZipFile(path):
            pass
    except (zipfile.BadZipFile, OSError) as e:
        raise CheckpointError(f"{path} is truncated or corrupt ({e})") from None


def _weight_files(checkpoint: Path) -> list[Path]:
    """The weight files of a checkpoint (shards included), or `CheckpointError` when it has none."""
    for name in WEIGHT_FILES:
        path = checkpoint / name
        if not path.is_file():
            continue
        if not name.endswith(".index.json"):
            return [path]
        try:
            shards = sorted(set(json.loads(path.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{path} is not a valid weight index (truncated?)") from None
        return [checkpoint / shard for shard in shards]
    raise CheckpointError(f"{checkpoint} holds no model weights ({WEIGHT_FILES[0]} or {WEIGHT_FILES[2]} is missing)")


def validate_checkpoint(checkpoint: str | os.PathLike) -> dict:
    """Check that `checkpoint` can be resumed exactly; return its trainer state.

    Needs `trainer_state.json`, whole weight files, `optimizer.pt`, `scheduler.pt` and the RNG states
    (`rng_state.pth` of a single process, or `rng_state_0.pth` ... `rng_state_<K-1>.pth` of K >= 2 processes, none
    missing in between). DeepSpeed checkpoints (a `latest` file) keep their optimizer state in `global_step*/`, which
    DeepSpeed checks itself.

    Example:
        >>> validate_checkpoint("out/checkpoint-3")
        Traceback (most recent call last):
        mempo_trl.checkpoints.CheckpointError: checkpoint out/checkpoint-3 is incomplete: out/checkpoint-3/optimizer.pt is missing ...
    """
    path = Path(checkpoint)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} to resume from does not exist. Pass a checkpoint-N directory.")
    try:
        state = read_trainer_state(path)
        for weights in _weight_files(path):
            if not weights.is_file():
                raise CheckpointError(f"{weights} is missing")
            if weights.suffix == ".safetensors":
                check_safetensors(weights)
            else:
                check_torch_file(weights)
        deepspeed = (path / "latest").is_file()
        for name in ([] if deepspeed else list(TORCH_STATES)) + _rng_files(path):
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"{file} is missing")
            check_torch_file(file)
    except CheckpointError as e:
        raise CheckpointError(
            f"checkpoint {path} is incomplete: {e}. It cannot be resumed exactly (a save cut short, or saved with "
            f"save_only_model); resume from an earlier checkpoint{_newest_hint(path.parent, checkpoint_step(path))}."
        ) from None
    return state


def _rng_files(checkpoint: Path) -> list[str]:
    """The RNG state files a checkpoint must hold, judged from those it holds (see `validate_checkpoint`)."""
    ranks = sorted(int(m.group(1)) for p in checkpoint.glob("rng_state_*.pth") if (m := RNG_PATTERN.match(p.name)))
    if not ranks:
        return ["rng_state.pth"]
    return [f"rng_state_{rank}.pth" for rank in range(max(max(ranks) + 1, 2))]


def saved_world_size(checkpoint: str | os.PathLike) -> int:
    """How many processes saved `checkpoint` (from its RNG state files)."""
    return len(_rng_files(Path(checkpoint)))


def _newest_hint(output_dir: Path, before: int | None) -> str:
    older = [p for p in checkpoints_by_step(output_dir) if before is None or checkpoint_step(p) < before]
    newest = newest_complete_checkpoint_of(older)
    return f" ({newest})" if newest else ""


def newest_complete_checkpoint_of(candidates: list[Path]) -> Path | None:
    """The last of `candidates` (ordered by step) that `validate_checkpoint` accepts, or None."""
    for candidate in reversed(candidates):
        try:
            validate_checkpoint(candidate)
        except CheckpointError:
            continue
        return candidate
    return None


def newest_complete_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint of `output_dir` with the highest step number, or None.

    Example:
        >>> newest_complete_checkpoint("out")  # checkpoint-9 complete, checkpoint-10 cut short by a kill
        PosixPath('out/checkpoint-9')
    """
    return newest_complete_checkpoint_of(checkpoints_by_step(output_dir))


def resolve_resume(resume: str | bool | None, output_dir: str | os.PathLike) -> str | None:
    """The checkpoint directory to resume from, validated: `True`/`"true"` means the newest complete one of
    `output_dir` (transformers' convention), `None`/`False`/`"false"` means none.

    Example:
        >>> resolve_resume("true", "out")
        'out/checkpoint-9'
    """
    if resume is None or resume is False or (isinstance(resume, str) and resume.lower() in ("", "false")):
        return None
    if resume is True or (isinstance(resume, str) and resume.lower() == "true"):
        newest = newest_complete_checkpoint(output_dir)
        if newest is None:
            found = ", ".join(p.name for p in checkpoints_by_step(output_dir)) or "none"
            raise CheckpointError(
                f"--resume_from_checkpoint true found no complete checkpoint in {output_dir} (checkpoint-N "
                f"directories: {found}). Start without --resume_from_checkpoint, or pass a checkpoint path."
            )
        resume = newest
    validate_checkpoint(resume)
    return str(resume)


def finished_message(checkpoint: str, state: dict, max_steps: int) -> str | None:
    """What to say when `checkpoint` (trainer state `state`) is already at the end of a `max_steps` run, else None.

    `max_steps` <= 0 (epoch-based runs) uses the run length saved in the checkpoint.

    Example:
        >>> finished_message("out/checkpoint-6", {"global_step": 6, "max_steps": 6}, 6)[:54]
        'out/checkpoint-6 is already at the end of training (st'
    """
    total = max_steps if max_steps > 0 else state.get("max_steps", 0)
    if not total or state["global_step"] < total:
        return None
    return (
        f"{checkpoint} is already at the end of training (step {state['global_step']} of {total}): nothing to "
        "resume, nothing was changed. Its weights are the trained model; raise --max_steps to train further."
    )


def is_disk_full(err: BaseException) -> bool:
    """Whether `err` (or an exception it was raised from) is a write that failed for lack of space.

    Saving raises `OSError(ENOSPC)`, torch's `RuntimeError("... file write failed")` or safetensors' `StorageFull`.

    Example:
        >>> is_disk_full(RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0"))
        False
        >>> is_disk_full(OSError(28, "No space left on device"))
        True
    """
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(marker in str(err) for marker in DISK_FULL_MARKERS):
            return True
        err = err.__cause__ or err.__context__
    return False


def save_sizes(model) -> tuple[int, int]:
    """(bytes of the saved model, bytes of one checkpoint): weights as stored (only the trainable ones for a PEFT
    adapter), plus two fp32 AdamW moments per trainable parameter for a checkpoint."""
    from accelerate.utils import is_peft_model

    params = list(model.parameters())
    count = [getattr(p, "ds_numel", p.numel()) for p in params]  # ZeRO-3 partitions parameters: ds_numel is whole
    trainable = sum(n * p.element_size() for n, p in zip(count, params) if p.requires_grad)
    weights = trainable if is_peft_model(model) else sum(n * p.element_size() for n, p in zip(count, params))
    adam_moments = 2 * 4 * sum(n for n, p in zip(count, params) if p.requires_grad)
    return weights, weights + adam_moments


def check_free_space(directory: str | os.PathLike, needed: int, what: str) -> None:
    """Raise `CheckpointError` unless the file system of `directory` has `needed` bytes free for `what`.

    Example:
        >>> check_free_space("out", 10 * 2**30, "the final model")
        Traceback (most recent call last):
        mempo_trl.checkpoints.CheckpointError: out has 1.2 GiB free but the final model needs 10.0 GiB. Free ...
    """
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise CheckpointError(
            f"{directory} has {format_bytes(free)} free but {what} needs {format_bytes(needed)}. Free space or "
            "choose another output_dir (and lower save_total_limit), before training rather than after."
        )


def format_bytes(size: int) -> str:
    """`size` in the largest binary unit that keeps it >= 1.

    Example:
        >>> format_bytes(512), format_bytes(3 * 2**20 + 2**19), format_bytes(10 * 2**30)
        ('512 B', '3.5 MiB', '10.0 GiB')
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


MODEL_SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
"""The `config.json` fields that fix a model's weight shapes: a checkpoint and the run's model must agree on them."""


def check_checkpoint_model(
    checkpoint: str | os.PathLike, model_name_or_path: str, revision: str | None = None
) -> None:
    """Raise `CheckpointError` when the model saved in `checkpoint` (its ``config.json``) is not the run's model.

    Compares `MODEL_SHAPE_KEYS` present in both configs. A checkpoint without ``config.json`` (a LoRA adapter) is
    not compared.

    Example:
        >>> check_checkpoint_model("learner/checkpoint-1", "kit/tiny/model")  # doctest: +SKIP
        Traceback (most recent call last):
        mempo_trl.checkpoints.CheckpointError: checkpoint learner/checkpoint-1 holds another model than kit/tiny/model ...
    """
    saved_path = Path(checkpoint, "config.json")
    if not saved_path.is_file():
        return
    try:
        saved = json.loads(saved_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{saved_path} is not valid JSON ({' '.join(str(e).split()) or 'empty file'})") from None
    if Path(model_name_or_path, "config.json").is_file():
        model = json.loads(Path(model_name_or_path, "config.json").read_text(encoding="utf-8"))
    else:
        from transformers import AutoConfig

        model = AutoConfig.from_pretrained(model_name_or_path, revision=revision).to_dict()
    if not isinstance(saved, dict) or not isinstance(model, dict):
        return
    differ = [
        f"{key} {saved[key]!r} there, {model[key]!r} here"
        for key in MODEL_SHAPE_KEYS
        if key in saved and key in model and saved[key] != model[key]
    ]
    if differ:
        raise CheckpointError(
            f"checkpoint {checkpoint} holds another model than {model_name_or_path} ({'; '.join(differ)}; see "
            f"{saved_path}). Resume with the model it was trained from (model_name_or_path), or start a new run."
        )


LORA_SHAPE_FLAGS = (
    ("r", "lora_r"),
    ("lora_alpha", "lora_alpha"),
    ("use_rslora", "use_rslora"),
    ("use_dora", "use_dora"),
    ("target_modules", "lora_target_modules"),
    ("modules_to_save", "lora_modules_to_save"),
)
"""(`adapter_config.json` key, `ModelConfig` flag) pairs that fix a LoRA adapter's weights and scale: a resumed
adapter and the run's LoRA settings must agree on them."""


def _as_set(value) -> frozenset | object:
    """A list of module names as a set (order is not shape); one name (TRL's `ModelConfig` unwraps a one-item list) as
    a one-item set; None as the empty set."""
    if value is None:
        return frozenset()
    return frozenset([value]) if isinstance(value, str) else frozenset(value) if isinstance(value, list) else value


def _flag(flag: str, value) -> str:
    """The command-line form of ``--flag value`` (a list of names space-separated, None left unset)."""
    if value is None:
        return f"no --{flag}"
    return f"--{flag} {' '.join(map(str, sorted(value))) if isinstance(value, list) else value}"


def check_checkpoint_lora(checkpoint: str | os.PathLike, model_args) -> None:
    """Raise `CheckpointError` when the LoRA adapter saved in `checkpoint` (its ``adapter_config.json``) has another
    shape than the one `model_args` (TRL's `ModelConfig`, ``use_peft`` set) builds, naming the flags to pass.

    Compares `LORA_SHAPE_FLAGS`; an unset ``lora_target_modules`` (peft's default for the model) or ``all-linear``
    (saved as the modules it found) is not compared. A checkpoint without ``adapter_config.json``, or a run without
    ``use_peft``, is not compared.

    Example:
        >>> check_checkpoint_lora("lora1/checkpoint-1", ModelConfig(use_peft=True, lora_r=8))  # doctest: +SKIP
        Traceback (most recent call last):
        mempo_trl.checkpoints.CheckpointError: checkpoint lora1/checkpoint-1 holds a LoRA adapter with r 4 ...
    """
    saved_path = Path(checkpoint, "adapter_config.json")
    if not getattr(model_args, "use_peft", False) or not saved_path.is_file():
        return
    try:
        saved = json.loads(saved_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{saved_path} is not valid JSON ({' '.join(str(e).split()) or 'empty file'})") from None
    if not isinstance(saved, dict):
        raise CheckpointError(f"{saved_path} holds {type(saved).__name__}, not a JSON object")
    differ = []
    for key, flag in LORA_SHAPE_FLAGS:
        asked = getattr(model_args, flag, None)
        if key not in saved or key == "target_modules" and (asked is None or str(asked).lower() == "all-linear"):
            continue
        names = key in ("target_modules", "modules_to_save")
        if (_as_set(saved[key]) != _as_set(asked)) if names else (saved[key] != asked):
            differ.append((key, saved[key], flag, asked))
    if differ:
        found = "; ".join(f"{key} {there!r} there, --{flag} {here!r} here" for key, there, flag, here in differ)
        flags = " ".join(_flag(flag, there) for _, there, flag, _ in differ)
        raise CheckpointError(
            f"checkpoint {checkpoint} holds a LoRA adapter of another shape than this run's ({found}; see "
            f"{saved_path}). Resume with {flags}, or start a new run."
        )


def check_checkpoint_kind(checkpoint: str | os.PathLike, use_peft: bool) -> None:
    """Raise `CheckpointError` when `checkpoint` holds a LoRA adapter (`adapter_config.json`) and `use_peft` is
    false, or full weights and `use_peft` is true, naming the flag that fixes it.

    Example:
        >>> check_checkpoint_kind("full1/checkpoint-1", use_peft=True)
        Traceback (most recent call last):
        mempo_trl.checkpoints.CheckpointError: checkpoint full1/checkpoint-1 holds the full model's weights ...
    """
    adapter = Path(checkpoint, "adapter_config.json")
    if adapter.is_file() and not use_peft:
        rank = read_json_field(adapter, "r")
        lora_r = f" --lora_r {rank}" if isinstance(rank, int) else ""
        raise CheckpointError(
            f"checkpoint {checkpoint} holds a LoRA adapter ({adapter}), and this run trains the full model. Resume it "
            f"with --use_peft true{lora_r} (the LoRA settings of the run that saved it)."
        )
    if not adapter.is_file() and use_peft:
        weights = next((name for name in WEIGHT_FILES if Path(checkpoint, name).is_file()), "its weight files")
        raise CheckpointError(
            f"checkpoint {checkpoint} holds the full model's weights ({weights}), not a LoRA adapter, and this run has "
            "--use_peft true. Resume it without --use_peft (use_peft: false), as the run that saved it."
        )


def read_json_field(path: Path, key: str):
    """`key` of the JSON object in `path`, or None when it cannot be read."""
    try:
        return json.loads(path.read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def prepare_resume(
    training_args, model_name_or_path: str | None = None, revision: str | None = None, use_peft: bool | None = None
) -> str | None:
    """Resolve and validate `training_args.resume_from_checkpoint` in place (before any model is loaded): its files,
    that it holds `model_name_or_path` (`check_checkpoint_model`) and, when `use_peft` is given, the kind of weights
    this run trains (`check_checkpoint_kind`). Return `finished_message` when that checkpoint already ends the run,
    else None (also when the run's final save was cut short: training then loads the checkpoint and saves the model
    again)."""
    resume = resolve_resume(training_args.resume_from_checkpoint, training_args.output_dir)
    training_args.resume_from_checkpoint = resume
    if resume is None:
        return None
    if model_name_or_path:
        check_checkpoint_model(resume, model_name_or_path, revision)
    if use_peft is not None:
        check_checkpoint_kind(resume, use_peft)
    saved = saved_world_size(resume)
    if saved != training_args.world_size and training_args.process_index == 0:
        print(
            f"mempo-trl: WARNING: {resume} was saved by {saved} process(es), this run has {training_args.world_size}: "
            "training continues from its weights and optimizer, but the sampling RNG does not continue exactly."
        )
    finished = finished_message(resume, read_trainer_state(resume), training_args.max_steps)
    if finished and Path(training_args.output_dir, FINAL_SAVE_MARKER).is_file():
        if training_args.process_index == 0:
            print(f"mempo-trl: the final save in {training_args.output_dir} was cut short: saving {resume} again.")
        return None
    return finished


def check_room_to_save(trainer) -> None:
    """`check_free_space` of the output directory for the final model plus one checkpoint (a run saves one when it
    is stopped early, whatever its `save_strategy`)."""
    weights, checkpoint = save_sizes(trainer.model)
    what = f"the final model ({format_bytes(weights)}) and one checkpoint ({format_bytes(checkpoint)})"
    check_free_space(trainer.args.output_dir, weights + checkpoint, what)


def save_checkpoint_now(trainer) -> Path:
    """Save a checkpoint of the last finished step on every process (`Trainer._save_checkpoint`); return its path.

    A full disk raises `CheckpointError` naming the newest complete checkpoint instead.
    """
    try:
        trainer._save_checkpoint(trainer.model, trial=None)
    except Exception as err:
        if not is_disk_full(err):
            raise
        raise disk_full_error(f"saving a checkpoint in {trainer.args.output_dir}", trainer.args) from err
    return Path(trainer.args.output_dir, f"checkpoint-{trainer.state.global_step}")


def disk_full_error(doing: str, training_args) -> CheckpointError:
    """The error for a save that ran out of space: where to resume from."""
    newest = newest_complete_checkpoint(training_args.output_dir)
    resume = (
        f"rerun with --resume_from_checkpoint {newest} (the newest complete checkpoint; a partial one is ignored)"
        if newest
        else "rerun (no complete checkpoint was saved yet)"
    )
    return CheckpointError(f"{doing} failed: the disk is full. Free space, then {resume}.")


def _save_gathers(trainer) -> bool:
    """Whether saving gathers sharded weights from every process (ZeRO-3, FSDP): a collective."""
    plugin = trainer.accelerator.state.deepspeed_plugin
    return bool(trainer.is_fsdp_enabled or (plugin is not None and plugin.zero_stage == 3))


def save_model_or_rescue(trainer, output_dir: str) -> None:
    """`trainer.save_model(output_dir)`; if that write fails (a full disk, say), save the model to a new temporary
    directory instead and raise `CheckpointError` naming it, so that the trained weights are never lost silently.
    Where saving is a collective (ZeRO-3, FSDP) the error names the newest complete checkpoint instead."""
    import tempfile

    try:
        trainer.save_model(output_dir)
    except Exception as err:
        if not (is_disk_full(err) or isinstance(err, OSError)):
            raise
        reason = "the disk is full" if is_disk_full(err) else " ".join(str(err).split())
        newest = newest_complete_checkpoint(output_dir)
        fallback = f"The newest complete checkpoint is {newest or 'none'}: free space and resume from it."
        if _save_gathers(trainer):  # a second save would wait for processes that have moved on
            raise CheckpointError(f"saving the trained model to {output_dir} failed ({reason}). {fallback}") from err
        rescue = tempfile.mkdtemp(prefix="mempo-trl-model-")
        try:
            trainer.save_model(rescue)
        except Exception:
            raise CheckpointError(
                f"saving the trained model to {output_dir} failed ({reason}), and so did saving it to {rescue}. "
                f"{fallback}"
            ) from err
        raise CheckpointError(
            f"saving the trained model to {output_dir} failed ({reason}); it was saved to {rescue} instead. Move it "
            "where it belongs (the metrics and model card were not written)."
        ) from err


def begin_final_save(output_dir: str | os.PathLike, step: int) -> None:
    """Write `FINAL_SAVE_MARKER` (to disk, before the final save writes anything); `end_final_save` removes it."""
    path = Path(output_dir, FINAL_SAVE_MARKER)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        json.dump({"step": step}, f)
        f.flush()
        os.fsync(f.fileno())


def end_final_save(output_dir: str | os.PathLike) -> None:
    """Remove `FINAL_SAVE_MARKER`: everything of the final save is written."""
    Path(output_dir, FINAL_SAVE_MARKER).unlink(missing_ok=True)


def check_final_save(model_dir: str | os.PathLike) -> None:
    """Raise `CheckpointError` when `model_dir` holds a final save cut short (`FINAL_SAVE_MARKER`), saying how to
    finish it.

    Example:
        >>> check_final_save("out")  # killed while saving its trained model
        Traceback (most recent call last):
        mempo_trl.checkpoints.CheckpointError: out holds an incomplete final save (the run was stopped while ...
    """
    if not Path(model_dir, FINAL_SAVE_MARKER).is_file():
        return
    newest = newest_complete_checkpoint(model_dir)
    fix = (
        f"rerun the training command with --resume_from_checkpoint true to save it again from {newest}"
        if newest
        else "no checkpoint was saved to finish it from: train again"
    )
    raise CheckpointError(
        f"{model_dir} holds an incomplete final save (the run was stopped while saving the trained model, "
        f"{FINAL_SAVE_MARKER} is still there): {fix}."
    )
