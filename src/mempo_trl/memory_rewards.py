"""The memory-reward variants by name, registries of the choices of two settings (docs/algorithm.md, "Variants"):
`MEMORY_REWARDS` (``memory_reward_type``: how P_mem and P_full give a reward) and `PART_REWARDS`
(``memory_reward_parts``: how the parts of a multi-part gold answer are scored).

A ``memory_reward_type`` maps P_mem and P_full of the scored rounds, tensors of shape (N,), to their memory rewards,
shape (N,), with tensor methods only; a ``memory_reward_parts`` entry (`mempo_trl.memory`, imported on first use)
maps the answer-token log-probs and masks and the part of each token to the rewards. So the settings (and `mempo-trl
train --help`) read the names without importing torch. A new variant is one ``register_*`` call.
"""

from collections.abc import Callable

from mempo_trl.registry import Registry


MEMORY_REWARDS = Registry("memory_reward_type")
"""Each variant's function ``(p_mem, p_full, eps) -> reward``, by the name `memory_reward_type` gives it."""

PART_REWARDS = Registry("memory_reward_parts")
"""Each answer-parts rule's function ``(full, mem, parts, mode, eps, threshold) -> (N,)`` (or its
``"module:function"`` path), by the name `memory_reward_parts` gives it."""


def register_memory_reward(name: str, reward: Callable, help: str) -> Callable:
    """Add a memory-reward variant ``(p_mem, p_full, eps) -> reward`` as a choice of ``memory_reward_type``; ``help``
    is its line in that setting's help."""
    return MEMORY_REWARDS.register(name, reward, help)


def register_part_reward(name: str, reward: Callable | str, help: str) -> Callable | str:
    """Add a rule for multi-part gold answers ``(full, mem, parts, mode, eps, threshold) -> (N,)`` (or its
    ``"module:function"`` path) as a choice of ``memory_reward_parts``; ``help`` is its line in that setting's help."""
    return PART_REWARDS.register(name, reward, help)


def diff_reward(p_mem, p_full, eps: float):
    """``p_mem - p_full`` (the paper's memory reward); ``eps`` is unused."""
    return p_mem - p_full


def log_ratio_reward(p_mem, p_full, eps: float):
    """``log(p_mem + eps) - log(p_full + eps)``; ``eps`` > 0."""
    if eps <= 0:
        raise ValueError(f"eps must be > 0 for mode='log_ratio', got {eps}")
    return (p_mem + eps).log() - (p_full + eps).log()


register_memory_reward("diff", diff_reward, "P_mem - P_full (the paper's)")
register_memory_reward("log_ratio", log_ratio_reward, "log(P_mem + eps) - log(P_full + eps)")

register_part_reward("joint", "mempo_trl.memory:joint_reward", "one P over all gold tokens (the paper's)")
register_part_reward(
    "weakest",
    "mempo_trl.memory:weakest_part_reward",
    "with multi-part golds (`sub_answers`), the reward of the part it is lowest for",
)
register_part_reward(
    "losses",
    "mempo_trl.memory:losses_reward",
    "with multi-part golds, where a part's reward is below 0, the mean of min(part reward, 0) over the parts",
)
