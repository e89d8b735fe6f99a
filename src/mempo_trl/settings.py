"""Where a MemPO setting is declared once: its default, help, choices and bounds, as dataclass field metadata.

`TurnProtocol` (`mempo_trl.protocol`), `MemoryRewardSettings`, `DynamicSamplingSettings`, `RolloutLogSettings` and
`LossForwardSettings` (here) declare their fields with `setting`;
`MemPOConfig` re-exposes them as flat fields (`flat_field`: the names recipes and TRL's parser use), the agent's
override arguments are generated from them (`override_field`), `mempo-trl train --help` prints their help, and
`setting_problems` is their one validation. No torch and no TRL are imported here, so that the CLI's help stays fast.
"""

import math
import types
from collections.abc import Collection
from dataclasses import dataclass, field, fields
from typing import Any

from mempo_trl.memory_rewards import MEMORY_REWARDS, PART_REWARDS


PARSER_KEYS = ("help", "choices")
"""The metadata keys argparse takes (TRL's parser passes a field's metadata to `add_argument`)."""


def setting(
    default: Any,
    help: str,
    choices: Collection | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
) -> Any:
    """A dataclass field with its help, choices and bounds in its metadata (`setting_problems` checks them); typed
    ``Any`` as `dataclasses.field` is, so that a field declared with it keeps its annotation's type."""
    metadata: dict[str, Any] = {"help": help}
    metadata.update(
        {k: v for k, v in (("choices", choices), ("minimum", minimum), ("maximum", maximum)) if v is not None}
    )
    return field(default=default, metadata=metadata)


def flat_field(source: type, name: str) -> Any:
    """A field of `MemPOConfig` with the default and help of ``source``'s field ``name`` (one place declares them)."""
    f = next(f for f in fields(source) if f.name == name)
    metadata = {key: value for key, value in f.metadata.items() if key in PARSER_KEYS}
    return field(default=f.default, metadata=metadata)


def override_field(source: type, name: str, more_choices: tuple[str, ...] = (), note: str = "") -> Any:
    """An optional command-line field (default None: keep the saved value) with the help and choices of
    ``source``'s field ``name``; ``more_choices`` and ``note`` extend them for one command."""
    f = next(f for f in fields(source) if f.name == name)
    metadata = {"help": f"{f.metadata['help']}{note} (default: the saved value)"}
    if "choices" in f.metadata:
        metadata["choices"] = [*f.metadata["choices"], *more_choices]
    return field(default=None, metadata=metadata)


def setting_problems(source: type, values: Any) -> list[str]:
    """One sentence per field of ``source`` whose value in ``values`` (any object with the same attribute names; a
    missing one is skipped) is outside its declared choices or bounds. Types are `field_type_problems`' concern: a
    value that is not a number is not compared.

    Example:
        >>> from types import SimpleNamespace
        >>> setting_problems(MemoryRewardSettings, SimpleNamespace(memory_pooling="round", memory_coef=1.0))
        ["memory_pooling must be one of ('question', 'question_round'), got 'round'."]
    """
    problems = []
    for f in fields(source):
        if not hasattr(values, f.name):
            continue
        value, meta = getattr(values, f.name), f.metadata
        if "choices" in meta and value not in meta["choices"]:
            problems.append(f"{f.name} must be one of {tuple(meta['choices'])}, got {value!r}.")
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            continue
        low, high = meta.get("minimum"), meta.get("maximum")
        optional = isinstance(f.type, types.UnionType) and type(None) in f.type.__args__
        if low is not None and high is not None and not low <= value <= high:
            problems.append(f"{f.name} must be in [{low}, {high}], got {value}.")
        elif low == 1 and optional and value < 1:
            problems.append(f"{f.name} must be a positive integer (or null), got {value}.")
        elif low is not None and high is None and value < low:
            problems.append(f"{f.name} must be >= {low}, got {value}.")
    return problems


class SettingsHome:
    """A home of settings: a frozen dataclass of `setting` fields, validated when built (`problems`: an invalid
    value raises `ValueError`), and built from a `MemPOConfig`'s flat fields of the same names (`from_config`)."""

    def __post_init__(self):
        problems = self.problems(self)
        if problems:
            raise ValueError(" ".join(problems))

    @classmethod
    def problems(cls, values: Any) -> list[str]:
        """Why ``values`` (these settings, or a `MemPOConfig`) cannot be used: choices and bounds."""
        return setting_problems(cls, values)

    @classmethod
    def from_config(cls, config: Any):
        """The settings of a `MemPOConfig` (or anything with the same attributes)."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class MemoryRewardSettings(SettingsHome):
    """How the memory reward is scored and turned into the memory advantage (docs/algorithm.md, "Memory reward").

    The `memory_*` fields of `MemPOConfig` (`MemPOConfig.memory_settings()` hands them out as one object);
    `mempo_advantages` and the trainer's scoring read them from here. An invalid value raises `ValueError`.

    Example:
        >>> MemoryRewardSettings(memory_pooling="question_round").memory_pooling
        'question_round'
        >>> MemoryRewardSettings(memory_scale_rewards="std")
        Traceback (most recent call last):
        ...
        ValueError: memory_scale_rewards must be one of ('group', 'batch', 'none'), got 'std'.
    """

    memory_coef: float = setting(
        1.0, "Weight of the memory advantage on `<mem>` tokens (0 turns memory scoring off).", minimum=0.0
    )
    memory_threshold: float | None = setting(
        math.log(0.5),
        "Keep answer tokens with log p above it (a log-probability, < 0) when computing P; None keeps all.",
    )
    memory_threshold_quantile: float | None = setting(
        None, "Use this quantile of the batch's answer-token log-probs as the threshold.", minimum=0.0, maximum=1.0
    )
    memory_reward_type: str = setting(
        "diff",
        MEMORY_REWARDS.help_text("How P_mem and P_full give the memory reward (`mempo_trl.memory_rewards`):"),
        choices=MEMORY_REWARDS.keys(),
    )
    memory_reward_eps: float = setting(1e-6, "eps of the log-ratio memory reward (> 0).")
    memory_reward_parts: str = setting(
        "joint",
        PART_REWARDS.help_text("How the parts of a gold answer are scored:"),
        choices=PART_REWARDS.keys(),
    )
    memory_length_penalty: float = setting(0.0, "lambda of the `<mem>` length penalty (0 = off).", minimum=0.0)
    memory_pooling: str = setting(
        "question", "`question` or `question_round` normalisation pool.", choices=("question", "question_round")
    )
    memory_scale_rewards: str = setting(
        "group",
        "Std the memory rewards are divided by: `group` (their pool's), `batch` or `none`.",
        choices=("group", "batch", "none"),
    )
    memory_center_rewards: bool = setting(
        True, "Take each pool's mean off the memory rewards (paper). False: a reward keeps its sign against P_full."
    )
    memory_gate_on_outcome: bool = setting(False, "Memory advantage only where the outcome advantage is >= 0.")
    memory_full_from_reference: bool = setting(False, "Score P_full with the reference model.")
    memory_scoring_batch_size: int = setting(8, "Sequences per memory-scoring forward.", minimum=1)
    memory_scoring: str = setting(
        "auto",
        "`batched`: every context scored as its own sequence. `shared_prefix`: the contexts of a trajectory share "
        "one forward of their common part (same values, fewer tokens; needs sdpa/eager). `auto`: shared_prefix "
        "with sdpa/eager attention, else batched.",
        choices=("auto", "batched", "shared_prefix"),
    )

    @classmethod
    def problems(cls, values: Any) -> list[str]:
        """Why ``values`` (these settings, or a `MemPOConfig`) cannot be used: bounds, choices and combinations."""
        problems = setting_problems(cls, values)
        threshold, eps = values.memory_threshold, values.memory_reward_eps
        if isinstance(threshold, int | float) and not isinstance(threshold, bool) and threshold >= 0:
            problems.append(
                f"memory_threshold is a log-probability and must be < 0 (e.g. -0.69 = log 0.5), got {threshold}: no "
                "answer token has log p above it, so the memory reward would be 0 all run."
            )
        if isinstance(eps, int | float) and not isinstance(eps, bool) and eps <= 0:
            problems.append(f"memory_reward_eps must be > 0 (log(P + eps) of a P of 0), got {eps}.")
        if values.memory_threshold is not None and values.memory_threshold_quantile is not None:
            problems.append(
                "Set memory_threshold or memory_threshold_quantile, not both (use memory_threshold: null)."
            )
        return problems


@dataclass(frozen=True)
class DynamicSamplingSettings(SettingsHome):
    """What happens to the training groups whose outcome rewards are all equal (DAPO's dynamic sampling;
    `mempo_trl.dynamic_sampling`, the `MemPOConfig` docstring). `MemPOConfig.dynamic_sampling_settings()` hands them
    out; an invalid value raises `ValueError`.

    Example:
        >>> DynamicSamplingSettings(dynamic_sampling="refill").dynamic_sampling_max_rounds
        3
        >>> DynamicSamplingSettings(dynamic_sampling_max_rounds=0)
        Traceback (most recent call last):
        ...
        ValueError: dynamic_sampling_max_rounds must be >= 1, got 0.
    """

    dynamic_sampling: str = setting(
        "keep",
        "Groups whose rewards are all equal: `keep` (TRL), `drop` them from the loss, or `refill` the batch with "
        "groups of fresh prompts (DAPO dynamic sampling), up to `dynamic_sampling_max_rounds` rounds.",
        choices=("keep", "drop", "refill"),
    )
    dynamic_sampling_tolerance: float = setting(
        1e-6, "A group's rewards are all equal when they span at most this much.", minimum=0.0
    )
    dynamic_sampling_max_rounds: int = setting(
        3, "With `refill`: extra generation rounds per batch at most.", minimum=1
    )


@dataclass(frozen=True)
class RolloutLogSettings(SettingsHome):
    """Which training episodes are written to the rollout log (`mempo_trl.rollout_log`, docs/viewer.md), and how
    many; an invalid value raises `ValueError`.

    Example:
        >>> RolloutLogSettings(rollout_log_steps=10).rollout_log_episodes
        16
    """

    rollout_log_steps: int = setting(
        0,
        "Write the episodes of every N-th training step, every round with its memory, action, result, rewards, "
        "P_mem, P_full and advantages, to output_dir/rollouts/step-NNNNNN.jsonl (`mempo-trl view` shows them); "
        "0: off.",
        minimum=0,
    )
    rollout_log_episodes: int = setting(
        16, "Episodes written per logged step at most (the main process's first ones).", minimum=1
    )


@dataclass(frozen=True)
class LossForwardSettings(SettingsHome):
    """How the loss forwards its rows (`mempo_trl.loss_forward`, the `MemPOConfig` docstring); an invalid value
    raises `ValueError`.

    Example:
        >>> LossForwardSettings().loss_forward
        'padded'
    """

    loss_forward: str = setting(
        "padded",
        "`padded`: the loss forwards each row whole. `shared_prefix`: the rows that share a prompt prefix (a "
        "question's rounds) forward it once, with gradient (fewer tokens, same loss up to float rounding; sdpa/eager, "
        "activation_checkpointing off, one process, no PEFT).",
        choices=("padded", "shared_prefix"),
    )


def field_type_problems(config, strict: bool = False) -> list[str]:
    """One sentence per field of `config` whose value does not fit its declared `int` or `float` type.

    `int` fields take integers only (a float such as 2.7 is refused, not truncated); `float` fields take finite
    numbers only (`.nan` and `.inf` in a YAML recipe are refused: they would train to NaN weights). Booleans are
    neither. Strings and None are left to the parser that converts them (TRL's) and to the other checks, unless
    ``strict`` (a saved JSON file, which nothing converts): then a string is refused, and None too where the type
    does not allow it.

    Example:
        >>> from dataclasses import make_dataclass
        >>> Toy = make_dataclass("Toy", [("retrieval_topk", int), ("memory_coef", float)])
        >>> field_type_problems(Toy(retrieval_topk=2.7, memory_coef=float("nan")))
        ['retrieval_topk must be an integer, got 2.7.', 'memory_coef must be a finite number, got nan.']
    """
    problems = []
    for f in fields(config):
        kinds = set(f.type.__args__) if isinstance(f.type, types.UnionType) else {f.type}
        value = getattr(config, f.name, None)
        left = value is None and (not strict or type(None) in kinds) or isinstance(value, str) and not strict
        if left or not kinds & {int, float}:
            continue
        if int in kinds and float not in kinds and (isinstance(value, bool) or not isinstance(value, int)):
            problems.append(f"{f.name} must be an integer, got {value!r}.")
        elif float in kinds and (isinstance(value, bool) or not isinstance(value, int | float)):
            problems.append(f"{f.name} must be a number, got {value!r}.")
        elif float in kinds and not math.isfinite(value):
            problems.append(f"{f.name} must be a finite number, got {value!r}.")
    weights = getattr(config, "reward_weights", None) or []
    if not all(isinstance(w, int | float) and not isinstance(w, bool) and math.isfinite(w) for w in weights):
        problems.append(f"reward_weights must be finite numbers, got {weights!r}.")
    return problems
