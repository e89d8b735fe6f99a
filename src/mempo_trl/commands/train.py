"""`mempo-trl train` / `examples/train_mempo.py`: train a MemPO search agent from a YAML recipe.

    mempo-trl train --config examples/configs/qwen2.5-3b-lora.yaml --accelerate_config zero2 --num_processes 8
    accelerate launch --config_file accelerate_configs/zero2.yaml -m mempo_trl train \\
        --config examples/configs/qwen2.5-3b-lora.yaml

The first starts the processes itself (`mempo_trl.commands.launch`); `--help` is short and imports neither torch nor
TRL (`mempo_trl.commands.train_help`; `--help_all` lists every field).

Arguments are parsed TRL-style (`TrlParser`) over `ScriptArguments`, `RetrieverArguments`, `MemPOConfig` and TRL's
`ModelConfig` (LoRA, quantisation); any of them may come from `--config recipe.yaml` and be overridden on the command line.
`environment: keyvault` (a kit environment, `mempo_trl.kit.envs`) or an import path (`my_pkg.envs.MyEnv`) trains on
that TRL-style environment instead of search (docs/environments.md); `dataset_name` then holds its `reset` rows.

`model_name_or_path: tiny` builds the offline tiny model (`mempo_trl.kit.tiny`) into `<output_dir>/base_model`;
`model_name_or_path: learner` trains the learner shipped with the package (`mempo_trl.kit.learner.shipped_learner`)
on its own world, written to `<output_dir>/learner_world`, whose RL rows, held-out rows and corpus are then the
defaults (the demo world's otherwise).
"""

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from mempo_trl.cli import run
from mempo_trl.commands import add_command, parse
from mempo_trl.commands.retrieval import RetrieverArguments, build_retriever


TINY_MODEL = "tiny"
LEARNER_MODEL = "learner"
REWARD_FUNCS = {"mempo_outcome_reward", "mempo_format_reward"}


@dataclass
class ScriptArguments:
    """Data and rewards of a MemPO run (retriever: `RetrieverArguments`; model and training: `ModelConfig`,
    `MemPOConfig`)."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "QA data: a .jsonl/.json/.parquet path or a `datasets` name (FlashRAG or Search-R1 rows). "
                  "Default: the shipped demo world (the learner world's RL rows for `model_name_or_path: learner`)."},
    )  # fmt: skip
    dataset_split: str = field(default="train", metadata={"help": "Split of `dataset_name` to train on."})
    dataset_config: str | None = field(default=None, metadata={"help": "`datasets` config name of `dataset_name`."})
    eval_dataset_name: str | None = field(default=None, metadata={"help": "Optional QA data for evaluation."})
    eval_dataset_split: str = field(default="test", metadata={"help": "Split of `eval_dataset_name`."})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Replace the results in an `output_dir` that already holds some: everything there but "
                  "base_model/ and learner_world/ is deleted first. Without it (or `resume_from_checkpoint`) such a "
                  "directory is refused before anything is loaded."},
    )  # fmt: skip
    reward_funcs: list[str] = field(
        default_factory=lambda: ["mempo_outcome_reward"],
        metadata={"help": f"Outcome reward functions: {sorted(REWARD_FUNCS)} or a dotted import path "
                  "(`my_lib.rewards.custom_reward`); weigh them with `reward_weights`. `mempo_format_reward` helps a "
                  "small model that rarely answers right."},
    )  # fmt: skip
    environment: str | None = field(
        default=None,
        metadata={"help": "Train on a TRL-style environment instead of search: a kit environment (keyvault, safe) or "
                  "an import path (my_pkg.envs.MyEnv). dataset_name is then a .jsonl of its reset rows (default for a "
                  "kit environment: environment_rows seeded rows); the reward is its get_reward() and/or reward_funcs."},
    )  # fmt: skip
    environment_rows: int = field(
        default=1000, metadata={"help": "Rows of a kit environment to train on when dataset_name is not set."}
    )
    heldout_questions: int = field(
        default=0,
        metadata={"help": "Evaluate greedily on this many held-out questions (`eval_dataset_name`, default the demo "
                  "test set, or the learner world's) before and after training, and print both (`mempo_trl.callbacks.HeldOutEvalCallback`); single-process runs only. 0: off."},
    )  # fmt: skip


def load_reward_funcs(names: list[str]) -> list:
    """The reward functions `names` name: ours by name, anything else by dotted import path (as TRL's scripts).

    Example:
        >>> [f.__name__ for f in load_reward_funcs(["mempo_outcome_reward", "mempo_trl.rewards.mempo_format_reward"])]
        ['mempo_outcome_reward', 'mempo_format_reward']
    """
    import importlib

    from mempo_trl import rewards

    funcs = []
    for name in names:
        if name in REWARD_FUNCS:
            funcs.append(getattr(rewards, name))
            continue
        module, _, attr = name.rpartition(".")
        try:
            funcs.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError, ValueError):
            raise ValueError(
                f"unknown reward function {name!r}: use one of {sorted(REWARD_FUNCS)} or a dotted import path."
            ) from None
    return funcs


LAUNCHER_ENV_PREFIXES = ("ACCELERATE_", "TORCHELASTIC_", "DEEPSPEED_")
LAUNCHER_ENV = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}  # fmt: skip


def without_launcher_env(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` without what `accelerate launch` / torchrun set for their processes (rank, world, DeepSpeed).

    Example:
        >>> without_launcher_env({"RANK": "1", "ACCELERATE_USE_DEEPSPEED": "true", "PATH": "/bin"})
        {'PATH': '/bin'}
    """
    return {
        key: value
        for key, value in environ.items()
        if key not in LAUNCHER_ENV and not key.startswith(LAUNCHER_ENV_PREFIXES)
    }


def build_tiny_base_model(training_args) -> Path:
    """`model_name_or_path: tiny`: the tiny model SFT-warm-started on the MemPO format, copied into
    ``<output_dir>/base_model`` (so that the run's directory holds everything it needs) and returned.

    It is built once per seed under ``$MEMPO_CACHE/tiny_warm/seed<seed>`` (1-2 min on CPU) and reused by later runs,
    on the main process while the others wait. The build runs in a fresh Python process without the launcher's
    environment: in this one, under DeepSpeed ZeRO-3, `from_pretrained` runs inside `deepspeed.zero.Init` and the
    warm start's trainer would join the launched world, collectives the waiting processes never enter (a deadlock).
    """
    import shutil
    import subprocess
    import sys
    import time

    from mempo_trl.retrieval.cache import cache_root

    out = Path(training_args.output_dir) / "base_model"
    cached = cache_root() / "tiny_warm" / f"seed{training_args.seed}"
    code = (
        "import sys; from mempo_trl.cli import quiet_upstream_noise; quiet_upstream_noise(); "
        "from mempo_trl.kit.warmstart import build_warm_tiny_model; "
        "build_warm_tiny_model(sys.argv[1], seed=int(sys.argv[2]))"
    )
    with training_args.main_process_first(desc="building the tiny model"):
        if training_args.local_process_index == 0:
            print(f"tiny model: building and SFT-warm-starting it in {cached} (1-2 min on CPU once; then reused)")
            start = time.perf_counter()
            subprocess.run(
                [sys.executable, "-c", code, str(cached), str(training_args.seed)],
                env=without_launcher_env(dict(os.environ)),
                check=True,
            )
            shutil.copytree(cached, out, dirs_exist_ok=True)
            print(f"tiny model: ready in {time.perf_counter() - start:.0f} s, copied to {out}")
    return out


def _load_model_and_tokenizer(model_args, training_args):
    import torch
    from transformers import AutoModelForCausalLM
    from trl import get_quantization_config

    from mempo_trl.loading import load_tokenizer

    path = model_args.model_name_or_path
    if path == TINY_MODEL:
        path = str(build_tiny_base_model(training_args).resolve())  # what a LoRA adapter records as its base
        tokenizer = load_tokenizer(path)
    elif path == LEARNER_MODEL:
        from mempo_trl.kit.learner import shipped_learner

        path = str(shipped_learner())
        tokenizer = load_tokenizer(path)
    else:
        tokenizer = load_tokenizer(path, revision=model_args.model_revision)
    tokenizer.padding_side = "left"
    dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
    quantization_config = get_quantization_config(model_args)
    model = AutoModelForCausalLM.from_pretrained(
        path,
        revision=model_args.model_revision,
        dtype=dtype,
        attn_implementation=model_args.attn_implementation,
        quantization_config=quantization_config,
    )
    return model, tokenizer


class DefaultWorld(NamedTuple):
    """What a run trains on, evaluates on and searches when the recipe names no data or corpus (with names for the
    model card)."""

    name: str
    corpus_name: str
    train: Path
    test: Path
    corpus: Path


def default_world(model_name_or_path: str, training_args) -> DefaultWorld:
    """The learner world for `model_name_or_path: learner` (written once to `<output_dir>/learner_world`), the
    shipped demo world for any other model."""
    if model_name_or_path == LEARNER_MODEL:
        from mempo_trl.kit.learner import write_learner_world

        with training_args.main_process_first(desc="writing the learner world"):
            paths = write_learner_world(Path(training_args.output_dir) / "learner_world")
        return DefaultWorld(
            "mempo_trl learner world (RL rows)", "the learner world's", paths.rl, paths.test, paths.corpus
        )
    from mempo_trl.kit.demo_world import demo_paths

    paths = demo_paths()
    return DefaultWorld("mempo_trl demo world", "the demo", paths.train, paths.test, paths.corpus)


def use_learner_instruction(training_args) -> None:
    """The shipped learner reads the question alone (its warm start's instruction, saved in its `mempo_agent.json`):
    a recipe for `model_name_or_path: learner` that leaves `instruction` at the default gets that one, and says so."""
    from mempo_trl.agent import AgentSettings
    from mempo_trl.context import DEFAULT_INSTRUCTION
    from mempo_trl.kit.learner import shipped_learner

    saved = AgentSettings.from_pretrained(shipped_learner())
    if training_args.instruction == DEFAULT_INSTRUCTION != saved.instruction:
        training_args.instruction = saved.instruction
        if training_args.process_index == 0:
            print(f"model_name_or_path=learner: instruction={saved.instruction!r}, the shipped learner's")


def _load_retriever(retriever_args: RetrieverArguments, default_corpus: Path):
    retriever = build_retriever(retriever_args, default_corpus=str(default_corpus), ride_out_outages=True)
    if retriever_args.retriever_url:
        retriever.health()  # fail before training, with the URL in the message
    return retriever


def build_environment_trainer(script_args: ScriptArguments, training_args, model_args):
    """A `MemPOTrainer` on the recipe's environment: its rows (`dataset_name` .jsonl, or seeded kit rows), the
    reward functions the recipe names (none by default: the trainer's default, `get_reward` or exact match)."""
    from datasets import Dataset
    from trl import get_peft_config

    from mempo_trl.callbacks import LaunchBannerCallback, use_step_summary
    from mempo_trl.data import read_jsonl
    from mempo_trl.environments import check_environment
    from mempo_trl.kit.envs import KIT_ENVIRONMENTS, resolve_environment
    from mempo_trl.trainer import MemPOTrainer

    environment_factory = resolve_environment(script_args.environment)
    check_environment(environment_factory)
    if script_args.dataset_name:
        rows = read_jsonl(script_args.dataset_name)
    elif script_args.environment in KIT_ENVIRONMENTS:
        rows = KIT_ENVIRONMENTS[script_args.environment][1](script_args.environment_rows, seed=0)
    else:
        raise ValueError(f"environment={script_args.environment} needs dataset_name: a .jsonl of its reset rows.")
    default = ScriptArguments.__dataclass_fields__["reward_funcs"].default_factory()
    reward_funcs = None if script_args.reward_funcs == default else load_reward_funcs(script_args.reward_funcs)
    model, tokenizer = _load_model_and_tokenizer(model_args, training_args)
    trainer = MemPOTrainer(
        model=model,
        environment_factory=environment_factory,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    trainer.model_card_info = {
        "base_model": model_args.model_name_or_path,
        "dataset": script_args.dataset_name or f"{script_args.environment} kit rows (seed 0)",
        "environment": script_args.environment,
    }
    trainer.add_callback(LaunchBannerCallback(trainer))
    use_step_summary(trainer)
    return trainer


def build_trainer(script_args: ScriptArguments, training_args, model_args, retriever_args: RetrieverArguments):
    """Load and validate the data, the retriever and the model; return a ready `MemPOTrainer`."""
    if script_args.environment:
        return build_environment_trainer(script_args, training_args, model_args)
    from trl import get_peft_config

    from mempo_trl.callbacks import HeldOutProgressCallback, LaunchBannerCallback, use_step_summary
    from mempo_trl.data import load_qa
    from mempo_trl.interruptions import SaveOnSignalCallback
    from mempo_trl.trainer import MemPOTrainer

    world = default_world(model_args.model_name_or_path, training_args)
    if model_args.model_name_or_path == LEARNER_MODEL:
        use_learner_instruction(training_args)
    train_dataset = load_qa(
        script_args.dataset_name or str(world.train),
        split=script_args.dataset_split,
        config=script_args.dataset_config,
    )
    eval_dataset = None
    if script_args.eval_dataset_name:
        eval_dataset = load_qa(
            script_args.eval_dataset_name, split=script_args.eval_dataset_split, config=script_args.dataset_config
        )
    retriever = _load_retriever(retriever_args, world.corpus)
    reward_funcs = load_reward_funcs(script_args.reward_funcs)
    model, tokenizer = _load_model_and_tokenizer(model_args, training_args)
    trainer = MemPOTrainer(
        model=model,
        retriever=retriever,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    trainer.model_card_info = {
        "base_model": model_args.model_name_or_path,
        "dataset": script_args.dataset_name or world.name,
        "retriever": retriever_args.retriever_url or retriever_args.corpus or f"BM25 over {world.corpus_name} corpus",
        "retriever_arg": retriever_args.retriever_url or retriever_args.corpus or str(world.corpus),
        "example_question": train_dataset[0]["question"],
    }
    trainer.add_callback(LaunchBannerCallback(trainer))
    trainer.add_callback(SaveOnSignalCallback(trainer))
    use_step_summary(trainer)
    if script_args.heldout_questions > 0 and training_args.world_size > 1:
        # The held-out evaluation generates on the main process alone: under ZeRO-3 that forward is a collective the
        # other processes never join. Multi-process runs evaluate afterwards with `mempo-trl eval`.
        if training_args.process_index == 0:
            print(f"heldout_questions={script_args.heldout_questions} is skipped on {training_args.world_size} "
                  "processes: evaluate the saved model with `mempo-trl eval` instead.")  # fmt: skip
    elif script_args.heldout_questions > 0:
        from mempo_trl.callbacks import HeldOutEvalCallback
        from mempo_trl.kit.learner import memory_recall_metric

        heldout = eval_dataset if eval_dataset is not None else load_qa(str(world.test), split="test")
        rows = list(heldout.select(range(min(script_args.heldout_questions, len(heldout)))))
        progress = HeldOutProgressCallback(len(rows))
        trainer.add_callback(progress)
        trainer.add_callback(
            HeldOutEvalCallback(
                tokenizer,
                rows,
                retriever,
                on_result=progress.report,
                row_metric=memory_recall_metric(retriever),
                max_turns=training_args.max_turns,
                topk=training_args.retrieval_topk,
                max_new_tokens=training_args.max_completion_length,
                context_mode=training_args.context_mode,
                instruction=training_args.instruction,
                system_prompt=training_args.system_prompt,
            )
        )
    return trainer


def release_process_groups(trainer) -> None:
    """Wait for every process, then destroy all process groups while Python is still alive.

    Left to interpreter exit, gloo's worker threads can abort a finished rank ("terminate called without an active
    exception", pytorch/pytorch#190489; seen with vLLM's tensor-parallel group in colocate mode), and the launcher
    then reports the whole run as failed.
    """
    import torch

    trainer.accelerator.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def train(trainer, training_args, dataset_name: str | None = None) -> dict:
    """Train, save the model, the metrics and the model card (and push). Returns the final metrics.

    First checks that the disk has room for the final model and a checkpoint. Training that stops early keeps its
    work: on SIGTERM/SIGINT, a retriever that fails for the whole retry budget (`RetrieverOutage`) or answers
    wrongly, or a non-finite loss or advantage, a checkpoint of the last finished step is saved and the error is
    raised again naming it (`--resume_from_checkpoint ...`). A final save that fails keeps the model in a temporary
    directory named in the error (`save_model_or_rescue`).
    """
    from mempo_trl.checkpoints import check_room_to_save, disk_full_error, is_disk_full, save_model_or_rescue
    from mempo_trl.interruptions import NonFiniteError, SaveOnSignalCallback, TrainingStopped
    from mempo_trl.model_card import heldout_summary
    from mempo_trl.retrieval import RetrievalError, RetrieverOutage

    check_room_to_save(trainer)
    stop = next((c for c in trainer.callback_handler.callbacks if isinstance(c, SaveOnSignalCallback)), None)
    try:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    except (RetrievalError, NonFiniteError) as err:
        when = "once the server answers again" if isinstance(err, RetrieverOutage) else "once that is fixed"
        if trainer.state.global_step == 0:  # nothing trained yet: nothing to save
            message = f"training stopped: {str(err).rstrip('.')}. No step had finished; {when}, rerun."
            raise type(err)(message) from err
        checkpoint = save_checkpoint_and_release(trainer)
        raise type(err)(
            f"training stopped: {str(err).rstrip('.')}. Saved {checkpoint}; {when}, rerun with "
            f"--resume_from_checkpoint {checkpoint}."
        ) from err
    except Exception as err:
        if is_disk_full(err):
            step = trainer.state.global_step
            doing = f"training stopped at step {step}: saving {Path(training_args.output_dir, f'checkpoint-{step}')}"
            raise disk_full_error(doing, training_args) from err
        raise
    finally:
        if stop is not None:
            stop.restore()
    if stop is not None and stop.received and trainer.state.global_step < trainer.state.max_steps:
        release_process_groups(trainer)  # the checkpoint was saved by every process at the last step
        checkpoint = Path(training_args.output_dir, f"checkpoint-{trainer.state.global_step}")
        raise TrainingStopped(
            f"training stopped by {stop.received} after step {trainer.state.global_step}/{trainer.state.max_steps}. "
            f"Saved {checkpoint}; rerun with --resume_from_checkpoint {checkpoint} to continue."
        )
    save_model_or_rescue(trainer, training_args.output_dir)
    metrics = {**result.metrics, **trainer.final_metrics()}
    metrics.update(heldout_summary(trainer.callback_handler.callbacks) or {})
    if trainer.is_world_process_zero():
        Path(training_args.output_dir, "mempo_metrics.json").write_text(json.dumps(metrics, indent=2))
        trainer.create_model_card(dataset_name=dataset_name)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=dataset_name)
    return metrics


def save_checkpoint_and_release(trainer) -> Path:
    """Save a checkpoint of the last finished step, then `release_process_groups` (no process exits, and gets the
    others killed, before all saved)."""
    from mempo_trl.checkpoints import save_checkpoint_now

    checkpoint = save_checkpoint_now(trainer)
    release_process_groups(trainer)
    return checkpoint


def parse_args(argv: list[str] | None = None):
    """Parse `ScriptArguments`, `MemPOConfig` and `ModelConfig` from the command line and an optional recipe."""
    from trl import ModelConfig

    from mempo_trl.config import MemPOConfig

    types = (ScriptArguments, RetrieverArguments, MemPOConfig, ModelConfig)
    script_args, retriever_args, training_args, model_args = parse("mempo-trl train", types, argv)
    if model_args.model_name_or_path is None:
        model_args.model_name_or_path = TINY_MODEL
    if training_args.ddp_find_unused_parameters is None:
        # Trainer's default without activation checkpointing is True, and DDP then warns every run that it found none:
        # every parameter of a MemPO policy (full or LoRA) gets a gradient.
        training_args.ddp_find_unused_parameters = False
    return script_args, training_args, model_args, retriever_args


KEPT_ON_OVERWRITE = ("base_model", "learner_world")
"""What `--overwrite_output_dir` keeps in the output directory: the inputs a run writes there and reuses."""


def remove_previous_results(output_dir: str | Path) -> list[str]:
    """Delete everything in ``output_dir`` but `KEPT_ON_OVERWRITE` (weights or adapter, card, metrics, checkpoints,
    logs of the previous run), so that nothing stale of another kind (full weights beside a new adapter) stays
    there. Returns the names removed.

    Example:
        >>> remove_previous_results("outputs/tiny")  # doctest: +SKIP
        ['README.md', 'adapter_config.json', 'adapter_model.safetensors', 'mempo_metrics.json', ...]
    """
    import shutil

    from mempo_trl.outputs import PROBE_PREFIX

    removed = []
    for entry in sorted(Path(output_dir).iterdir()):
        if entry.name in KEPT_ON_OVERWRITE or entry.name.startswith(PROBE_PREFIX):  # another process's probe
            continue
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        removed.append(entry.name)
    return removed


def check_before_training(script_args: ScriptArguments, training_args, model_args) -> None:
    """Fail in seconds, not after training: model path, logging backends, a writable and unused `output_dir`."""
    from mempo_trl.loading import check_model_path
    from mempo_trl.outputs import check_report_to, prepare_output_dir

    if model_args.model_name_or_path not in (TINY_MODEL, LEARNER_MODEL):
        check_model_path(model_args.model_name_or_path)
    if script_args.environment and script_args.heldout_questions > 0:
        raise ValueError(
            "heldout_questions evaluates the search task; evaluate an environment agent with "
            f"`mempo-trl eval --environment {script_args.environment}` instead (set heldout_questions: 0)."
        )
    check_report_to(training_args.report_to)
    first = int(os.environ.get("RANK", "0")) == 0
    prepare_output_dir(
        training_args.output_dir,
        overwrite=script_args.overwrite_output_dir,
        resume=training_args.resume_from_checkpoint,
        check_existing=first,  # before rank 0 writes base_model there
    )
    if first and script_args.overwrite_output_dir and not training_args.resume_from_checkpoint:
        removed = remove_previous_results(training_args.output_dir)
        if removed:
            print(
                f"--overwrite_output_dir: removed the previous run's {', '.join(removed)} from {training_args.output_dir}"
            )


def _flag_value(argv: list[str], name: str) -> str | None:
    """The last value of `--name value` / `--name=value` in `argv` ("true" for a bare boolean flag)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == f"--{name}":
            following = argv[i + 1] if i + 1 < len(argv) else "--"
            value = "true" if following.startswith("--") else following
        elif arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
    return value


def check_output_dir_early(argv: list[str]) -> int:
    """Refuse an `output_dir` that already holds results in a second, before torch and TRL are imported.

    Reads `output_dir`, `overwrite_output_dir` and `resume_from_checkpoint` from the recipe and the command line the
    way the full parse will (command line wins); anything it cannot read is left to that parse.
    """
    import yaml

    from mempo_trl.outputs import prepare_output_dir

    settings = {}
    config = _flag_value(argv, "config")
    if config and Path(config).is_file():
        try:
            loaded = yaml.safe_load(Path(config).read_text(encoding="utf-8"))
        except yaml.YAMLError:
            loaded = None
        settings = loaded if isinstance(loaded, dict) else {}
    for name in ("output_dir", "overwrite_output_dir", "resume_from_checkpoint"):
        value = _flag_value(argv, name)
        if value is not None:
            settings[name] = value
    output_dir = settings.get("output_dir")
    if not isinstance(output_dir, str) or not Path(output_dir).is_dir() or int(os.environ.get("RANK", "0")) != 0:
        return 0  # nothing to refuse yet (and nothing is created before the full parse)
    overwrite = str(settings.get("overwrite_output_dir", False)).lower() in ("true", "1", "yes")
    resume = settings.get("resume_from_checkpoint")
    prepare_output_dir(output_dir, overwrite=overwrite, resume=str(resume) if resume else None)
    return 0


def _main(argv: list[str] | None) -> int:
    from mempo_trl.checkpoints import prepare_resume

    script_args, training_args, model_args, retriever_args = parse_args(argv)
    check_before_training(script_args, training_args, model_args)
    finished = prepare_resume(training_args)  # validates the checkpoint before any model is loaded
    if finished:
        if int(os.environ.get("RANK", "0")) == 0:
            print(finished)
        return 0
    trainer = build_trainer(script_args, training_args, model_args, retriever_args)
    metrics = train(trainer, training_args, script_args.dataset_name)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"model saved to {training_args.output_dir}")
        print(f"metrics written to {Path(training_args.output_dir, 'mempo_metrics.json')}")
        summary = {k: metrics[k] for k in sorted(metrics) if k.startswith(("train_runtime", "episode/", "memory/"))}
        print(json.dumps(summary, indent=2))
        for callback in trainer.callback_handler.callbacks:
            if hasattr(callback, "before_after"):
                print(callback.before_after())
    release_process_groups(trainer)
    return 0


def leave_launched_process(rc: int) -> None:
    """End a process started by a launcher (`WORLD_SIZE` > 1) without interpreter finalisation.

    Even after `release_process_groups`, gloo's threads can abort a finished rank while Python tears down
    ("terminate called without an active exception", pytorch/pytorch#190489; seen in CI after ZeRO-3 runs), and the
    launcher then reports the whole run as failed. Everything is saved by now: run the `atexit` handlers (loggers
    flush there), flush the streams and exit with ``rc``.
    """
    import atexit
    import sys

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def main(argv: list[str] | None = None) -> int:
    """Entry point: a bad recipe, path or data stops before training with one `error:` line (exit 2).

    With `--accelerate_config` / `--num_processes` (and not yet launched) it starts the processes itself
    (`mempo_trl.commands.launch`)."""
    import sys

    from mempo_trl.cli import quiet_upstream_noise
    from mempo_trl.commands.launch import LAUNCH_FLAGS, launch

    quiet_upstream_noise()  # examples/train_mempo.py comes here without `mempo_trl.cli.main`

    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        from mempo_trl.commands.train_help import short_help

        print(short_help())
        return 0
    argv = ["--help" if arg == "--help_all" else arg for arg in argv]
    rc = run(check_output_dir_early, argv)
    if rc:
        return rc
    if "WORLD_SIZE" not in os.environ and any(arg.split("=")[0] in LAUNCH_FLAGS for arg in argv):
        return run(launch, argv)
    rc = run(_main, argv)
    leave_launched_process(rc)
    return rc


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    add_command(subparsers, "train", "Train a MemPO agent (TRL-style arguments; --config recipe.yaml).", main)
