"""`MemPOTrainer`: TRL's `GRPOTrainer` with a multi-turn search rollout and the MemPO memory advantage."""

import functools
import logging
import math
import textwrap
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from accelerate.utils import gather_object, is_peft_model
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing, unwrap_model_for_generation
from trl.trainer.utils import nanmax, nanmin, nanstd, pad, use_adapter

from mempo_trl.advantages import MemPOAdvantages, mempo_advantages
from mempo_trl.agent import AgentSettings
from mempo_trl.config import MemPOConfig
from mempo_trl.context import DEFAULT_INSTRUCTION
from mempo_trl.data import validate_qa_rows
from mempo_trl.environments import (
    ENVIRONMENT_INSTRUCTION,
    TOOL_STOPS,
    check_environment,
    environment_reward_func,
    has_own_reward,
)
from mempo_trl.generation import ContinuousBatchingStops, action_stopping_criteria
from mempo_trl.interruptions import check_finite
from mempo_trl.memory import (
    answer_probability,
    memory_reward,
    quantile_threshold,
)
from mempo_trl.model_card import mempo_model_card
from mempo_trl.rewards import mempo_outcome_reward
from mempo_trl.rollout import ACTION_STOPS, Episode, RolloutEngine, RolloutTimings
from mempo_trl.scoring import (
    SHARED_PREFIX_ATTENTION,
    answer_token_logps,
    memory_scoring_items,
    pack_shared_prefix,
    shared_prefix_answer_logps,
)


logger = logging.getLogger(__name__)


class MemPOTrainer(GRPOTrainer):
    """
    Trainer for MemPO (Self-Memory Policy Optimization, arXiv 2603.00680) search agents.

    What changes w.r.t. [`~trl.GRPOTrainer`] is `_generate_and_score_completions` only; the loss, the sampler,
    PEFT, DeepSpeed/FSDP, vLLM weight sync and logging are inherited unchanged:

    - each question is played as a multi-turn search episode (`mempo_trl.rollout.RolloutEngine`) whose context is
      rebuilt every round from the question, the previous turn and its search result (`context_mode="memory"`),
      generating each turn with TRL's own `_generate_single_turn` (HF generate, transformers continuous batching,
      vLLM colocate or server);
    - every round becomes its own training row (prompt = the context it was sampled from, completion = the turn),
      padded with fully masked rows to the same count on every process;
    - the outcome advantage is GRPO's group-normalised reward of the whole trajectory, copied to all its rows;
    - the memory advantage (P_mem - P_full of the gold answer, normalised per question across processes) is added on
      the `<mem>...</mem>` tokens of rounds >= 2, giving per-token advantages of shape (rows, completion tokens).

    Args:
        model: model id/path or instance, as for `GRPOTrainer`.
        retriever: any object with `search(queries: list[str], topk: int) -> list[list[Passage]]`
            (`mempo_trl.retrieval.BM25Retriever`, `HttpRetriever`, ...).
        reward_funcs: outcome reward functions; defaults to `mempo_outcome_reward` (exact match, 0 on bad format).
            They receive the final turn as `completions` plus `trajectory` (all turn texts) and `format_valid`.
        args: a `MemPOConfig`.
        train_dataset / eval_dataset: QA rows with `question` and `golden_answers` (Search-R1/FlashRAG format); with
            an `environment_factory`, the keyword arguments of its `reset`.
        environment_factory: instead of a retriever, a TRL-style environment class (`reset(**row)`, public methods as
            tools, optional `get_reward()`; docs/environments.md): the agent calls one tool per turn, with the same
            context rebuild. As in TRL, a `get_reward` is one more reward source (weight 1, named after the class); the
            default `reward_funcs` are then none, else `mempo_outcome_reward`. The memory reward needs a gold answer
            (the row's `golden_answers` or the environment's attribute of that name); episodes without one get the
            outcome advantage only (with a warning). A search-task `instruction` is replaced by
            `ENVIRONMENT_INSTRUCTION`.
        processing_class, callbacks, optimizers, peft_config, quantization_config: as for `GRPOTrainer`.
        tools: not supported (a `ValueError` says so rather than ignoring it): tools are `retriever` (search) or the
            methods of `environment_factory`.

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

    def __init__(
        self,
        model,
        retriever=None,
        reward_funcs=None,
        args: MemPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        quantization_config=None,
        environment_factory=None,
        tools=None,
    ):
        if tools:
            raise ValueError(
                "MemPOTrainer does not take `tools=`: its rollout plays the `<search>` turn protocol against "
                "`retriever` (any object with `search(queries, topk)`), or calls the public methods of "
                "`environment_factory` (a TRL-style environment class) as tools; TRL's tool-calling loop, which "
                "`tools=` drives, never runs. Wrap your tools as an environment (docs/environments.md)."
            )
        if (retriever is None) == (environment_factory is None):
            raise ValueError("MemPOTrainer needs exactly one of `retriever` (search) and `environment_factory`.")
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = MemPOConfig(f"{str(name).rstrip('/').split('/')[-1]}-MemPO")
        if not isinstance(args, MemPOConfig):
            raise TypeError(f"MemPOTrainer needs a MemPOConfig, got {type(args).__name__}.")
        if args.remove_unused_columns:
            raise ValueError(
                "MemPOTrainer reads the `question`/`golden_answers` columns: set remove_unused_columns=False."
            )
        stops = ACTION_STOPS
        if environment_factory is not None:
            reward_funcs = self._environment_setup(environment_factory, reward_funcs, args, train_dataset)
            stops = TOOL_STOPS
        else:
            if train_dataset is not None:
                train_dataset = validate_qa_rows(train_dataset, "train_dataset")
            if isinstance(eval_dataset, dict):
                eval_dataset = {n: validate_qa_rows(ds, f"eval_dataset[{n}]") for n, ds in eval_dataset.items()}
            elif eval_dataset is not None:
                eval_dataset = validate_qa_rows(eval_dataset, "eval_dataset")
        if args.use_vllm:
            # vLLM stops on the closing action tags as strings, whatever their tokenisation.
            args.generation_kwargs = {
                "stop": list(stops),
                "include_stop_str_in_output": True,
                **(args.generation_kwargs or {}),
            }
        super().__init__(
            model=model,
            reward_funcs=reward_funcs if reward_funcs is not None else [mempo_outcome_reward],
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            quantization_config=quantization_config,
        )
        attention = self.model.config._attn_implementation
        if args.memory_scoring == "shared_prefix" and attention not in SHARED_PREFIX_ATTENTION:
            raise ValueError(
                f"memory_scoring='shared_prefix' needs 4D attention masks ({SHARED_PREFIX_ATTENTION}), but the model "
                f"uses {attention!r}: set memory_scoring='batched' (or 'auto'), or attn_implementation='sdpa'."
            )
        self.shared_prefix_scoring = args.memory_scoring == "shared_prefix" or (
            args.memory_scoring == "auto" and attention in SHARED_PREFIX_ATTENTION
        )
        if args.memory_full_from_reference and self.ref_model is None and not is_peft_model(self.model):
            raise ValueError(
                "memory_full_from_reference=True needs a reference model: set beta > 0 or train a PEFT adapter."
            )
        # HF generation stops on the closing action tags: as strings, per sequence (bound to TRL's `generate` call in
        # `_generate_turns`, or patched into continuous batching's completion check), and as eos ids when a tag is one
        # token.
        continuous = self.use_transformers_continuous_batching
        self.action_stopping_criteria = (
            None if self.use_vllm or continuous else action_stopping_criteria(self._tokenizer, stops)
        )
        self.continuous_batching_stops = ContinuousBatchingStops(self._tokenizer, stops) if continuous else None
        for stop in stops:
            ids = self._tokenizer(stop, add_special_tokens=False)["input_ids"]
            if len(ids) == 1 and ids[0] not in self.eos_token_ids:
                self.eos_token_ids.append(ids[0])
        if not self.use_vllm:
            self.generation_config.eos_token_id = list(self.eos_token_ids)
            self.generation_kwargs["eos_token_id"] = list(self.eos_token_ids)
        self.retriever = retriever
        self.model_card_info: dict[str, str] = {}
        self.rollout_engine = RolloutEngine(
            self._tokenizer,
            retriever,
            max_turns=args.max_turns,
            topk=args.retrieval_topk,
            context_mode=args.context_mode,
            system_prompt=args.system_prompt,
            instruction=args.instruction,
            eos_token_ids=self.eos_token_ids,
            max_prompt_length=self._max_prompt_length(),
            context_overflow=args.context_overflow,
            environment_factory=environment_factory,
        )
        self._warned_no_target = False

    @staticmethod
    def _environment_setup(environment_factory, reward_funcs, args, train_dataset) -> list:
        """Check the environment and the first row before any model is loaded; return the reward functions.

        A `get_reward` environment adds `environment_reward_func` (TRL's rule); without it and without
        `reward_funcs`, the default is `mempo_outcome_reward`, which needs a gold answer on the first row.
        """
        environment = check_environment(environment_factory)
        name = type(environment).__name__
        if args.instruction == DEFAULT_INSTRUCTION:
            args.instruction = ENVIRONMENT_INSTRUCTION
        if reward_funcs is None:
            reward_funcs = [] if has_own_reward(environment) else [mempo_outcome_reward]
        elif not isinstance(reward_funcs, list):
            reward_funcs = [reward_funcs]
        if has_own_reward(environment):
            reward_funcs = [*reward_funcs, environment_reward_func(type(environment))]
        if train_dataset is None or len(train_dataset) == 0:
            raise ValueError(f"MemPOTrainer with {name} needs a train_dataset: one row of `reset` arguments per task.")
        row = dict(train_dataset[0])
        try:
            environment.reset(**row)
        except Exception as err:
            raise ValueError(
                f"train_dataset row 0: {name}.reset(**row) failed: {err!r}. Fix the row's fields."
            ) from err
        gold = row.get("golden_answers", getattr(environment, "golden_answers", None))
        if gold is None and mempo_outcome_reward in reward_funcs:
            raise ValueError(
                f"train_dataset row 0 has no `golden_answers` and {name} sets none, but `mempo_outcome_reward` "
                "scores the answer against them: add the column, set `self.golden_answers` in `reset`, or define "
                "`get_reward()` / pass your own `reward_funcs`."
            )
        return reward_funcs

    # ------------------------------------------------------------------ generation helpers

    def _max_prompt_length(self) -> int | None:
        """Longest context the generation backend takes: `vllm_max_model_length` (vLLM, when set) or the model's
        `max_position_embeddings`, minus `max_completion_length`; None when neither is known."""
        limit = self.args.vllm_max_model_length if self.use_vllm else None
        limit = limit or getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        if limit is None:
            return None
        if limit <= self.max_completion_length:
            raise ValueError(
                f"max_completion_length={self.max_completion_length} leaves no room for a prompt in the model's "
                f"{limit}-token context (vllm_max_model_length / max_position_embeddings)."
            )
        return limit - self.max_completion_length

    def _generate_turns(self, prompt_ids: list[list[int]]):
        """One turn per prompt with TRL's backend (HF generate, transformers continuous batching, vLLM colocate or
        server), stopping after the turn's action tag.

        TRL's vLLM server mode, and colocate mode with tensor parallelism, gather the prompts of all processes (of a
        TP group) and hand each process the completions at ``process_index * len(prompts)``: right only when every
        process sends the same number of prompts. Episodes end at different rounds, so the prompt list is padded to
        the largest count over processes with copies of its shortest prompt, whose completions are dropped.
        """
        n = len(prompt_ids)
        if self.use_vllm and (self.vllm_mode == "server" or self.vllm_tensor_parallel_size > 1):
            placeholder = min(prompt_ids, key=len)
            prompt_ids = prompt_ids + [placeholder] * (self._global_max(n) - n)
        if self.continuous_batching_stops is not None:
            with self.continuous_batching_stops.active():
                completions, logprobs = self._generate_single_turn(prompt_ids, None, {}, num_generations=1)
        elif self.action_stopping_criteria is None:
            completions, logprobs = self._generate_single_turn(prompt_ids, None, {}, num_generations=1)
        else:
            # TRL's HF path passes no stopping criteria to `generate`: bind ours for this call.
            model = self.accelerator.unwrap_model(self.model_wrapped)
            model.generate = functools.partial(model.generate, stopping_criteria=self.action_stopping_criteria)
            try:
                completions, logprobs = self._generate_single_turn(prompt_ids, None, {}, num_generations=1)
            finally:
                del model.generate
        return completions[:n], None if logprobs is None else logprobs[:n]

    @contextmanager
    def _rollout_context(self):
        """Hold the generation backend ready for all the rounds of a rollout, instead of once per round.

        - HF generation under DeepSpeed ZeRO-3 (``ds3_gather_for_generation``): TRL gathers all parameters around
          every `generate`, i.e. every round here; they are gathered once for the whole rollout (TRL's
          `unwrap_model_for_generation`), and the rounds' own `generate` calls skip their gather.
        - vLLM colocate with `vllm_enable_sleep_mode`: TRL puts vLLM to sleep (level 2, weights dropped) after every
          `generate` and re-syncs all weights before the next; here it is woken and synced once, kept awake through
          the rounds and put back to sleep after the last one.
        """
        args, generation = self.args, getattr(self, "vllm_generation", None)
        if not self.use_vllm and self.is_deepspeed_enabled and args.ds3_gather_for_generation:
            with unwrap_model_for_generation(
                self.model_wrapped, self.accelerator, gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs
            ):
                args.ds3_gather_for_generation = False  # gathered already: the rounds must not gather again
                try:
                    yield
                finally:
                    args.ds3_gather_for_generation = True
        elif self.use_vllm and self.vllm_mode == "colocate" and generation.enable_sleep_mode:
            if self.state.global_step != self._last_loaded_step or generation._llm_weights_sleeping:
                generation.sync_weights()  # wakes the weights up first
                self._last_loaded_step = self.state.global_step
            generation.llm.wake_up(tags=["kv_cache"])
            generation.enable_sleep_mode = False
            try:
                yield
            finally:
                generation.enable_sleep_mode = True
                generation.llm.sleep(level=2)
                generation._llm_weights_sleeping = True
        else:
            yield

    def _global_sum(self, value: int) -> int:
        if self.accelerator.num_processes == 1:
            return value
        return int(self.accelerator.gather(torch.tensor([value], device=self.accelerator.device)).sum().item())

    def _global_max(self, value: int) -> int:
        if self.accelerator.num_processes == 1:
            return value
        return int(self.accelerator.gather(torch.tensor([value], device=self.accelerator.device)).max().item())

    # ------------------------------------------------------------------ memory reward

    def _score_items(self, items, use_reference: bool, group_keys=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Answer-token log-probs of scoring items, with the same number of forwards on every process.

        With ``group_keys`` (one per item), items of the same key that share a context prefix are scored with one
        forward of that prefix (`shared_prefix_answer_logps`).
        """
        bs = self.args.memory_scoring_batch_size
        num_rows = len(items) if group_keys is None else len(pack_shared_prefix(items, group_keys))
        num_chunks = self._global_max(math.ceil(num_rows / bs))
        unwrapped = self.accelerator.unwrap_model(self.model)
        if use_reference and self.ref_model is not None:
            model, adapter_ctx = self.ref_model, nullcontext()
        elif use_reference:
            model = self.model
            adapter_ctx = use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None)
        else:
            model, adapter_ctx = self.model, nullcontext()
        pad_id = self._tokenizer.pad_token_id
        with adapter_ctx, self.accelerator.autocast():
            if group_keys is None:
                return answer_token_logps(model, items, pad_id, bs, num_chunks)
            return shared_prefix_answer_logps(model, items, group_keys, pad_id, bs, num_chunks)

    def _memory_rewards(self, episodes: list[Episode]) -> dict[tuple[int, int], dict[str, float]]:
        """Step 4: P_full, P_mem and the memory reward of every scored round, keyed by (episode, round index)."""
        keys, pairs = [], []
        for e, episode in enumerate(episodes):
            for pair in memory_scoring_items(episode, self._tokenizer):
                keys.append((e, pair.round_index))
                pairs.append(pair)
        args = self.args
        with torch.no_grad(), disable_gradient_checkpointing(self.model, args.gradient_checkpointing_kwargs):
            # Shared-prefix scoring packs the contexts of one trajectory together: its full contexts are prefixes of
            # each other, and its mem contexts start with the same system and user messages.
            group_keys = [e for e, _ in keys] if self.shared_prefix_scoring else None
            if args.memory_full_from_reference:
                full_logps, full_mask = self._score_items([p.full for p in pairs], True, group_keys)
                mem_logps, mem_mask = self._score_items([p.mem for p in pairs], False, group_keys)
            else:
                both_keys = group_keys + group_keys if group_keys is not None else None
                logps, mask = self._score_items([p.full for p in pairs] + [p.mem for p in pairs], False, both_keys)
                full_logps, mem_logps = logps[: len(pairs)], logps[len(pairs) :]
                full_mask, mem_mask = mask[: len(pairs)], mask[len(pairs) :]
        threshold = args.memory_threshold
        if args.memory_threshold_quantile is not None:  # one threshold for the answer tokens of all processes
            local = torch.cat([full_logps[full_mask.bool()], mem_logps[mem_mask.bool()]]).tolist()
            values = torch.tensor(gather_object(local) if self.accelerator.num_processes > 1 else local)
            threshold = quantile_threshold(
                values, torch.ones_like(values, dtype=torch.bool), args.memory_threshold_quantile
            )
        if not pairs:
            return {}
        p_full = answer_probability(full_logps, full_mask, threshold)
        p_mem = answer_probability(mem_logps, mem_mask, threshold)
        mem_lengths = torch.tensor(
            [float(episodes[e].rounds[t].mem_span[1] - episodes[e].rounds[t].mem_span[0] + 1) for e, t in keys]
        )
        rewards = memory_reward(
            p_mem.cpu(),
            p_full.cpu(),
            mode=args.memory_reward_type,
            eps=args.memory_reward_eps,
            mem_lengths=mem_lengths,
            length_penalty=args.memory_length_penalty,
            max_mem_tokens=args.max_completion_length,
        )
        return {
            key: {"p_full": float(pf), "p_mem": float(pm), "reward": float(r)}
            for key, pf, pm, r in zip(keys, p_full.tolist(), p_mem.tolist(), rewards.tolist())
        }

    # ------------------------------------------------------------------ the override

    def _generate_and_score_completions(self, inputs: list[dict]) -> dict[str, torch.Tensor]:
        """GRPOTrainer's batch preparation for multi-turn search episodes with the MemPO memory advantage.

        Where `GRPOTrainer` samples one completion per prompt and gives it one advantage, this method:

        1. `_play_episodes`: plays each question as a multi-turn search episode (context rebuilt every round);
        2. `_outcome_rewards`: scores each whole trajectory with the reward functions (gathered over processes);
        3. `_round_rows`: makes one training row per round (prompt = its context, completion = the turn), padded
           with fully masked placeholder rows to the same count on every process;
        4. `_memory_rewards`: scores P_full / P_mem of the gold answer for rounds >= 2 and their memory reward;
        5. `_advantages`: gathers the rounds of all processes and calls `mempo_advantages` for per-token advantages
           of shape (rows, completion tokens) instead of one scalar per completion;
        6. `_loss_log_probs`: the old / sampling / reference log-probs and vLLM IS ratio, as in `GRPOTrainer`;
        7. `_log_episode_metrics` / `_log_completion_rows`: episode, memory, token and timing metrics.
        """
        mode = "train" if self.model.training else "eval"
        episodes, timings = self._play_episodes(inputs)
        self._warn_no_memory_target(episodes)
        rewards_per_func, rewards = self._outcome_rewards(inputs, episodes)
        rows, output = self._round_rows(episodes, mode)
        scoring_start = time.perf_counter()
        score_memory = self.args.context_mode == "memory" and self.args.memory_coef != 0.0
        scored = self._memory_rewards(episodes) if score_memory else {}
        adv = self._advantages(episodes, rows, scored, rewards, output["completion_mask"], mode)
        if mode == "train":
            check_finite("advantage", adv.advantages, self.state.global_step + 1, self.accelerator)
        timings_scoring = time.perf_counter() - scoring_start
        output["advantages"] = adv.advantages
        records = [episodes[e].rounds[t] for e, t in rows]
        output.update(self._loss_log_probs(output, records, mode))
        self._log_episode_metrics(
            mode,
            episodes,
            rows,
            records,
            scored,
            adv.memory,
            output["completion_mask"],
            rewards_per_func,
            rewards,
            timings.generation,
            timings.retrieval,
            timings_scoring,
        )
        prompts = [ep.base_messages for ep in episodes]
        self._log_completion_rows(mode, prompts, episodes, rewards_per_func, adv.outcome)
        return output

    def training_step(self, model, inputs, num_items_in_batch=None):
        """GRPOTrainer's training step, then `check_finite` on its loss: a NaN or infinite loss raises
        `NonFiniteError` before the optimizer step, so the weights keep their last finite values."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        check_finite("loss", loss, self.state.global_step + 1, self.accelerator)
        return loss

    def _play_episodes(self, inputs: list[dict]) -> tuple[list[Episode], RolloutTimings]:
        """Step 1: one multi-turn episode per input row, all processes stepping together."""
        global_active = self._global_sum if self.accelerator.num_processes > 1 else None
        with self._rollout_context():
            return self.rollout_engine.run(inputs, self._generate_turns, global_active)

    def _warn_no_memory_target(self, episodes: list[Episode]) -> None:
        """Warn once when environment episodes have no gold answer: their rounds get the outcome advantage only."""
        if self._warned_no_target or self.rollout_engine.environment_factory is None:
            return
        if any(ep.golden_answers is None for ep in episodes):
            self._warned_no_target = True
            logger.warning(
                "Some episodes of %s have no gold answer (no `golden_answers` in the row or on the environment): "
                "their rounds get no memory reward, only the outcome advantage (memory/scored_rounds counts the "
                "rounds that do).",
                type(episodes[0].environment).__name__,
            )

    def _outcome_rewards(self, inputs: list[dict], episodes: list[Episode]) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 2: per-function ``(N, F)`` and weighted ``(N,)`` rewards of the trajectories of ALL processes.

        The reward functions see the final turn as ``completions`` plus ``trajectory`` (all turn texts) and
        ``format_valid``; TRL's `_calculate_rewards` gathers them over processes. With an environment they also get
        ``environments`` (one instance per episode, as in TRL) and the environment's ``golden_answers`` when the row
        has none.
        """
        prompts = [ep.base_messages for ep in episodes]
        completions = [[{"role": "assistant", "content": ep.rounds[-1].text}] for ep in episodes]
        reward_inputs = [
            {**row, "trajectory": [r.text for r in ep.rounds], "format_valid": ep.format_valid}
            for row, ep in zip(inputs, episodes)
        ]
        if self.rollout_engine.environment_factory is not None:
            self.environments = [ep.environment for ep in episodes]
            for reward_input, ep in zip(reward_inputs, episodes):
                if "golden_answers" not in reward_input and ep.golden_answers is not None:
                    reward_input["golden_answers"] = ep.golden_answers
        rewards_per_func = self._calculate_rewards(
            reward_inputs, prompts, completions, [ep.rounds[-1].completion_ids for ep in episodes]
        )
        rewards = (rewards_per_func * self.reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
        # As TRL: a trajectory every reward function returned None for is unscorable, not reward 0 (NaN: left out of
        # its group's mean and std, advantage 0, `group_outcome_advantages`).
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        return rewards_per_func, rewards

    def _round_rows(self, episodes: list[Episode], mode: str) -> tuple[list[tuple[int, int]], dict[str, torch.Tensor]]:
        """Step 3: the ``(episode, round)`` of every row and the padded prompt/completion tensors of the batch.

        Rows are padded with placeholder rows (one pad token, completion fully masked) so that every process has
        the same number of rows, a multiple of ``steps_per_generation``.
        """
        device = self.accelerator.device
        rows = [(e, t) for e, ep in enumerate(episodes) for t in range(len(ep.rounds))]
        per_step = self.args.steps_per_generation if mode == "train" else 1
        num_rows = math.ceil(self._global_max(len(rows)) / per_step) * per_step
        num_dummy = num_rows - len(rows)
        records = [episodes[e].rounds[t] for e, t in rows]
        pad_id = self._tokenizer.pad_token_id
        prompt_list = [torch.tensor(r.prompt_ids) for r in records] + [torch.tensor([pad_id])] * num_dummy
        completion_list = [torch.tensor(r.completion_ids) for r in records] + [torch.tensor([pad_id])] * num_dummy
        prompt_ids = pad(prompt_list, padding_value=pad_id, padding_side="left").to(device)
        prompt_mask = pad([torch.ones_like(p) for p in prompt_list], padding_value=0, padding_side="left").to(device)
        completion_ids = pad(completion_list, padding_value=pad_id, padding_side="right").to(device)
        real = [torch.ones_like(c) for c in completion_list[: len(rows)]]
        completion_mask = pad(
            real + [torch.zeros_like(c) for c in completion_list[len(rows) :]], padding_value=0, padding_side="right"
        ).to(device)
        if self.mask_truncated_completions:
            truncated = torch.tensor([r.truncated for r in records] + [False] * num_dummy, device=device)
            completion_mask = completion_mask * (~truncated).unsqueeze(1).int()
        batch = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "num_items_in_batch": self.accelerator.gather(completion_mask.sum()).sum(),
        }
        return rows, batch

    def _advantages(self, episodes, rows, scored, rewards, completion_mask, mode) -> MemPOAdvantages:
        """Step 5: `mempo_advantages` on the rounds of all processes, returned for this process's rows.

        A trajectory's global index is ``process_index * len(episodes) + episode`` (the order in which
        `_calculate_rewards` gathers ``rewards``), so memory pools span processes exactly like GRPO's groups.
        """
        rank, n_local = self.accelerator.process_index, len(episodes)
        local = [
            (rank * n_local + e, t, scored.get((e, t), {}).get("reward"), episodes[e].rounds[t].mem_span)
            for e, t in rows
        ]
        per_process = gather_object([local]) if self.accelerator.num_processes > 1 else [local]
        start = sum(len(p) for p in per_process[:rank])
        everything = [row for p in per_process for row in p]
        args = self.args
        return mempo_advantages(
            rewards,
            row_trajectories=[row[0] for row in everything],
            row_rounds=[row[1] for row in everything],
            memory_rewards=[row[2] for row in everything],
            mem_spans=[row[3] for row in everything],
            completion_mask=completion_mask,
            local_rows=slice(start, start + len(local)),
            num_generations=self.num_generations if mode == "train" else self.num_generations_eval,
            scale_rewards=self.scale_rewards,
            memory_coef=args.memory_coef,
            memory_pooling=args.memory_pooling,
            memory_gate_on_outcome=args.memory_gate_on_outcome,
        )

    def _loss_log_probs(self, batch: dict[str, torch.Tensor], records, mode: str) -> dict[str, torch.Tensor]:
        """Step 6: what the inherited loss needs besides advantages: old / sampling / reference log-probs and the
        vLLM importance-sampling ratio, computed as in `GRPOTrainer`."""
        args = self.args
        device = self.accelerator.device
        completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"]
        num_dummy = completion_ids.size(0) - len(records)
        prompt_completion_ids = torch.cat([batch["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        # As many rows per forward as a loss micro-batch holds (not per_device_train_batch_size trajectories), so
        # that a ZeRO-3 step gathers the parameters `steps_per_generation` times, not once per trajectory pair.
        per_step = args.steps_per_generation if mode == "train" else 1
        batch_size = completion_ids.size(0) // per_step
        output = {}
        with torch.no_grad(), disable_gradient_checkpointing(self.model, args.gradient_checkpointing_kwargs):
            generate_every = args.steps_per_generation * self.num_iterations
            use_is = self.use_vllm and self.vllm_importance_sampling_correction
            if args.gradient_accumulation_steps % generate_every != 0 or use_is:
                old_logps, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, prompt_completion_ids, attention_mask, logits_to_keep, batch_size=batch_size
                )
                output["old_per_token_logps"] = old_logps
            if self.use_vllm and all(r.logprobs is not None for r in records):
                # vLLM reports a NaN log-prob as None (TRL's `extract_logprobs`): back to NaN, as TRL does; the IS
                # ratio then leaves those tokens uncorrected and the IS metrics skip them.
                sampling = pad(
                    [torch.tensor([math.nan if x is None else x for x in r.logprobs]) for r in records]
                    + [torch.zeros(1)] * num_dummy,
                    padding_value=0.0,
                    padding_side="right",
                ).to(device)
                output["sampling_per_token_logps"] = sampling
                if use_is:
                    output["importance_sampling_ratio"] = self._importance_sampling_ratio(
                        output["old_per_token_logps"], sampling, completion_mask
                    )
                    self._log_importance_sampling(
                        mode, output["old_per_token_logps"], sampling, output["importance_sampling_ratio"],
                        completion_mask,
                    )  # fmt: skip
            if self.beta != 0.0:
                if self.ref_model is not None:
                    ref_logps, _, _ = self._get_per_token_logps_and_entropies(
                        self.ref_model, prompt_completion_ids, attention_mask, logits_to_keep, batch_size=batch_size
                    )
                else:
                    unwrapped = self.accelerator.unwrap_model(self.model)
                    with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                        ref_logps, _, _ = self._get_per_token_logps_and_entropies(
                            self.model, prompt_completion_ids, attention_mask, logits_to_keep, batch_size=batch_size
                        )
                output["ref_per_token_logps"] = ref_logps
        return output

    def _importance_sampling_ratio(self, old_logps, sampling_logps, mask):
        """vLLM importance-sampling ratio with TRL's truncate/mask modes, per token or per sequence."""
        diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
        if self.vllm_importance_sampling_mode in ("sequence_mask", "sequence_truncate"):
            diff = diff.sum(dim=-1, keepdim=True)
        ratio = torch.exp(diff)
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if self.vllm_importance_sampling_mode.endswith("truncate"):
            return torch.clamp(ratio, min=low, max=high)
        low = -math.inf if low is None else low
        high = math.inf if high is None else high
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)

    # ------------------------------------------------------------------ logging

    def _log_importance_sampling(self, mode, old_logps, sampling_logps, ratio, mask):
        """TRL's vLLM diagnostics: ``sampling/sampling_logp_difference/{mean,max}`` and
        ``sampling/importance_sampling_ratio/{min,mean,max}`` over real completion tokens, NaN log-probs skipped."""
        device = self.accelerator.device
        mask = mask.bool()
        delta = (old_logps - sampling_logps).abs()
        delta = delta[mask & ~torch.isnan(delta)]
        zero = torch.tensor(0.0, device=device)
        mean_delta, max_delta = (delta.mean(), delta.max()) if delta.numel() else (zero, zero)
        self._metrics[mode]["sampling/sampling_logp_difference/mean"].append(
            self.accelerator.gather(mean_delta).mean().item()
        )
        self._metrics[mode]["sampling/sampling_logp_difference/max"].append(
            self.accelerator.gather(max_delta).max().item()
        )
        flat = ratio.flatten() if self.vllm_importance_sampling_mode.startswith("sequence") else ratio[mask]
        stats = (flat.min(), flat.mean(), flat.max()) if flat.numel() else (zero, zero, zero)
        low, mean, high = (self.accelerator.gather(x) for x in stats)
        self._metrics[mode]["sampling/importance_sampling_ratio/min"].append(nanmin(low).item())
        self._metrics[mode]["sampling/importance_sampling_ratio/mean"].append(mean.nanmean().item())
        self._metrics[mode]["sampling/importance_sampling_ratio/max"].append(nanmax(high).item())

    def _metric_names(self) -> list[str]:
        names = [
            "episode/em", "episode/f1", "episode/sub_em", "episode/format_valid", "episode/answer_rate",
            "episode/turns", "episode/searches", "episode/tool_calls", "episode/truncated_turns",
            "episode/context_overflow",
            "tokens/prompt_per_round", "tokens/mem_length",
            "memory/p_full", "memory/p_mem", "memory/reward", "memory/advantage", "memory/scored_rounds",
        ]  # fmt: skip
        for t in range(2, self.args.max_turns + 1):
            names += [f"memory/reward/round_{t}", f"memory/advantage/round_{t}"]
        return names

    def _log_episode_metrics(
        self, mode, episodes, rows, records, scored, memory_adv, completion_mask, rewards_per_func, rewards,
        t_generation, t_retrieval, t_scoring,
    ):  # fmt: skip
        """Log episode, token, memory and timing metrics, each averaged over all processes."""
        device = self.accelerator.device
        values: dict[str, list[float]] = defaultdict(list)
        for ep in episodes:
            for name, value in ep.metrics().items():
                values[f"episode/{name}"].append(value)
        for i, ((e, t), record) in enumerate(zip(rows, records)):
            values["episode/truncated_turns"].append(float(record.truncated))
            values["tokens/prompt_per_round"].append(float(len(record.prompt_ids)))
            if record.mem_span is not None:
                values["tokens/mem_length"].append(float(record.mem_span[1] - record.mem_span[0] + 1))
            if (e, t) in scored:
                s = scored[(e, t)]
                adv = float(memory_adv[i, record.mem_span[0]].item())
                values["memory/p_full"].append(s["p_full"])
                values["memory/p_mem"].append(s["p_mem"])
                values["memory/reward"].append(s["reward"])
                values["memory/advantage"].append(adv)
                values[f"memory/reward/round_{t + 1}"].append(s["reward"])
                values[f"memory/advantage/round_{t + 1}"].append(adv)
        values["memory/scored_rounds"].append(float(len(scored)))
        names = self._metric_names()
        local = torch.tensor(
            [[sum(values[n]), len(values[n]), sum(v * v for v in values[n])] for n in names], device=device
        )
        totals = self.accelerator.gather(local.unsqueeze(0)).sum(dim=0)
        for name, (total, count, total_sq) in zip(names, totals.tolist()):
            if count:
                mean = total / count
                self._metrics[mode][name].append(mean)
                if name.startswith(("memory/reward", "memory/advantage")):
                    self._metrics[mode][f"{name}_std"].append(math.sqrt(max(total_sq / count - mean * mean, 0.0)))
        peak = self._global_max(max((len(r.prompt_ids) for r in records), default=0))
        self._metrics[mode]["tokens/prompt_peak"].append(float(peak))
        seconds = torch.tensor([t_generation, t_retrieval, t_scoring], device=device)
        slowest = self.accelerator.gather(seconds.unsqueeze(0)).max(dim=0).values.tolist()
        for name, value in zip(("generation", "retrieval", "memory_scoring"), slowest):
            self._metrics[mode][f"time/{name}"].append(value)
        completion_tokens = self.accelerator.gather(completion_mask.sum()).sum().item()
        prompt_tokens = self._global_sum(sum(len(r.prompt_ids) for r in records))
        if mode == "train":
            self.state.num_input_tokens_seen += prompt_tokens + completion_tokens
        self._metrics[mode]["num_tokens"] = [self.state.num_input_tokens_seen]
        for i, name in enumerate(self.reward_func_names):
            self._metrics[mode][f"rewards/{name}/mean"].append(torch.nanmean(rewards_per_func[:, i]).item())
            self._metrics[mode][f"rewards/{name}/std"].append(nanstd(rewards_per_func[:, i]).item())
        self._metrics[mode]["reward"].append(torch.nanmean(rewards).item())
        self._metrics[mode]["reward_std"].append(nanstd(rewards).item())

    def _log_completion_rows(self, mode, prompts, episodes, rewards_per_func, all_outcome_adv):
        """Completion table rows (one per trajectory): the question, the joined turns and their results, and the
        columns and metrics reward functions logged."""
        trajectories = [
            "\n".join(r.text + ("\n" + r.information if r.information else "") for r in ep.rounds) for ep in episodes
        ]
        self._logs["prompt"].extend(gather_object(prompts))
        self._logs["completion"].extend(gather_object(trajectories))
        for i, name in enumerate(self.reward_func_names):
            self._logs["rewards"][name].extend(rewards_per_func[:, i].tolist())
        self._logs["advantages"].extend(all_outcome_adv.tolist())
        self._flush_reward_function_logs(mode, len(prompts))

    def _flush_reward_function_logs(self, mode: str, num_local: int) -> None:
        """Flush what reward functions logged through ``log_extra`` (completions-table columns, one value per
        trajectory) and ``log_metric`` (scalars averaged over processes): mirrors the flush at the end of
        `GRPOTrainer._generate_and_score_completions` (TRL 1.16), which this trainer replaces. Names are sorted so
        that all processes gather in the same order."""
        device = self.accelerator.device
        for column in sorted(set(gather_object(list(self._pending_extra_logs)))):
            values = self._pending_extra_logs.get(column, [None] * num_local)
            self._logs["extra"][column].extend(gather_object(values))
        self._pending_extra_logs.clear()
        for name in sorted(set(gather_object(list(self._pending_metrics)))):
            values = self._pending_metrics.get(name, [])
            local_stats = torch.tensor([sum(values), len(values)], dtype=torch.float32, device=device)
            total, count = self.accelerator.gather(local_stats).view(-1, 2).sum(dim=0).tolist()
            self._metrics[mode][name].append(total / count)
        self._pending_metrics.clear()

    # ------------------------------------------------------------------ results and model card

    def final_metrics(self) -> dict[str, float]:
        """The numeric metrics of the last logged training step, plus those of the last evaluation (`eval_*`).

        Each comes whole from one log entry: a metric missing at that step (no memory round was scored, say) is
        missing here, never filled in from an earlier step. `step` is the step they were logged at.
        """
        history = self.state.log_history
        evals = [e for e in history if any(k.startswith("eval_") for k in e)]
        steps = [e for e in history if "train_runtime" not in e and not any(k.startswith("eval_") for k in e)]
        last = {
            **(steps[-1] if steps else {}),
            **{k: v for k, v in (evals[-1:] or [{}])[0].items() if k.startswith("eval_")},
        }
        return {k: v for k, v in last.items() if isinstance(v, int | float) and not isinstance(v, bool)}

    def _save(self, output_dir: str | None = None, state_dict=None):
        """Save as TRL does, plus the agent's turn protocol (`mempo_agent.json`, read by `MemPOAgent`)."""
        super()._save(output_dir, state_dict=state_dict)
        if self.args.should_save:  # every process comes here; only the writer has created `output_dir`
            AgentSettings.from_config(self.args).save(output_dir or self.args.output_dir)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's model card, rewritten for MemPO by `mempo_trl.model_card.mempo_model_card` (base model, install and
        usage, data, retriever, held-out result, recipe, last-step metrics)."""
        model_name = model_name or Path(self.args.output_dir).name  # as `push_to_hub` names it (TRL: "None")
        hub_dataset = dataset_name if dataset_name and not Path(dataset_name).exists() else None
        super().create_model_card(model_name=model_name, dataset_name=hub_dataset, tags=tags)
        if self.is_world_process_zero():
            mempo_model_card(self, dataset_name)
