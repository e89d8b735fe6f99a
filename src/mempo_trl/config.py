"""`MemPOConfig`: `GRPOConfig` plus the fields of the MemPO search loop and memory advantage."""

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from transformers.utils import is_torch_bf16_gpu_available
from trl import GRPOConfig, SFTConfig

from mempo_trl.protocol import TurnProtocol
from mempo_trl.settings import (
    DynamicSamplingSettings,
    LossForwardSettings,
    MemoryRewardSettings,
    RolloutLogSettings,
    field_type_problems,
    flat_field,
)


ROW_LEVEL_LOSSES = ("grpo", "dr_grpo", "sapo", "luspo")
"""TRL's loss types whose normaliser counts rows: `MemPOTrainer` leaves its placeholder rows out of it."""


def truncated_sampling(config: Any) -> list[str]:
    """The sampling settings of ``config`` that truncate the distribution (``top_p < 1``, ``top_k > 0``,
    ``min_p > 0``), as ``name=value``.

    Example:
        >>> from types import SimpleNamespace
        >>> truncated_sampling(SimpleNamespace(top_p=0.9, top_k=0, min_p=None))
        ['top_p=0.9']
    """
    found = []
    if config.top_p is not None and config.top_p < 1.0:
        found.append(f"top_p={config.top_p}")
    if config.top_k is not None and config.top_k > 0:
        found.append(f"top_k={config.top_k}")
    if config.min_p is not None and config.min_p > 0:
        found.append(f"min_p={config.min_p}")
    return found


def first_to_announce() -> bool:
    """Whether this process says a run's start-up notices, once for the run: not a process of rank > 0 (``RANK``), nor
    one that a `mempo-trl train` launcher started (it said them, and holds the output directory: ``HELD_ENV``)."""
    from mempo_trl.outputs import HELD_ENV

    return int(os.environ.get("RANK", "0") or 0) == 0 and HELD_ENV not in os.environ


@dataclass
class MemPOConfig(GRPOConfig):
    r"""
    Configuration class for [`MemPOTrainer`]. Only the fields below are added to [`~trl.GRPOConfig`]; every
    GRPO field keeps its meaning, except that `max_completion_length` is the budget of **one turn** and the
    micro-batches hold one row per turn.

    Parameters:
        > Parameters that control the search episode

        max_turns (`int`, *optional*, defaults to `8`):
            Rounds per episode at most. An episode also ends on `<answer>` or on an invalid turn (outcome 0).
        retrieval_topk (`int`, *optional*, defaults to `3`):
            Passages returned for each `<search>`.
        context_mode (`str`, *optional*, defaults to `"memory"`):
            `"memory"` (MemPO: round t sees the question, round t-1's output and its search result) or
            `"full_history"` (Search-R1 baseline: the context grows every round; no memory advantage is computed).
        system_prompt (`str`, *optional*, defaults to `"You are a helpful assistant."`):
            System message of every context.
        instruction (`str`, *optional*):
            User message template with a `{question}` placeholder; it shows the tags.
        context_overflow (`str`, *optional*, defaults to `"end_episode"`):
            What happens when a round's context does not fit the generation backend: longer than
            `vllm_max_model_length` (with vLLM, when set) or the model's `max_position_embeddings`, minus
            `max_completion_length` (vLLM rejects such prompts). `"end_episode"`: the episode ends before that round
            (no answer, so outcome 0), counted in the `episode/context_overflow` metric. `"truncate_information"`:
            the tail of the results in the context (`<information>` blocks, tool results) is cut first (oldest
            first in `full_history` mode; the task renders what is left, `Task.render_result`),
            and the episode ends only if that is not enough. A first-round context that does not fit is an error.
            The same applies to `max_context_tokens` when it is the smaller limit.
        max_context_tokens (`int` or `None`, *optional*, defaults to `None`):
            A context budget: the longest context (prompt tokens) a round may have, whatever the backend takes; the
            smaller of the two binds, and a round whose context would be longer is handled by `context_overflow`.
            Being a rule of the turn protocol, it is saved with the model (`mempo_agent.json`) and evaluation plays by
            it. It binds `full_history` contexts, which grow every round, long before `memory` ones. `None`: no
            budget.

        > Parameters that control the memory advantage

        memory_coef (`float`, *optional*, defaults to `1.0`):
            Weight of the memory advantage added on the `<mem>` tokens, >= 0. `0` turns memory scoring off (the run
            says so in one line at its start).
        memory_threshold (`float` or `None`, *optional*, defaults to `log(0.5)`):
            Answer tokens with `log p` at or below it are left out of P_mem / P_full: a log-probability, < 0 (`-0.69`
            is log 0.5). `None` keeps all tokens.
        memory_threshold_quantile (`float` or `None`, *optional*, defaults to `None`):
            Variant (docs/algorithm.md, "Variants"): the threshold is this quantile of the batch's answer-token log-probs instead.
        memory_reward_type (`str`, *optional*, defaults to `"diff"`):
            `"diff"`: P_mem - P_full (paper). `"log_ratio"`: log(P_mem + eps) - log(P_full + eps).
        memory_reward_eps (`float`, *optional*, defaults to `1e-6`):
            The eps of `"log_ratio"`, > 0.
        memory_reward_parts (`str`, *optional*, defaults to `"joint"`):
            `"joint"`: P_mem and P_full over all gold tokens (paper). `"weakest"`: for a gold of several parts
            (`sub_answers`), the memory reward of each part on its own tokens, and the lowest of them: a memory that
            lost one needed fact is scored by that fact. `"losses"`: where any part's reward is below 0, the mean of
            `min(part reward, 0)` over the parts (a lost part is never paid for, two lost parts cost more than
            one), else the joint reward.
        memory_length_penalty (`float`, *optional*, defaults to `0.0`):
            Variant: subtract `lambda * len(<mem> tokens) / max_completion_length` from the memory reward.
        memory_pooling (`str`, *optional*, defaults to `"question"`):
            `"question"`: normalise over all rounds of all trajectories of a question (paper). `"question_round"`:
            normalise per (question, round index).
        memory_scale_rewards (`str`, *optional*, defaults to `"group"`):
            What the memory rewards are divided by after their pool's mean is taken off: `"group"`: the pool's std
            (paper). `"batch"`: the std of all memory rewards of the batch. `"none"`: nothing. TRL's `scale_rewards`
            values, for the memory advantage.
        memory_center_rewards (`bool`, *optional*, defaults to `True`):
            Take each pool's mean off the memory rewards before dividing by `memory_scale_rewards`' std (paper).
            `False`: no mean taken off, so a memory that predicts the gold worse than the full history (a negative
            reward) gets a negative advantage whatever its group; pair it with `memory_scale_rewards="batch"` or
            `"none"` (a pool's std can be tiny).
        memory_gate_on_outcome (`bool`, *optional*, defaults to `False`):
            Variant: add the memory advantage only on rows whose outcome advantage is >= 0.
        memory_full_from_reference (`bool`, *optional*, defaults to `False`):
            Variant: score P_full with the reference model (needs `beta > 0` or a PEFT adapter).
        memory_scoring_batch_size (`int`, *optional*, defaults to `8`):
            Sequences per no-grad forward when scoring P_full / P_mem (bounds memory).
        memory_scoring (`str`, *optional*, defaults to `"auto"`):
            How P_full / P_mem are computed; all give the same values. `"batched"`: each (context, answer) pair is
            its own sequence of one padded batch. `"shared_prefix"`: the full-history
            contexts of one trajectory are prefixes of each other (and the mem contexts of one question share their
            first messages), so the longest is forwarded once into a KV cache, then every context adds only its own
            tail and the answer under a block mask: linear instead of quadratic tokens in the number of rounds.
            Needs `sdpa` or `eager` attention (not flash-attention); the mask is (tail tokens) x (context + tail
            tokens) per sequence. `"auto"`: `shared_prefix` when
            the model's attention allows it, else `batched`.

        > Parameters that control the loss forward

        loss_forward (`str`, *optional*, defaults to `"padded"`):
            How the loss (and the old / reference log-probs) forwards the rows. Either way the LM head projects only
            the hidden states that predict a trained completion token, on every device (TRL 1.16 does so only on
            Triton devices), with the same log-probs and gradients as projecting every position (tested, fp32).
            `"padded"`: TRL's forward of the padded `[prompt | completion]` batch. `"shared_prefix"`: the rows of a
            micro-batch that share a prompt prefix (the rounds of a question: system prompt, instruction, question)
            forward it once into a KV cache kept in the autograd graph, then only their own tails over it under a
            4D mask (two forwards, as `memory_scoring="shared_prefix"`, with gradient): fewer forwarded tokens, the
            same loss and gradients up to float rounding (tested against `"padded"`; not bit-identical, hence
            opt-in). Needs `sdpa` or `eager` attention, `activation_checkpointing=False`, one process, no PEFT
            adapter and no MoE auxiliary loss (refused at start otherwise).

        > Parameters that control dynamic sampling (DAPO)

        dynamic_sampling (`str`, *optional*, defaults to `"keep"`):
            What happens to a training group whose outcome rewards are all equal (within `dynamic_sampling_tolerance`),
            which has outcome advantage 0 on every row. `"keep"`: nothing (TRL's behaviour). `"drop"`: its rows leave
            the loss: their completion mask and advantage (outcome and memory) are zeroed, so they contribute nothing
            and the token-level normalisation does not count their tokens (nor does a `"batch"` std). `"refill"`
            (DAPO's dynamic sampling; verl's `filter_groups`): first play the whole generation batch again on fresh
            prompts, drawn from `train_dataset` with a generator seeded by `seed` and the step (the same draw on
            every process), and put each of its informative groups in place of the all-equal group that held the
            same rows, up to `dynamic_sampling_max_rounds` rounds; groups still all-equal are then dropped. The
            batch keeps its shape and every process its rows, so no data moves between processes, and each round
            costs one generation batch, like verl's `max_num_gen_batches`. Needs a retriever (not
            `environment_factory`). Evaluation always keeps every group. Logged:
            `dynamic_sampling/frac_reward_zero_std_before` (the first generation's all-equal share) and `_after`
            (the final batch's, before the drop), `dynamic_sampling/groups_dropped`, `dynamic_sampling/groups_refilled`,
            `dynamic_sampling/refill_rounds`. For MemPO, a dropped group also loses its memory advantage. The first
            step that drops every group (it trains nothing) is announced in one line.
        dynamic_sampling_tolerance (`float`, *optional*, defaults to `1e-6`):
            Rewards of a group are all equal when they span (max - min) at most this much.
        dynamic_sampling_max_rounds (`int`, *optional*, defaults to `3`):
            With `"refill"`: extra generation rounds per batch at most.

        > Parameters that control the rollout log (docs/viewer.md)

        rollout_log_steps (`int`, *optional*, defaults to `0`):
            Every N-th training step, write its episodes, every round with its context length, `<mem>`, action,
            result, answer, outcome reward, P_mem, P_full, memory reward and advantages, to
            `output_dir/rollouts/step-NNNNNN.jsonl` (one file per step, written whole when the step ends; with
            `report_to` wandb or trackio also as the table `rollouts`, one row per round). `mempo-trl view` turns
            them into a page. `0`: off.
        rollout_log_episodes (`int`, *optional*, defaults to `16`):
            Episodes written per logged step at most: the main process's first ones (groups of `num_generations`
            stay whole when it is a multiple).

    Every `loss_type` of TRL works, with one row per turn: a round is a sequence. Episodes have different numbers
    of turns, so the rows are padded with fully masked placeholder rows to keep every process in step. `"dapo"` (the
    default), `"bnpo"`, `"cispo"` and `"vespo"` normalise over real completion tokens, so placeholders change
    nothing; `"grpo"`, `"sapo"`, `"luspo"` (a mean over rows) and `"dr_grpo"` (rows x `max_completion_length`) count
    rows, and the placeholder rows (and those of groups `dynamic_sampling` drops) leave each micro-batch before the
    loss, so they count the real rounds only, as TRL counts its completions.
    """

    # The settings of the turn protocol, the memory reward, dynamic sampling and the loss forward, declared (default,
    # help, choices, bounds) and validated where they live: `TurnProtocol`, `MemoryRewardSettings`,
    # `DynamicSamplingSettings`, `LossForwardSettings`.
    max_turns: int = flat_field(TurnProtocol, "max_turns")
    retrieval_topk: int = flat_field(TurnProtocol, "retrieval_topk")
    context_mode: str = flat_field(TurnProtocol, "context_mode")
    system_prompt: str = flat_field(TurnProtocol, "system_prompt")
    instruction: str = flat_field(TurnProtocol, "instruction")
    context_overflow: str = flat_field(TurnProtocol, "context_overflow")
    max_context_tokens: int | None = flat_field(TurnProtocol, "max_context_tokens")
    memory_coef: float = flat_field(MemoryRewardSettings, "memory_coef")
    memory_threshold: float | None = flat_field(MemoryRewardSettings, "memory_threshold")
    memory_threshold_quantile: float | None = flat_field(MemoryRewardSettings, "memory_threshold_quantile")
    memory_reward_type: str = flat_field(MemoryRewardSettings, "memory_reward_type")
    memory_reward_eps: float = flat_field(MemoryRewardSettings, "memory_reward_eps")
    memory_reward_parts: str = flat_field(MemoryRewardSettings, "memory_reward_parts")
    memory_length_penalty: float = flat_field(MemoryRewardSettings, "memory_length_penalty")
    memory_pooling: str = flat_field(MemoryRewardSettings, "memory_pooling")
    memory_scale_rewards: str = flat_field(MemoryRewardSettings, "memory_scale_rewards")
    memory_center_rewards: bool = flat_field(MemoryRewardSettings, "memory_center_rewards")
    memory_gate_on_outcome: bool = flat_field(MemoryRewardSettings, "memory_gate_on_outcome")
    memory_full_from_reference: bool = flat_field(MemoryRewardSettings, "memory_full_from_reference")
    memory_scoring_batch_size: int = flat_field(MemoryRewardSettings, "memory_scoring_batch_size")
    memory_scoring: str = flat_field(MemoryRewardSettings, "memory_scoring")

    loss_forward: str = flat_field(LossForwardSettings, "loss_forward")

    dynamic_sampling: str = flat_field(DynamicSamplingSettings, "dynamic_sampling")
    dynamic_sampling_tolerance: float = flat_field(DynamicSamplingSettings, "dynamic_sampling_tolerance")
    dynamic_sampling_max_rounds: int = flat_field(DynamicSamplingSettings, "dynamic_sampling_max_rounds")

    rollout_log_steps: int = flat_field(RolloutLogSettings, "rollout_log_steps")
    rollout_log_episodes: int = flat_field(RolloutLogSettings, "rollout_log_episodes")

    # TRL's GRPOConfig turns checkpointing on through `gradient_checkpointing`, a name transformers 5 deprecates (a
    # FutureWarning on every run); the same default under the current name, and an explicit old name still wins.
    activation_checkpointing: bool | None = field(
        default=None, metadata={"help": "Recompute activations in the backward pass to save memory (default: on)."}
    )
    gradient_checkpointing: bool | None = field(  # type: ignore[assignment]  # None: unset (TRL types it bool)
        default=None, metadata={"help": "Deprecated alias of `activation_checkpointing`."}
    )

    def __post_init__(self) -> None:
        if self.activation_checkpointing is None and self.gradient_checkpointing is None:
            self.activation_checkpointing = True
        problems = field_type_problems(self)  # before GRPOConfig's own checks, which divide by num_generations
        if self.num_generations is not None and isinstance(self.num_generations, int) and self.num_generations < 1:
            problems.append(f"num_generations must be >= 1, got {self.num_generations}.")
        if problems:
            raise ValueError("Invalid MemPOConfig:\n- " + "\n- ".join(problems))
        super().__post_init__()
        problems += TurnProtocol.problems(self) + MemoryRewardSettings.problems(self)
        problems += DynamicSamplingSettings.problems(self) + RolloutLogSettings.problems(self)
        problems += LossForwardSettings.problems(self)
        if self.remove_unused_columns:
            problems.append(
                "remove_unused_columns must be False: MemPOTrainer reads the dataset's own columns (`question`, "
                "`golden_answers`, an environment's `reset` arguments); set remove_unused_columns=False."
            )
        if problems:
            raise ValueError("Invalid MemPOConfig:\n- " + "\n- ".join(problems))
        truncation = truncated_sampling(self)
        if (
            self.use_vllm
            and truncation
            and (self.vllm_importance_sampling_correction or self.off_policy_mask_threshold is not None)
            and first_to_announce()
        ):
            warnings.warn(
                f"{', '.join(truncation)} with vLLM: TRL's importance-sampling ratio (and off-policy mask) compares "
                "vLLM's log-probs, renormalised over the tokens the truncation keeps, with the trainer's over the "
                "whole vocabulary, so every ratio is scaled by the kept probability mass (trl#6789). Sample without "
                "truncation, or set vllm_importance_sampling_correction: false.",
                stacklevel=3,  # the caller of MemPOConfig(...), past the generated __init__
            )

    def turn_protocol(self, environment: bool = False) -> TurnProtocol:
        """The turn protocol these fields set (`TurnProtocol.from_config`); ``environment``: its tool-call form."""
        return TurnProtocol.from_config(self, environment=environment)

    def memory_settings(self) -> MemoryRewardSettings:
        """The `memory_*` fields as one `MemoryRewardSettings`."""
        return MemoryRewardSettings.from_config(self)

    def dynamic_sampling_settings(self) -> DynamicSamplingSettings:
        """The `dynamic_sampling*` fields as one `DynamicSamplingSettings`."""
        return DynamicSamplingSettings.from_config(self)

    def __copy__(self) -> "MemPOConfig":
        """A shallow copy of every field, `hub_token` included (`__getstate__` leaves it out of pickles only)."""
        clone = type(self).__new__(type(self))
        clone.__dict__.update(self.__dict__)
        return clone

    def __getstate__(self) -> dict:
        """Pickled state (what `Trainer` saves as `training_args.bin`, pushed with the model) without `hub_token`.

        Example:
            >>> import pickle
            >>> pickle.loads(pickle.dumps(MemPOConfig("out", hub_token="hf_secret"))).hub_token is None
            True
        """
        return {**self.__dict__, "hub_token": None}


@dataclass
class MemPOSFTConfig(SFTConfig):
    """TRL's `SFTConfig` (for `mempo-trl sft`) with two defaults a CPU run needs: ``bf16`` only where the accelerator
    supports it (TRL's default, bf16 on, stops a CPU run with transformers' "doesn't support bf16/gpu" error; a CPU
    run trains in float32, as `mempo-trl train`'s CPU recipes), and checkpointing under its current name
    ``activation_checkpointing`` (TRL's ``gradient_checkpointing=True`` warns on every run); an explicit value of
    either still wins."""

    gradient_checkpointing: bool | None = field(  # type: ignore[assignment]  # None: unset (TRL types it bool)
        default=None, metadata={"help": "Deprecated alias of `activation_checkpointing`."}
    )

    def __post_init__(self) -> None:
        if self.bf16 is None and not self.fp16 and (self.use_cpu or not is_torch_bf16_gpu_available()):
            self.bf16 = False
        if self.activation_checkpointing is None and self.gradient_checkpointing is None:
            self.activation_checkpointing = True
        super().__post_init__()
