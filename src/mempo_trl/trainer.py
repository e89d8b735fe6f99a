"""`MemPOTrainer`: TRL's `GRPOTrainer` with a multi-turn search rollout and the MemPO memory advantage."""

import copy
import logging
import math
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from trl import GRPOTrainer
from trl.extras.profiling import profiling_context

from mempo_trl.advantages import MemPOAdvantages, batch_advantages
from mempo_trl.config import ROW_LEVEL_LOSSES, MemPOConfig
from mempo_trl.data import check_map_style, named_datasets
from mempo_trl.dynamic_sampling import ScoredStep, dynamic_sampling
from mempo_trl.grpo_mirror import GRPOMirror
from mempo_trl.interruptions import check_finite
from mempo_trl.memory import MemoryScores
from mempo_trl.memory_scoring import MemoryScoring
from mempo_trl.metrics import StepAccount, final_metrics, mean_metrics, round_metric_values
from mempo_trl.model_card import mempo_model_card
from mempo_trl.padding import round_tensors
from mempo_trl.rewards import (
    OutcomeScore,
    announce_reward_format,
    episode_metrics,
    episode_outcome,
    reward_inputs,
)
from mempo_trl.rollout import Episode, Rollout, RolloutEngine, TrainingRow
from mempo_trl.rollout_log import ROLLOUTS_DIR, RolloutLog
from mempo_trl.tasks import Task, make_task


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundBatch:
    """One training row per round of this process's episodes (`TrainingRow`, as the rollout emitted them) and
    ``tensors``, the padded batch (``prompt_ids``, ``prompt_mask``, ``completion_ids``, ``completion_mask`` of shape
    (rows + placeholders, tokens), ``num_items_in_batch``)."""

    mode: str
    episodes: list[Episode]
    rows: tuple[TrainingRow, ...]
    tensors: dict[str, torch.Tensor]


class MemPOTrainer(MemoryScoring, GRPOMirror, GRPOTrainer):
    """
    Trainer for MemPO (Self-Memory Policy Optimization, arXiv 2603.00680) search agents.

    It overrides six methods of [`~trl.GRPOTrainer`]: `_generate_and_score_completions` (the MemPO step below),
    `training_step` (adds the step's time split and tokens/s to the logs), `_compute_loss` (the loss types that count
    rows count real rounds: placeholder rows leave the micro-batch first), `_save` (also writes the turn protocol,
    `mempo_agent.json`), `create_model_card` (MemPO's card) and `__init__` (MemPO's own arguments, then TRL's). The
    loss itself, the sampler, PEFT, DeepSpeed/FSDP, vLLM weight sync and logging are inherited unchanged; what is
    taken, adapted or refused of each `GRPOConfig` option is docs/trl_parity.md.
    `_generate_and_score_completions` plays each question as a multi-turn episode whose context is rebuilt every round
    from the question, the last memory and the last search result, makes every round a training row, and gives its
    tokens the trajectory's GRPO advantage plus, on the `<mem>` tokens of rounds >= 2, the memory advantage (P_mem -
    P_full of the gold answer, normalised per question across processes): per-token advantages of shape (rows,
    completion tokens). Its docstring lists the steps.

    Args:
        model: model id/path or instance, as for `GRPOTrainer`.
        retriever: any object with `search(queries: list[str], topk: int) -> list[list[Passage]]`
            (`mempo_trl.retrieval.BM25Retriever`, `HttpRetriever`, ...).
        reward_funcs: outcome reward functions; defaults to `mempo_outcome_reward` (exact match, 0 on bad format).
            They receive TRL's conversational format (the final turn as ``[{"role": "assistant", "content": ...}]``
            in `completions`; a warning names the caller's functions) plus `trajectory` (all turn texts) and
            `format_valid`.
        args: a `MemPOConfig`.
        train_dataset / eval_dataset: QA rows with `question` and `golden_answers` (Search-R1/FlashRAG format); with
            an `environment_factory`, the keyword arguments of its `reset`.
        environment_factory: instead of a retriever, a TRL-style environment class (`reset(**row)`, public methods as
            tools, optional `get_reward()`; docs/environments.md), or as in TRL a dict of them by name, each row
            naming its own in an ``environment`` column: the agent calls one tool per turn, with the same context
            rebuild. As in TRL, a `get_reward` is one more reward source (weight 1, named after the class); the
            default `reward_funcs` are then none, else `mempo_outcome_reward`. The memory reward needs a gold answer
            (the row's `golden_answers` or the environment's attribute of that name); episodes without one get the
            outcome advantage only (with a warning). A search-task `instruction` is replaced by
            `ENVIRONMENT_INSTRUCTION`.
        task: instead of `retriever` or `environment_factory`, any `mempo_trl.tasks.Task` (those two are
            `SearchTask` and `EnvironmentTask`).
        **kwargs: the other arguments of `GRPOTrainer` (``processing_class``, ``callbacks``, ``optimizers``,
            ``peft_config``, ``quantization_config``, ...), passed on as they are. ``tools`` and ``rollout_func`` are
            not supported (a `ValueError` says so rather than ignoring them): tools are `retriever` (search) or the
            methods of `environment_factory`, and the rollout is MemPO's.

    The trainer works on a copy of ``args`` (``trainer.args``): the caller's config is never changed.

    Reward functions get `GRPOTrainer`'s keyword arguments, `log_metric` and `log_extra` included; what they log
    reaches the logs and the completions table as in `GRPOTrainer`.
    """

    _tag_names = ["trl", "mempo", "grpo", "search-agent"]
    _name = "MemPO"
    _paper = {
        "title": "MemPO: Self-Memory Policy Optimization for Long-Horizon Agents",
        "id": "2603.00680",
        # docstyle-ignore
        "citation": textwrap.dedent("""\
            @article{li2026mempo,
                title        = {{MemPO: Self-Memory Policy Optimization for Long-Horizon Agents}},
                author       = {Li and others},
                year         = 2026,
                eprint       = {arXiv:2603.00680},
            }"""),
    }

    # What TRL's (untyped or wider) attributes hold here, for the type checker.
    args: MemPOConfig
    model: Any
    num_generations: int
    num_generations_eval: int
    train_dataset: Any
    environments: list | None  # type: ignore[assignment]  # TRL's class attribute is a None placeholder
    model_card_info: dict[str, Any]

    def __init__(
        self,
        model: Any,
        retriever: Any = None,
        reward_funcs: Any = None,
        args: MemPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        *,
        environment_factory: Any = None,
        task: Task | None = None,
        **kwargs: Any,
    ) -> None:
        args, task = self._check_arguments(model, retriever, args, environment_factory, task, kwargs)
        check_map_style(train_dataset, eval_dataset)
        announce_reward_format(reward_funcs)
        protocol = task.protocol(args.turn_protocol())
        args.instruction = protocol.instruction
        reward_funcs, train_dataset, eval_dataset = task.prepare(reward_funcs, train_dataset, eval_dataset)
        if args.use_vllm:  # vLLM stops on the closing action tags as strings, whatever their tokenisation
            stops = {"stop": list(protocol.stops), "include_stop_str_in_output": True}
            args.generation_kwargs = {**stops, **cast(dict, args.generation_kwargs or {})}  # a dict once parsed
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, **kwargs)
        self.protocol, self.task, self.model_card_info = protocol, task, {}
        self.retriever = getattr(task, "retriever", None)  # a `SearchTask`'s
        self.memory_settings = args.memory_settings()
        self.dynamic_sampling_settings = args.dynamic_sampling_settings()
        self._check_memory_scoring()
        self._check_loss_forward()
        self._stop_turns_on(protocol.stops, protocol.stop_token_ids(self._tokenizer, self.eos_token_ids))
        self._sync_vllm_by_reload()
        limit = self._max_prompt_length()
        self.rollout_engine = RolloutEngine(self._tokenizer, protocol, None, self.eos_token_ids, limit, task=task)
        for name, rows in named_datasets(train_dataset, eval_dataset).items():  # every first context fits, up front
            if rows is not None:
                self.rollout_engine.check_first_contexts(rows, name)
        self._warned_no_target = self._warned_all_dropped = False
        self._step_account = StepAccount()
        self.rollout_log = None
        if args.rollout_log_steps:
            header = {
                "context_mode": protocol.context_mode,
                "num_generations": self.num_generations,
                "memory_coef": args.memory_coef,
            }
            assert args.output_dir is not None  # `TrainingArguments` fills it in
            # `TrainingArguments` turns report_to into a list; a str or None would be a caller's own args object
            report_to = [args.report_to] if isinstance(args.report_to, str) else list(args.report_to or [])
            directory = Path(args.output_dir) / ROLLOUTS_DIR
            self.rollout_log = RolloutLog(
                directory, args.rollout_log_steps, args.rollout_log_episodes, header, report_to
            )
            self.add_callback(self.rollout_log)

    @staticmethod
    def _check_arguments(
        model: Any, retriever: Any, args: MemPOConfig | None, environment_factory: Any, task: Task | None, kwargs: dict
    ) -> tuple[MemPOConfig, Task]:
        """Refuse what MemPO cannot train with, before any model is loaded; return this trainer's copy of ``args``
        (a default `MemPOConfig` named after the model when None: what changes in it stays with this trainer) and
        its task (`make_task`)."""
        if kwargs.get("tools"):
            raise ValueError(
                "MemPOTrainer does not take `tools=`: its rollout plays the `<search>` turn protocol against "
                "`retriever` (any object with `search(queries, topk)`), or calls the public methods of "
                "`environment_factory` (a TRL-style environment class) as tools; TRL's tool-calling loop, which "
                "`tools=` drives, never runs. Wrap your tools as an environment (docs/environments.md)."
            )
        if kwargs.get("rollout_func") is not None:
            raise ValueError("MemPOTrainer does not take `rollout_func=`: its rollout is the MemPO search episode.")
        try:
            task = make_task(retriever, environment_factory, task)
        except ValueError as err:
            raise ValueError(f"MemPOTrainer {err}") from None
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = MemPOConfig(f"{str(name).rstrip('/').split('/')[-1]}-MemPO")
        if not isinstance(args, MemPOConfig):
            raise TypeError(f"MemPOTrainer needs a MemPOConfig, got {type(args).__name__}.")
        if args.dynamic_sampling == "refill" and not task.can_refill:
            raise ValueError(
                f"dynamic_sampling='refill' plays further prompts, which {type(task).__name__} cannot (with "
                "`environment_factory` use dynamic_sampling='drop')."
            )
        return copy.copy(args), task

    # ------------------------------------------------------------------ the override, step by step

    def _generate_and_score_completions(self, inputs: list[dict]) -> dict[str, torch.Tensor]:
        """GRPOTrainer's batch preparation for multi-turn episodes with the MemPO memory advantage.

        Where `GRPOTrainer` samples one completion per prompt and gives it one advantage, this method:

        1. plays each row as a multi-turn episode, the context rebuilt every round, and gets one training row per
           round (prompt = its context, completion = the turn; with the memory reward, its scoring contexts) from
           the rollout at once (`RolloutEngine.play`);
        2. scores each episode once (`episode_outcome`, `episode_metrics`) and each whole trajectory with the reward
           functions, gathered over processes (`_outcome_rewards`); with `dynamic_sampling`, refills or drops the
           groups whose rewards are all equal (`mempo_trl.dynamic_sampling.dynamic_sampling`);
        3. pads the rows with fully masked placeholder rows to the same count on every process (`_round_batch`);
        4. scores P_full / P_mem of the gold answer for rounds >= 2 and their memory reward (`_memory_rewards`,
           `mempo_trl.memory_scoring`);
        5. gathers the rounds of all processes and calls `mempo_advantages` for per-token advantages of shape
           (rows, completion tokens) instead of one scalar per completion (`_advantages`);
        6. computes the old / sampling / reference log-probs and logs what `GRPOTrainer` logs
           (`mempo_trl.grpo_mirror`), then the episode, memory, token and timing metrics (`_log_step`).
        """
        mode = "train" if self.model.training else "eval"
        step = self._play_and_score(inputs)
        if mode == "train" and self.dynamic_sampling_settings.dynamic_sampling != "keep":
            step = self._dynamic_sampling(step)
        n, rank = len(step.rollout.episodes), self.accelerator.process_index
        dropped = [False] * n if step.dropped is None else step.dropped[rank * n : rank * n + n].tolist()
        batch = self._round_batch(list(step.rollout.episodes), step.rollout.rows, mode, dropped)
        scoring_start = time.perf_counter()
        with profiling_context(self, "memory_scoring"):
            scores = self._memory_rewards(batch.rows, dropped)
            rewards_per_func = step.rewards_per_func
            if step.dropped is not None:
                rewards_per_func = rewards_per_func.masked_fill(step.dropped.unsqueeze(1), torch.nan)
            advantages = self._advantages(batch, scores.reward, rewards_per_func, mode)
        if mode == "train":
            check_finite("advantage", advantages.advantages, self.state.global_step + 1, self.accelerator)
        scoring_seconds = time.perf_counter() - scoring_start
        output = {**batch.tensors, "advantages": advantages.advantages}
        output.update(self._loss_log_probs(batch.tensors, self._sampling_logps(batch.rows), mode))
        self._log_masked_tokens(mode, batch.rows, batch.tensors, output.get("importance_sampling_ratio"))
        self._log_step(batch, step, advantages, scores, scoring_seconds)
        return output

    # 1. the rollout

    def _play_episodes(self, inputs: list[dict]) -> Rollout:
        """One multi-turn episode per input row, all processes stepping together, with its training rows; warns once
        when episodes have no gold answer (an environment may set none): their rounds get the outcome advantage only."""
        with profiling_context(self, "rollout"), self._rollout_context():
            global_active = self._global_sum if self.accelerator.num_processes > 1 else None
            rollout = self.rollout_engine.play(inputs, self._generate_turns, global_active, self._score_memory)
        missing = {type(ep.environment or self.task).__name__ for ep in rollout.episodes if ep.golden_answers is None}
        if missing and not self._warned_no_target:
            self._warned_no_target = True
            logger.warning(
                "Some episodes of %s have no gold answer (no `golden_answers` in the row or on the environment): "
                "their rounds get no memory reward, only the outcome advantage (memory/scored_rounds counts the "
                "rounds that do).",
                " / ".join(sorted(missing)),
            )
        return rollout

    # 2. the outcome rewards and dynamic sampling

    def _play_and_score(self, inputs: list[dict]) -> ScoredStep:
        """Steps 1 and 2 on ``inputs``: the rollout, each episode's outcome and metrics, the reward functions'
        values."""
        rollout = self._play_episodes(inputs)
        outcomes = [episode_outcome(ep) for ep in rollout.episodes]
        stats = [episode_metrics(ep, outcome) for ep, outcome in zip(rollout.episodes, outcomes)]
        rewards_per_func, rewards = self._outcome_rewards(inputs, rollout.episodes, outcomes, stats)
        return ScoredStep(rollout, outcomes, stats, rewards_per_func, rewards)

    def _outcome_rewards(
        self,
        inputs: list[dict],
        episodes: Sequence[Episode],
        outcomes: list[OutcomeScore | None],
        stats: list[dict[str, float]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-function ``(N, F)`` and weighted ``(N,)`` rewards of the trajectories of ALL processes.

        The reward functions see the final turn as ``completions`` plus ``trajectory`` (all turn texts),
        ``format_valid`` and ``outcome`` (from each episode's ``stats`` and `episode_outcome`, scored once); TRL's
        `_calculate_rewards` gathers them over processes. With an environment they also get
        ``environments`` (one instance per episode, as in TRL) and the environment's ``golden_answers`` when the row
        has none. As in TRL, a trajectory that every reward function returned None for is unscorable: reward NaN,
        left out of its group's mean and std, advantage 0 (`group_outcome_advantages`).
        """
        prompts = [ep.base_messages for ep in episodes]
        completions = [[{"role": "assistant", "content": ep.rounds[-1].text}] for ep in episodes]
        self.environments = [ep.environment for ep in episodes] if self.task.passes_environments else None
        rewards_per_func = self._calculate_rewards(
            reward_inputs(inputs, episodes, outcomes, stats),
            prompts,
            completions,
            [ep.rounds[-1].completion_ids for ep in episodes],
        )
        rewards = (rewards_per_func * self.reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        return rewards_per_func, rewards

    def _dynamic_sampling(self, step: ScoredStep) -> ScoredStep:
        """`mempo_trl.dynamic_sampling.dynamic_sampling` on a training batch: refill rounds draw their rows from
        ``train_dataset`` with a generator seeded by ``seed``, the step and the round (the same draw on every
        process); logs the ``dynamic_sampling/*`` metrics and, once, a step that drops every group."""
        settings = self.dynamic_sampling_settings

        def draw(round_number: int, slots: int) -> list[dict]:
            generator = torch.Generator().manual_seed(self.args.seed * 1_000_003 + self._step * 1_009 + round_number)
            rows = torch.randint(len(self.train_dataset), (slots,), generator=generator).tolist()
            return [self.train_dataset[i] for i in rows]

        rank, logs = self.accelerator.process_index, self._pending_extra_logs
        step, metrics = dynamic_sampling(step, settings, self.num_generations, rank, draw, self._play_and_score, logs)
        for name, value in metrics.items():
            self._metrics["train"][name].append(value)
        if (
            step.dropped is not None
            and step.dropped.all()
            and not self._warned_all_dropped
            and self.accelerator.is_main_process
        ):
            self._warned_all_dropped = True
            print(
                f"mempo-trl: WARNING: step {self.state.global_step + 1}: dynamic_sampling={settings.dynamic_sampling!r} "
                f"dropped every group (the outcome rewards of each span at most dynamic_sampling_tolerance="
                f"{settings.dynamic_sampling_tolerance}): the step trains nothing. Lower the tolerance or use a reward "
                "that varies (said once; dynamic_sampling/groups_dropped counts every step)."
            )
        return step

    # 3. the padded batch

    def _round_batch(
        self, episodes: list[Episode], rows: Sequence[TrainingRow], mode: str, dropped: list[bool]
    ) -> RoundBatch:
        """The training ``rows`` of ``episodes`` as tensors (`round_tensors`), padded with placeholder rows so that
        every process has the same number of rows, a multiple of ``steps_per_generation``; the rows of the episodes
        that are ``dropped`` (one flag per episode) get a fully masked completion."""
        rows, device = tuple(rows), self.accelerator.device
        per_step = (self.args.steps_per_generation or 1) if mode == "train" else 1  # an int once the config is built
        placeholders = math.ceil(self._global_max(len(rows)) / per_step) * per_step - len(rows)
        kept = [not dropped[row.episode_index] for row in rows]
        pad_id, multiple = self._tokenizer.pad_token_id, cast(int | None, self.pad_to_multiple_of)
        tensors = round_tensors(rows, kept, placeholders, pad_id, multiple, self.mask_truncated_completions)
        tensors = {name: tensor.to(device) for name, tensor in tensors.items()}
        tensors["num_items_in_batch"] = self.accelerator.gather(tensors["completion_mask"].sum()).sum()
        return RoundBatch(mode, episodes, rows, tensors)

    # 5. the advantages

    def _advantages(
        self, batch: RoundBatch, memory_rewards: torch.Tensor, rewards_per_func: torch.Tensor, mode: str
    ) -> MemPOAdvantages:
        """`batch_advantages` for this process's rows: the memory rewards and spans of the rounds of all processes
        are gathered (`accelerator.gather`, one padded tensor) for their pools."""
        return batch_advantages(
            rewards_per_func,
            self.reward_weights.to(rewards_per_func.device),
            batch.rows,
            memory_rewards,
            batch.tensors["completion_mask"],
            self.accelerator.process_index,
            len(batch.episodes),
            self.accelerator.gather,
            num_generations=self.num_generations if mode == "train" else self.num_generations_eval,
            scale_rewards=self.scale_rewards,
            aggregation=self.multi_objective_aggregation,
            settings=self.memory_settings,
        )

    # 6. the log-probs (`GRPOMirror._loss_log_probs`) and the logs

    @staticmethod
    def _sampling_logps(rows: Sequence[TrainingRow]) -> list[list[float]] | None:
        """The sampling log-probs of the rows' completions (vLLM's), or None when any row has none."""
        logps = [row.logprobs for row in rows]
        return logps if all(lp is not None for lp in logps) else None

    def _log_step(
        self, batch: RoundBatch, step: ScoredStep, advantages: Any, scores: MemoryScores, scoring_seconds: float
    ) -> None:
        """What `GRPOTrainer` logs (`_log_grpo_metrics`: the trajectories as completions), then MemPO's metrics
        (`mempo_trl.metrics`, each averaged over all processes; ``time/*``: the slowest process), and in training the
        step's account (tokens and seconds, `training_step`) and, with ``rollout_log_steps``, the main process's
        episodes for the rollout log (`mempo_trl.rollout_log.RolloutLog`)."""
        trajectories = [
            "\n".join(
                r.text + ("\n" + ep.cut_information.get(t, r.information) if r.information else "")
                for t, r in enumerate(ep.rounds)
            )
            for ep in batch.episodes
        ]
        prompts = [ep.base_messages for ep in batch.episodes]
        self._log_grpo_metrics(
            batch.mode, batch.rows, step.rewards_per_func, step.rewards, advantages.outcome, prompts, trajectories
        )
        values = round_metric_values(
            batch.rows, step.stats, scores, advantages.memory, self.protocol.max_turns, self.task.action_metric
        )
        device, metrics, timings = self.accelerator.device, self._metrics[batch.mode], step.rollout.timings
        for name, value in mean_metrics(values, lambda t: self.accelerator.gather(t.to(device)[None]).sum(0)).items():
            metrics[name].append(value)
        metrics["tokens/prompt_peak"].append(float(self._global_max(max(len(r.prompt_ids) for r in batch.rows))))
        seconds = torch.tensor([timings.generation, timings.retrieval, scoring_seconds], device=device)
        slowest = self.accelerator.gather(seconds.unsqueeze(0)).max(dim=0).values.tolist()
        for name, value in zip(("generation", "retrieval", "memory_scoring"), slowest):
            metrics[f"time/{name}"].append(value)
        if batch.mode == "train":
            self._step_account.add(batch.rows, timings, scoring_seconds)
        if batch.mode == "train" and self.rollout_log is not None and self.accelerator.is_main_process:
            step_number = self.state.global_step + 1
            self.rollout_log.record(step_number, batch, step, advantages, scores, self.reward_func_names)

    # ------------------------------------------------------------------ TRL's loss and step

    def _compute_loss(self, model: Any, inputs: dict) -> torch.Tensor:
        """TRL's loss; for the loss types that count rows (`ROW_LEVEL_LOSSES`), the micro-batch's placeholder and
        dropped rows (not ``real_rows``) leave it first, so that the mean over rows (`grpo`, `sapo`, `luspo`) or the
        rows x `max_completion_length` divisor (`dr_grpo`) count the real rounds, each a sequence as in TRL. A
        micro-batch without a real row keeps its rows (its loss is 0)."""
        inputs = dict(inputs)  # the buffered batch serves every iteration (`num_iterations`): never changed here
        real = inputs.pop("real_rows", None)
        if real is not None and self.loss_type in ROW_LEVEL_LOSSES and real.any() and not real.all():
            rows = real.shape[0]
            inputs = {
                key: value[real]
                if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows
                else value
                for key, value in inputs.items()
            }
        return super()._compute_loss(model, inputs)

    def training_step(self, model: Any, inputs: dict, num_items_in_batch: Any = None) -> torch.Tensor:
        """GRPOTrainer's training step, then `check_finite` on its loss: a NaN or infinite loss raises
        `NonFiniteError` before the optimizer step, so the weights keep their last finite values.

        At the end of an optimizer step (where TRL logs ``step_time``), this process's ``tokens_per_second`` (the
        prompt and completion tokens of the rows it generated in the step over ``step_time``) and ``time/other``
        (``step_time`` less its generation, retrieval and memory scoring) are logged."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        check_finite("loss", loss, self.state.global_step + 1, self.accelerator)
        if self._step % self.current_gradient_accumulation_steps == 0:
            metrics = self._metrics["train"]
            for name, value in self._step_account.metrics(metrics["step_time"][-1]).items():
                metrics[name].append(value)
            self._step_account = StepAccount()
        return loss

    # ------------------------------------------------------------------ results and model card

    def final_metrics(self) -> dict[str, float]:
        """The numeric metrics of the last logged training step and of the last evaluation (`mempo_trl.metrics.final_metrics`)."""
        return final_metrics(self.state.log_history)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Save as TRL does, plus the agent's turn protocol (`mempo_agent.json`, read by `MemPOAgent`)."""
        super()._save(output_dir, state_dict=state_dict)
        if self.args.should_save:  # every process comes here; only the writer has created `output_dir`
            self.protocol.save(str(output_dir or self.args.output_dir))

    def create_model_card(  # type: ignore[override]  # TRL's signature (`_BaseTrainer.create_model_card`)
        self, model_name: str | None = None, dataset_name: str | None = None, tags: str | list[str] | None = None
    ) -> None:
        """TRL's model card, rewritten for MemPO by `mempo_trl.model_card.mempo_model_card` (base model, install and
        usage, data, retriever, held-out result, recipe, last-step metrics)."""
        model_name = model_name or Path(str(self.args.output_dir)).name  # as `push_to_hub` names it (TRL: "None")
        hub_dataset = dataset_name if dataset_name and not Path(dataset_name).exists() else None
        super().create_model_card(model_name=model_name, dataset_name=hub_dataset, tags=tags)
        if self.is_world_process_zero():
            mempo_model_card(self, dataset_name)
