"""The MemPO training recipe, read top-down like TRL's `trl/scripts/grpo.py`: `main` loads the model and tokenizer,
the dataset, the retriever and the reward functions, builds a `MemPOTrainer`, trains, saves and pushes.

`mempo-trl train` (`mempo_trl.commands.train`) and `examples/train_mempo.py` both run `main`, with the arguments
`TrlParser((ScriptArguments, MemPOConfig, ModelConfig, RetrieverArguments))` parses from `--config recipe.yaml` and
the command line. Every input is a path or a name the recipe states (model, data, corpus or server): the offline
kit's are written to disk by `mempo-trl kit learner` / `mempo-trl kit tiny`.
"""

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import trl

from mempo_trl.retrieval.settings import RetrieverArguments, build_retriever, describe_retriever


REWARD_FUNCS = {"mempo_outcome_reward", "mempo_all_parts_reward", "mempo_format_reward"}


@dataclass
class ScriptArguments(trl.ScriptArguments):
    """TRL's script arguments (`dataset_name`, `dataset_config`, `dataset_train_split`, `dataset_test_split`; the
    help of three says what MemPO reads) and MemPO's: rewards, output handling, environment and held-out evaluation.
    TRL's `ignore_bias_buffers` (a DDP switch of its DPO scripts) is not used."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "QA data: a .jsonl/.json/.parquet file, a directory of {split}.jsonl files or a `datasets` "
            "name (FlashRAG or Search-R1 rows); with `environment`, a .jsonl of its reset rows."
        },
    )
    dataset_test_split: str = field(
        default="test",
        metadata={
            "help": "Split (or QA file) to evaluate on (`heldout_questions`, `eval_strategy`); never the "
            "training rows."
        },
    )
    dataset_streaming: bool = field(
        default=False,
        metadata={"help": "Not supported: every row is validated before training starts (true is refused)."},
    )

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Replace the results of an earlier run in `output_dir` (set aside, deleted once this run saves a "
            "checkpoint or its model and put back if it ends without; other files there are kept), or write into a "
            "directory that holds other files. Without it (or `resume_from_checkpoint` of that run) such a directory is refused before "
            "anything is loaded."
        },
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["mempo_outcome_reward"],
        metadata={
            "help": "Outcome reward functions: mempo_outcome_reward, mempo_all_parts_reward (multi-objective rows: "
            "1 only when every part is right), mempo_format_reward or a dotted import path "
            "(`my_lib.rewards.custom_reward`); weigh them with `reward_weights`. `mempo_format_reward` helps a "
            "small model that rarely answers right."
        },
    )
    environment: str | None = field(
        default=None,
        metadata={
            "help": "Train on a TRL-style environment instead of search: an import path (my_pkg.envs.MyEnv; "
            "the kit's: mempo_trl.kit.envs.KeyVaultEnv, ...). dataset_name is then a .jsonl of its reset rows; "
            "the reward is its get_reward() and/or reward_funcs."
        },
    )
    heldout_questions: int = field(
        default=0,
        metadata={
            "help": "Evaluate greedily on this many questions of `dataset_test_split` before and after "
            "training, and print both (`mempo_trl.callbacks.HeldOutEvalCallback`); single-process runs only. "
            "0: off."
        },
    )
    heldout_row_metric: str | None = field(
        default=None,
        metadata={
            "help": "Dotted import path of a factory `f(retriever)` returning the held-out per-row metric "
            "(`mempo_trl.evaluation.RowMetric`; the quick start's: mempo_trl.kit.learner.memory_recall_metric). "
            "Default: EM and F1."
        },
    )


def load_reward_funcs(names: list[str]) -> list:
    """The reward functions `names` name: ours by name, anything else by dotted import path (as TRL's scripts).

    Example:
        >>> [f.__name__ for f in load_reward_funcs(["mempo_all_parts_reward", "mempo_trl.rewards.mempo_format_reward"])]
        ['mempo_all_parts_reward', 'mempo_format_reward']
    """
    from mempo_trl import rewards

    return [
        getattr(rewards, name)
        if name in REWARD_FUNCS
        else import_object(name, f"reward function (use one of {sorted(REWARD_FUNCS)} or a dotted import path)")
        for name in names
    ]


def import_object(path: str, what: str):
    """The object a dotted import path (``my_lib.rewards.custom_reward``) names; `ValueError` naming ``what``."""
    import importlib

    module, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError):
        raise ValueError(f"unknown {what}: {path!r} is not an importable `module.name`.") from None


def load_model_and_tokenizer(model_args, training_args):
    """The policy and its tokenizer (left padding), from `model_name_or_path` with `ModelConfig`'s settings."""
    import torch
    from transformers import AutoModelForCausalLM

    from mempo_trl.loading import load_tokenizer

    tokenizer = load_tokenizer(model_args.model_name_or_path, revision=model_args.model_revision)
    tokenizer.padding_side = "left"
    dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path,
        revision=model_args.model_revision,
        dtype=dtype,
        attn_implementation=model_args.attn_implementation,
        quantization_config=trl.get_quantization_config(model_args),
    )
    return model, tokenizer


def task_class(script_args: ScriptArguments) -> type:
    """The kind of task the run trains on: `EnvironmentTask` with `environment`, else `SearchTask`."""
    from mempo_trl.tasks import EnvironmentTask, SearchTask

    return EnvironmentTask if script_args.environment else SearchTask


def build_task(script_args: ScriptArguments, retriever_args: RetrieverArguments) -> tuple[Any, dict[str, str]]:
    """The run's task, built once, and what the model card says of it (`trainer.model_card_info`): an
    `EnvironmentTask` on the class `environment` names (checked against TRL's convention), else a `SearchTask` on the
    retriever the retriever arguments describe (a server is asked now: it fails before training, with the URL in the
    message)."""
    from mempo_trl.environments import check_environment, load_environment
    from mempo_trl.tasks import EnvironmentTask, SearchTask

    if script_args.environment:
        environment_factory = load_environment(script_args.environment)
        check_environment(environment_factory)
        return EnvironmentTask(environment_factory), {"environment": script_args.environment}
    retriever = build_retriever(retriever_args, ride_out_outages=True)
    if retriever_args.retriever_url:
        retriever.health()
    retriever_arg = retriever_args.retriever_url or retriever_args.corpus
    return SearchTask(retriever), {"retriever": describe_retriever(retriever_args), "retriever_arg": retriever_arg}


def load_dataset(script_args: ScriptArguments, split: str):
    """`split` of `dataset_name`, as the run's task reads it (`Task.read_rows`: validated QA rows, or the reset rows
    of an environment)."""
    if not script_args.dataset_name:
        raise ValueError(
            "no data: set dataset_name (a QA .jsonl, a directory of {split}.jsonl files or a `datasets` "
            "name; `mempo-trl kit learner` writes one)."
        )
    return task_class(script_args).read_rows(script_args.dataset_name, split, script_args.dataset_config)


def check_heldout_source(script_args: ScriptArguments, training_args) -> None:
    """Refuse an evaluation (`heldout_questions`, `eval_strategy`) whose rows would be the training rows: a file
    `dataset_name` has no splits, so its `dataset_test_split` rows are the training file unless that names a file."""
    evaluates = script_args.heldout_questions > 0 or training_args.eval_strategy != "no"
    if not evaluates or not task_class(script_args).heldout or not script_args.dataset_name:
        return

    def source(split: str) -> tuple:
        if Path(split).is_file():
            return (Path(split).resolve(),)
        name = script_args.dataset_name
        return (Path(name).resolve(),) if Path(name).is_file() else (name, script_args.dataset_config, split)

    if source(script_args.dataset_train_split) == source(script_args.dataset_test_split):
        strategy = getattr(training_args.eval_strategy, "value", training_args.eval_strategy)
        what = f"eval_strategy={strategy}"
        if script_args.heldout_questions > 0:
            what = f"heldout_questions={script_args.heldout_questions}"
        raise ValueError(
            f"{what} would evaluate on the training rows: dataset_test_split {script_args.dataset_test_split!r} of "
            f"{script_args.dataset_name} is the data trained on (a file has no splits). Give held-out questions as a "
            "file (--dataset_test_split path/test.jsonl), use a directory holding train.jsonl and test.jsonl, or "
            "turn the evaluation off."
        )


def add_callbacks(trainer, script_args: ScriptArguments, training_args, tokenizer) -> None:
    """The launch banner, the one-line step summary, checkpoint-on-SIGTERM and, with `heldout_questions`, the
    held-out evaluation before and after training."""
    from mempo_trl.callbacks import HeldOutProgressCallback, LaunchBannerCallback, use_step_summary
    from mempo_trl.interruptions import SaveOnSignalCallback

    trainer.add_callback(LaunchBannerCallback(trainer))
    trainer.add_callback(SaveOnSignalCallback(trainer, keep_handlers=True))  # `train` saves and evaluates under them
    use_step_summary(trainer)
    if script_args.heldout_questions > 0 and training_args.world_size > 1:
        # The held-out evaluation generates on the main process alone: under ZeRO-3 that forward is a collective the
        # other processes never join. Multi-process runs evaluate afterwards with `mempo-trl eval`.
        if training_args.process_index == 0:
            print(
                f"heldout_questions={script_args.heldout_questions} is skipped on {training_args.world_size} "
                "processes: evaluate the saved model with `mempo-trl eval` instead."
            )
    elif script_args.heldout_questions > 0:
        from mempo_trl.callbacks import HeldOutEvalCallback

        row_metric = None
        if script_args.heldout_row_metric:
            row_metric = import_object(script_args.heldout_row_metric, "heldout_row_metric")(trainer.task.retriever)
        heldout = load_dataset(script_args, script_args.dataset_test_split)
        rows = list(heldout.select(range(min(script_args.heldout_questions, len(heldout)))))
        progress = HeldOutProgressCallback(len(rows), at_end=False)  # `train` evaluates after saving the model
        trainer.add_callback(progress)
        trainer.add_callback(
            HeldOutEvalCallback(
                tokenizer,
                rows,
                trainer.task.retriever,
                trainer.protocol,
                on_result=progress.report,
                row_metric=row_metric,
                at_end=False,
            )
        )


def build_trainer(script_args: ScriptArguments, training_args, model_args, retriever_args: RetrieverArguments):
    """Load and validate the data, the task (`build_task`) and the model; return a ready `MemPOTrainer`."""
    from mempo_trl.trainer import MemPOTrainer

    train_dataset = load_dataset(script_args, script_args.dataset_train_split)
    eval_dataset = None
    if training_args.eval_strategy != "no" and task_class(script_args).heldout:
        eval_dataset = load_dataset(script_args, script_args.dataset_test_split)
    task, card_info = build_task(script_args, retriever_args)
    reward_funcs = load_reward_funcs(script_args.reward_funcs)
    if script_args.reward_funcs == ScriptArguments().reward_funcs:
        reward_funcs = None  # the task's default (`Task.prepare`): the outcome reward, or the environment's
    model, tokenizer = load_model_and_tokenizer(model_args, training_args)
    trainer = MemPOTrainer(
        model=model,
        task=task,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=trl.get_peft_config(model_args),
    )
    trainer.model_card_info = {
        "base_model": model_args.model_name_or_path,
        "dataset": script_args.dataset_name,
        "example_question": train_dataset[0].get("question"),
        **card_info,
    }
    add_callbacks(trainer, script_args, training_args, tokenizer)
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
    """Train, save the model, evaluate it on the held-out rows, write the metrics and the model card (and push).
    Returns the final metrics.

    First checks that the disk has room for the final model and a checkpoint. Training that stops early keeps its
    work: on a stop signal, a retriever that fails for the whole retry budget (`RetrieverOutage`) or answers
    wrongly, or a non-finite loss or advantage, a checkpoint of the last finished step is saved and the error is
    raised again naming it (`--resume_from_checkpoint ...`); so does any other error of a single-process run after
    a step. An error before this process finished a step (a resume that fails while loading) saves nothing. A final
    save that fails keeps the model in a temporary directory named in the error (`save_model_or_rescue`). The final
    save is marked incomplete until the metrics
    and card are written (`mempo_trl.checkpoints.begin_final_save`). A stop signal during that save waits for it and
    skips the evaluation after training; one during that evaluation stops it at once. Either way the metrics and
    card are written without it, nothing is pushed, and `TrainingStopped` says that the model is saved.
    """
    from mempo_trl.interruptions import SaveOnSignalCallback

    stop = next((c for c in trainer.callback_handler.callbacks if isinstance(c, SaveOnSignalCallback)), None)
    try:
        return _train_and_save(trainer, training_args, dataset_name, stop)
    finally:
        if stop is not None:
            stop.restore()


def _train_and_save(trainer, training_args, dataset_name: str | None, stop) -> dict:
    from mempo_trl.callbacks import end_progress_bar
    from mempo_trl.checkpoints import (
        begin_final_save,
        check_room_to_save,
        disk_full_error,
        end_final_save,
        is_disk_full,
        newest_complete_checkpoint,
        read_trainer_state,
        save_model_or_rescue,
    )
    from mempo_trl.commands import error_message
    from mempo_trl.interruptions import NonFiniteError, PeerLost, TrainingStopped, is_peer_lost, peer_lost_message
    from mempo_trl.model_card import heldout_summary
    from mempo_trl.outputs import drop_set_aside
    from mempo_trl.retrieval import RetrievalError, RetrieverOutage

    check_room_to_save(trainer)
    resume = training_args.resume_from_checkpoint
    start = read_trainer_state(resume)["global_step"] if resume else 0
    try:
        result = trainer.train(resume_from_checkpoint=resume)
    except (RetrievalError, NonFiniteError) as err:
        end_progress_bar(trainer)  # the error's line starts a line of its own
        when = "once the server answers again" if isinstance(err, RetrieverOutage) else "once that is fixed"
        if trainer.state.global_step <= start:  # no step ran here: nothing to save (and never over `resume`)
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
        if training_args.world_size > 1 and is_peer_lost(err):
            end_progress_bar(trainer)
            checkpoint = newest_complete_checkpoint(training_args.output_dir)
            step = trainer.state.global_step
            raise PeerLost(peer_lost_message(err, step, training_args.ddp_timeout, checkpoint)) from err
        if trainer.state.global_step <= start or training_args.world_size > 1:
            raise  # no step ran here (a failed load writes nothing), or the other processes would not join the save
        checkpoint = save_checkpoint_and_release(trainer)
        resume = f"Saved {checkpoint}; once that is fixed, rerun with --resume_from_checkpoint {checkpoint}."
        if error_message(err) is None:  # a bug: keep its traceback, after saying where the work is
            print(
                f"training stopped after step {trainer.state.global_step} by the error below. {resume}",
                file=sys.stderr,
                flush=True,
            )
            raise
        raise TrainingStopped(f"training stopped: {str(err).rstrip('.')}. {resume}") from err
    if stop is not None and stop.received and trainer.state.global_step < trainer.state.max_steps:
        release_process_groups(trainer)  # the checkpoint was saved by every process at the last step
        checkpoint = Path(training_args.output_dir, f"checkpoint-{trainer.state.global_step}")
        raise TrainingStopped(
            f"training stopped by {stop.received} after step {trainer.state.global_step}/{trainer.state.max_steps}. "
            f"Saved {checkpoint}; rerun with --resume_from_checkpoint {checkpoint} to continue."
        )
    if trainer.is_world_process_zero():
        begin_final_save(training_args.output_dir, trainer.state.global_step)
    save_model_or_rescue(trainer, training_args.output_dir)
    if trainer.is_world_process_zero():
        drop_set_aside(training_args.output_dir)  # the trained model is in place
    stopped_by = evaluate_after_training(trainer, stop)
    metrics = {**result.metrics, **trainer.final_metrics()}
    metrics.update(heldout_summary(trainer.callback_handler.callbacks) or {})
    if trainer.is_world_process_zero():
        Path(training_args.output_dir, "mempo_metrics.json").write_text(json.dumps(metrics, indent=2))
        trainer.create_model_card(dataset_name=dataset_name)
        end_final_save(training_args.output_dir)
    if stopped_by:  # the held-out evaluation runs in single-process runs only: nothing to release
        raise TrainingStopped(
            f"training finished and the model is saved in {training_args.output_dir}; the evaluation after "
            f"training was stopped by {stopped_by} (the metrics and model card leave it out)."
        )
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=dataset_name)
    return metrics


def heldout_callback(trainer):
    """The recipe's `HeldOutEvalCallback` of `trainer`, or None."""
    from mempo_trl.callbacks import HeldOutEvalCallback

    return next((c for c in trainer.callback_handler.callbacks if isinstance(c, HeldOutEvalCallback)), None)


def end_of_run(trainer, output_dir: str, metrics: dict) -> str:
    """What a finished run prints: where the model, metrics and card went, then the one line that matters (the
    held-out EM before and after training, else `format_run_summary`); every metric stays in mempo_metrics.json."""
    from mempo_trl.callbacks import format_run_summary

    heldout = heldout_callback(trainer)
    last = (
        heldout.before_after()
        if heldout is not None and heldout.curve
        else format_run_summary(trainer.state.global_step, metrics)
    )
    out = Path(output_dir)
    return f"model saved to {out} (metrics: {out / 'mempo_metrics.json'}, model card: {out / 'README.md'})\n{last}"


def evaluate_after_training(trainer, stop) -> str | None:
    """The held-out evaluation after training (with ``heldout_questions``), once the model is saved; a stop signal
    during it (or received before) ends it at once. Returns that signal's name, or None."""
    from mempo_trl.callbacks import HeldOutProgressCallback
    from mempo_trl.interruptions import StoppedBySignal

    heldout = heldout_callback(trainer)
    if heldout is None or heldout.at_end or not trainer.is_world_process_zero():
        return None
    progress = next(c for c in trainer.callback_handler.callbacks if isinstance(c, HeldOutProgressCallback))
    try:
        with stop.interruptible():
            progress.announce("after")
            heldout.evaluate(trainer.state.global_step, trainer.model)
    except StoppedBySignal as stopped:
        return str(stopped)
    return None


def save_checkpoint_and_release(trainer) -> Path:
    """Save a checkpoint of the last finished step, then `release_process_groups` (no process exits, and gets the
    others killed, before all saved)."""
    from mempo_trl.checkpoints import save_checkpoint_now
    from mempo_trl.outputs import drop_set_aside

    checkpoint = save_checkpoint_now(trainer)
    if trainer.is_world_process_zero():
        drop_set_aside(trainer.args.output_dir)  # the run has a checkpoint of its own now
    release_process_groups(trainer)
    return checkpoint


def check_before_training(
    script_args: ScriptArguments, training_args, model_args, retriever_args, first: bool = True
) -> None:
    """Fail in seconds, not after training: model path, logging backends, the Hub when pushing, a writable
    `output_dir` apart from the inputs and free of earlier results (`mempo_trl.outputs.claim_output_dir`, which the
    run's first process holds; `first=False` on the launcher of a machine other than the main one)."""
    from mempo_trl.loading import (
        check_hub_reachable,
        check_model_path,
        check_vllm_group_port,
        check_vllm_server,
        check_vllm_weight_sync_device,
        vllm_server_url,
    )
    from mempo_trl.outputs import check_report_to, claim_output_dir, prepare_output_dir

    if not model_args.model_name_or_path:
        raise ValueError(
            "no model: set model_name_or_path (a model directory or a Hub id; `mempo-trl kit learner` "
            "writes a small one)."
        )
    check_model_path(model_args.model_name_or_path)
    if script_args.dataset_streaming:
        raise ValueError(
            "dataset_streaming is not supported: MemPO validates every row of `dataset_name` before "
            "training (set dataset_streaming: false)."
        )
    if not task_class(script_args).heldout and script_args.heldout_questions > 0:
        raise ValueError(
            "heldout_questions evaluates the search task; evaluate an environment agent with "
            f"`mempo-trl eval --environment {script_args.environment}` instead (set heldout_questions: 0)."
        )
    check_heldout_source(script_args, training_args)
    check_report_to(training_args.report_to)
    if training_args.push_to_hub:
        check_hub_reachable()
    if training_args.use_vllm and training_args.vllm_mode == "server":
        url = vllm_server_url(
            training_args.vllm_server_host, training_args.vllm_server_port, training_args.vllm_server_base_url
        )
        check_vllm_server(url, training_args.vllm_server_timeout)
        if first and int(os.environ.get("RANK", "0")) == 0:  # the trainer's main process hosts the weight-sync group
            check_vllm_group_port(urlparse(url).hostname, training_args.vllm_group_port)
        check_vllm_weight_sync_device(training_args.use_cpu)
    inputs = {
        "model": model_args.model_name_or_path,
        "dataset": script_args.dataset_name,
        "corpus": retriever_args.corpus,
    }
    if first and int(os.environ.get("RANK", "0")) == 0:  # the run's first process holds output_dir until it ends
        claim_output_dir(
            training_args.output_dir, script_args.overwrite_output_dir, training_args.resume_from_checkpoint, inputs
        )
    else:
        prepare_output_dir(training_args.output_dir, check_existing=False, inputs=inputs)


def protocol_changes(training_args, task: type) -> str | None:
    """One line naming the turn-protocol settings (`max_turns`, ...) of this run that differ from those saved in the
    checkpoint it resumes (its ``mempo_agent.json``; ``task``: the run's task class, `task_class`), or None: the run goes
    on with its own, as said."""
    from dataclasses import asdict

    from mempo_trl.protocol import TurnProtocol

    saved = TurnProtocol.from_pretrained(training_args.resume_from_checkpoint)
    if saved is None:
        return None
    _, changes = saved.override(**asdict(task.protocol(training_args.turn_protocol())))
    if not changes:
        return None
    return (
        f"mempo-trl: resuming {training_args.resume_from_checkpoint} with another turn protocol: {'; '.join(changes)} "
        "(this run's settings apply from here on and are saved with the model)."
    )


def main(script_args: ScriptArguments, training_args, model_args, retriever_args: RetrieverArguments) -> int:
    """Check the inputs, build the trainer, train, save (and push); print where everything went."""
    from mempo_trl.checkpoints import check_checkpoint_lora, prepare_resume
    from mempo_trl.processes import bound_collectives

    bound_collectives(training_args.ddp_timeout)  # a machine gone: the others end after ddp_timeout, not hang
    if training_args.ddp_find_unused_parameters is None:
        # Trainer's default without activation checkpointing is True, and DDP then warns every run that it found none:
        # every parameter of a MemPO policy (full or LoRA) gets a gradient.
        training_args.ddp_find_unused_parameters = False
    check_before_training(script_args, training_args, model_args, retriever_args)
    # validates the checkpoint (its files, and that it holds this model) before any model is loaded
    finished = prepare_resume(
        training_args, model_args.model_name_or_path, model_args.model_revision, model_args.use_peft
    )
    if training_args.resume_from_checkpoint:
        check_checkpoint_lora(training_args.resume_from_checkpoint, model_args)
    if finished:
        if int(os.environ.get("RANK", "0")) == 0:
            print(finished)
        return 0
    changes = training_args.resume_from_checkpoint and protocol_changes(training_args, task_class(script_args))
    if changes and int(os.environ.get("RANK", "0")) == 0:
        print(changes)
    trainer = build_trainer(script_args, training_args, model_args, retriever_args)
    from mempo_trl.callbacks import DropSetAsideOnSave

    trainer.add_callback(DropSetAsideOnSave())
    metrics = train(trainer, training_args, script_args.dataset_name)
    if int(os.environ.get("RANK", "0")) == 0:
        print(end_of_run(trainer, training_args.output_dir, metrics))
    elif int(os.environ.get("LOCAL_RANK", "0")) == 0:  # the first process of another machine than the main one
        done = f"trained {trainer.state.global_step} steps; the main machine (machine_rank 0) saved the model"
        print(f"{done}, metrics and model card to {training_args.output_dir}")
    release_process_groups(trainer)
    return 0


def make_parser(prog: str = "mempo-trl train") -> trl.TrlParser:
    """The recipe's parser: `ScriptArguments`, `MemPOConfig`, TRL's `ModelConfig` and `RetrieverArguments`."""
    from mempo_trl.config import MemPOConfig

    return trl.TrlParser((ScriptArguments, MemPOConfig, trl.ModelConfig, RetrieverArguments), prog=prog)
