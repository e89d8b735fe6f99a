"""Callbacks of `mempo-trl train`: console output on rank 0 (a start banner, a one-line summary per logged step) and
the held-out evaluation of ``--heldout_questions`` (`HeldOutEvalCallback`).

The banner states what really runs, once the model is wrapped, so that a launch that silently fell back (two
processes training two independent copies, a DeepSpeed config that ended up as plain DDP) is visible at once::

    mempo-trl: world_size=2 distributed_type=DEEPSPEED model=DeepSpeedEngine(PeftModel) zero_stage=2 device=cpu ...

`use_step_summary(trainer)` prints one short line per training log in place of the raw log dict (which still goes
to the `report_to` backends as TRL logs it; evaluation and final logs are printed as TRL prints them)::

    step 3/200 | reward 0.312 | em 0.297 | format 0.953 | mem_reward 0.021 | prompt/round 412.5 | 14.20 s/step
"""

import os
import time
from collections.abc import Mapping

from tqdm.auto import tqdm
from transformers import PrinterCallback, ProgressCallback, TrainerCallback


SUMMARY_FIELDS = (
    ("reward", "reward"),
    ("em", "episode/em"),
    ("format", "episode/format_valid"),
    ("mem_reward", "memory/reward"),
    ("prompt/round", "tokens/prompt_per_round"),
)
"""(label, logged metric) pairs of the step summary line; a metric not logged at that step shows as `-`."""


def describe_model(wrapped, model) -> str:
    """`Wrapper(Model)` for a wrapped model (DDP, DeepSpeed), the class name alone when it is not wrapped.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(1, 1)
        >>> describe_model(model, model), describe_model(torch.nn.Sequential(model), model)
        ('Linear', 'Sequential(Linear)')
    """
    inner = type(model).__name__
    return inner if wrapped is None or wrapped is model else f"{type(wrapped).__name__}({inner})"


def launch_warnings(num_processes: int, distributed_type: str, environ: Mapping[str, str]) -> list[str]:
    """The silent launch fall-backs, from what the launcher asked for (`environ`) and what accelerate set up.

    Example:
        >>> launch_warnings(1, "NO", {"WORLD_SIZE": "2"})[0][:54]
        'WORLD_SIZE=2 processes were launched but this one sees'
        >>> launch_warnings(2, "DEEPSPEED", {"WORLD_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "true"})
        []
    """
    warnings = []
    launched = int(environ.get("WORLD_SIZE", "1"))
    if launched != num_processes:
        warnings.append(
            f"WORLD_SIZE={launched} processes were launched but this one sees a world of {num_processes}: they "
            "train independent copies. On a machine without GPUs set `use_cpu: true` in the recipe."
        )
    if environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true" and distributed_type != "DEEPSPEED":
        warnings.append(
            f"the accelerate config asks for DeepSpeed but the run is {distributed_type}: on a machine without GPUs "
            "set `use_cpu: true` in the recipe (not ACCELERATE_USE_CPU, which turns DeepSpeed into DDP)."
        )
    return warnings


def format_step_summary(step: int, max_steps: int, logs: Mapping[str, float]) -> str:
    """One line: the step, the `SUMMARY_FIELDS` and TRL's `step_time`.

    Example:
        >>> format_step_summary(1, 2, {"reward": 0.5, "episode/em": 0.25, "step_time": 3.0})
        'step 1/2 | reward 0.500 | em 0.250 | format - | mem_reward - | prompt/round - | 3.00 s/step'
    """
    parts = [f"step {step}/{max_steps}"]
    for label, key in SUMMARY_FIELDS:
        value = logs.get(key)
        shown = "-" if value is None else (f"{value:.1f}" if key.startswith("tokens/") else f"{value:.3f}")
        parts.append(f"{label} {shown}")
    step_time = logs.get("step_time")
    parts.append("- s/step" if step_time is None else f"{step_time:.2f} s/step")
    return " | ".join(parts)


def format_run_summary(steps: int, metrics: Mapping[str, float]) -> str:
    """One line for the end of a run of ``steps`` steps without a held-out evaluation: the wall time and the last
    step's summary fields (each over that step's sampled episodes only).

    Example:
        >>> format_run_summary(2, {"train_runtime": 30.4, "reward": 0.5, "episode/em": 0.25})
        'trained 2 steps in 30 s | last step: reward 0.500 | em 0.250 | format - (no held-out evaluation: set heldout_questions)'
    """
    last = [
        f"{label} {'-' if metrics.get(key) is None else f'{metrics[key]:.3f}'}"
        for label, key in SUMMARY_FIELDS
        if key in ("reward", "episode/em", "episode/format_valid")
    ]
    return (
        f"trained {steps} step{'' if steps == 1 else 's'} in {metrics.get('train_runtime', 0):.0f} s | last step: "
        + " | ".join(last)
        + " (no held-out evaluation: set heldout_questions)"
    )


class LaunchBannerCallback(TrainerCallback):
    """Print the banner (and any `launch_warnings`) when training starts.

    It holds the trainer because callbacks receive the unwrapped model only, and `trainer.model_wrapped` is set
    by `train()` just before `on_train_begin`.
    """

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        accelerator = self.trainer.accelerator
        distributed_type = accelerator.distributed_type.value
        facts = {
            "world_size": accelerator.num_processes,
            "distributed_type": distributed_type,
            "model": describe_model(self.trainer.model_wrapped, self.trainer.model),
        }
        if accelerator.state.deepspeed_plugin is not None:
            facts["zero_stage"] = accelerator.state.deepspeed_plugin.zero_stage
        facts.update(
            {
                "device": accelerator.device,
                "mixed_precision": accelerator.mixed_precision,
                "generation": f"vllm-{args.vllm_mode}" if args.use_vllm else "transformers",
                "per_device_batch": args.per_device_train_batch_size,
                "num_generations": args.num_generations,
                "max_steps": state.max_steps,
            }
        )
        tqdm.write("mempo-trl: " + " ".join(f"{key}={value}" for key, value in facts.items()))
        for warning in launch_warnings(accelerator.num_processes, distributed_type, os.environ):
            tqdm.write(f"mempo-trl: WARNING: {warning}")


class StepSummaryCallback(TrainerCallback):
    """Print `format_step_summary` for every training log (not for evaluation logs or the final summary)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "reward" in logs:
            tqdm.write(format_step_summary(state.global_step, state.max_steps, logs))


def _is_training_log(logs) -> bool:
    return bool(logs) and "reward" in logs


class SummaryProgressCallback(ProgressCallback):
    """TRL's progress bar without the raw dict of training logs (`StepSummaryCallback` prints those)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not _is_training_log(logs):
            super().on_log(args, state, control, logs=logs, **kwargs)


class SummaryPrinterCallback(PrinterCallback):
    """`PrinterCallback` (used with `disable_tqdm`) without the raw dict of training logs."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not _is_training_log(logs):
            super().on_log(args, state, control, logs=logs, **kwargs)


def use_step_summary(trainer) -> None:
    """Print one `format_step_summary` line per training log instead of the raw log dict.

    Example:
        >>> use_step_summary(trainer)  # doctest: +SKIP
    """
    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(SummaryProgressCallback)
    if trainer.pop_callback(PrinterCallback) is not None:
        trainer.add_callback(SummaryPrinterCallback)
    trainer.add_callback(StepSummaryCallback())


def end_progress_bar(trainer) -> None:
    """Close the training progress bar of a run that an error ends (`on_train_end` never comes), so that the error's
    line starts a line of its own."""
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, ProgressCallback) and callback.training_bar is not None:
            callback.training_bar.close()
            callback.training_bar = None


class HeldOutEvalCallback(TrainerCallback):
    """Evaluates the trained model on held-out rows before training, every ``eval_every`` steps (0: never in
    between) and after training, on the main process: greedy episodes of ``protocol`` (a `TurnProtocol`; the
    trainer's is ``trainer.protocol``) by `mempo_trl.evaluation.evaluate_model`, summed up by
    `mempo_trl.evaluation.heldout_metrics` with ``row_metric`` (default: EM and F1). ``curve`` holds ``{"step", **metrics, "eval_seconds"}`` per evaluation; ``on_result`` (if given) is called
    with the curve after each one. With ``at_end=False`` training's end does not evaluate: the caller does, with
    `evaluate` (`mempo-trl train` saves the model first)."""

    def __init__(
        self,
        tokenizer,
        rows,
        retriever,
        protocol=None,
        eval_every: int = 0,
        on_result=None,
        row_metric=None,
        at_end: bool = True,
    ):
        self.tokenizer, self.rows, self.retriever, self.protocol = tokenizer, list(rows), retriever, protocol
        self.eval_every, self.on_result, self.row_metric = eval_every, on_result, row_metric
        self.at_end = at_end
        self.curve: list[dict] = []

    def evaluate(self, step: int, model) -> None:
        """Evaluate ``model`` at ``step`` and append the result to ``curve`` (once per step)."""
        from mempo_trl.evaluation import evaluate_model, exact_match_f1, heldout_metrics

        if self.curve and self.curve[-1]["step"] == step:
            return
        start = time.perf_counter()
        result = evaluate_model(model, self.tokenizer, self.rows, self.retriever, self.protocol)
        metrics = heldout_metrics(result, self.rows, self.row_metric or exact_match_f1)
        self.curve.append({"step": step, **metrics, "eval_seconds": time.perf_counter() - start})
        if self.on_result is not None:
            self.on_result(self.curve)

    def before_after(self) -> str:
        """One line: held-out EM (and format, and memory recall when measured) of the first and the last evaluation.

        Example:
            >>> callback = HeldOutEvalCallback(None, [{}, {}], None)
            >>> callback.curve = [{"step": 0, "em": 0.1, "format_valid": 0.5, "memory_recall": 0.25},
            ...                   {"step": 30, "em": 0.2, "format_valid": 0.75, "memory_recall": 0.5}]
            >>> callback.before_after()
            'held-out EM (2 questions, greedy): 0.100 before training (step 0) -> 0.200 after (step 30) | format 0.500 -> 0.750 | memory recall 0.250 -> 0.500'
        """
        first, last = self.curve[0], self.curve[-1]
        parts = [
            f"held-out EM ({len(self.rows)} questions, greedy): {first['em']:.3f} before training (step "
            f"{first['step']}) -> {last['em']:.3f} after (step {last['step']})"
        ]
        parts += [
            f"{label} {first[key]:.3f} -> {last[key]:.3f}"
            for label, key in (("format", "format_valid"), ("memory recall", "memory_recall"))
            if key in first and key in last
        ]
        return " | ".join(parts)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero:
            self.evaluate(state.global_step, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.eval_every and state.global_step % self.eval_every == 0 and state.is_world_process_zero:
            self.evaluate(state.global_step, model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self.at_end and state.is_world_process_zero:
            self.evaluate(state.global_step, model)


class HeldOutProgressCallback(TrainerCallback):
    """Console lines around each held-out evaluation before and after training, which otherwise run silently for
    seconds to minutes: one line when it starts, one with its result and time when it ends (`report`, to be given
    to the evaluating callback as its ``on_result``). Add it before that callback, so that it announces first::

        held-out evaluation before training: 100 questions, greedy ...
        held-out evaluation at step 0: EM 0.285 | format 0.670 | memory recall 0.105 (38 s)

    With ``at_end=False`` (the evaluating callback's ``at_end``) the caller announces the evaluation after training.
    """

    def __init__(self, questions: int, at_end: bool = True):
        self.questions, self.at_end = questions, at_end

    def announce(self, when: str) -> None:
        """Print that the evaluation ``when`` ("before" or "after") training starts."""
        tqdm.write(f"held-out evaluation {when} training: {self.questions} questions, greedy ...")

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.announce("before")

    def on_train_end(self, args, state, control, **kwargs):
        if self.at_end and state.is_world_process_zero:
            self.announce("after")

    def report(self, curve: list[dict]) -> None:
        tqdm.write(format_heldout_result(curve[-1]))


def format_heldout_result(point: Mapping[str, float]) -> str:
    """One held-out evaluation as a line.

    Example:
        >>> format_heldout_result({"step": 40, "em": 0.35, "format_valid": 0.91, "memory_recall": 0.243, "eval_seconds": 12.3})
        'held-out evaluation at step 40: EM 0.350 | format 0.910 | memory recall 0.243 (12 s)'
    """
    parts = [f"EM {point['em']:.3f}"]
    parts += [
        f"{label} {point[key]:.3f}"
        for label, key in (("format", "format_valid"), ("memory recall", "memory_recall"))
        if key in point
    ]
    seconds = f" ({point['eval_seconds']:.0f} s)" if "eval_seconds" in point else ""
    return f"held-out evaluation at step {point['step']}: {' | '.join(parts)}{seconds}"


class DropSetAsideOnSave(TrainerCallback):
    """Once a checkpoint is saved, the run has results of its own in place: delete what it set aside when it claimed
    `output_dir` (`mempo_trl.outputs.drop_set_aside`: the previous run's outputs with `--overwrite_output_dir`, or
    the later checkpoints a resume abandons), which until then is put back if the run ends without."""

    def on_save(self, args, state, control, **kwargs):
        from mempo_trl.outputs import drop_set_aside

        if state.is_world_process_zero:
            drop_set_aside(args.output_dir)
