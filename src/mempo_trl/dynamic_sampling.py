"""Dynamic sampling (DAPO, arXiv 2503.14476): what happens to the groups whose rewards are all equal.

Such a group has outcome advantage 0 on every row, so in GRPO it only dilutes the token-level loss. `MemPOTrainer`
keeps it (TRL's behaviour), drops it from the loss, or replaces it with groups of further prompts
(`mempo_trl.settings.DynamicSamplingSettings`): `dynamic_sampling` applies them to a `ScoredStep`, with the
decisions as the pure functions below.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch


def zero_std_groups(rewards: torch.Tensor, num_generations: int, tolerance: float = 0.0) -> torch.Tensor:
    """Which groups have all-equal rewards: ``(N,) -> (N // G,)`` bool, consecutive groups of ``G`` rows.

    A group is all-equal when its rewards span at most ``tolerance`` (max - min), so continuous rewards that differ
    only by noise count. NaN rewards (unscorable trajectories) are left out; a group with fewer than two scorable
    rewards is all-equal (its advantages are 0, as in TRL).

    >>> zero_std_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5005]), 2, tolerance=1e-3)
    tensor([ True, False,  True])
    >>> zero_std_groups(torch.tensor([1.0, float("nan")]), 2)
    tensor([True])
    """
    if rewards.dim() != 1 or num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {num_generations}")
    grouped = rewards.float().view(-1, num_generations)
    scorable = ~torch.isnan(grouped)
    high = grouped.masked_fill(~scorable, -torch.inf).max(dim=1).values
    low = grouped.masked_fill(~scorable, torch.inf).min(dim=1).values
    return (scorable.sum(dim=1) < 2) | (high - low <= tolerance)


def refillable_groups(zero_std: torch.Tensor, candidate_zero_std: torch.Tensor) -> torch.Tensor:
    """Which group slots take the group a refill round played in the same slot: ``(K,), (K,) -> (K,)`` bool.

    A slot is refilled when its group is all-equal and the candidate group (the same rows of the batch played again
    on a fresh prompt) is not.

    >>> refillable_groups(torch.tensor([True, True, False]), torch.tensor([False, True, False]))
    tensor([ True, False, False])
    """
    if zero_std.shape != candidate_zero_std.shape:
        raise ValueError(f"shapes {tuple(zero_std.shape)} and {tuple(candidate_zero_std.shape)} differ")
    return zero_std & ~candidate_zero_std


@dataclass(frozen=True)
class ScoredStep:
    """A played and scored training batch: what dynamic sampling takes and hands back.

    ``rollout`` is this process's `mempo_trl.rollout.Rollout` (its ``n`` episodes and their training rows),
    ``outcomes`` and ``stats`` one `OutcomeScore` and one ``episode_metrics`` dict per episode; ``rewards_per_func``
    ``(N, F)`` and ``rewards`` ``(N,)`` cover the trajectories of all processes (global rows ``rank * n ... rank * n
    + n - 1`` are this process's), and ``dropped`` ``(N,)`` marks those whose group leaves the loss.
    """

    rollout: Any
    outcomes: list
    stats: list[dict[str, float]]
    rewards_per_func: torch.Tensor
    rewards: torch.Tensor
    dropped: torch.Tensor | None = None


def splice(step: ScoredStep, fresh: ScoredStep, take: torch.Tensor, rank: int, num_generations: int) -> ScoredStep:
    """``step`` with the groups ``take`` (``(N // G,)`` bool) replaced by those of ``fresh``, played on the same slots.

    Each process swaps its own episodes, training rows, scores and rewards; no data moves between processes.
    """
    n = len(step.rollout.episodes)
    local_take = [bool(take[(rank * n + i) // num_generations]) for i in range(n)]
    rows = take.repeat_interleave(num_generations)
    return ScoredStep(
        step.rollout.splice(fresh.rollout, local_take),
        [b if t else a for a, b, t in zip(step.outcomes, fresh.outcomes, local_take)],
        [b if t else a for a, b, t in zip(step.stats, fresh.stats, local_take)],
        torch.where(rows.unsqueeze(1), fresh.rewards_per_func, step.rewards_per_func),
        torch.where(rows, fresh.rewards, step.rewards),
    )


def splice_extra_logs(pending: dict[str, list], before: dict[str, list], local_take: list[bool]) -> None:
    """Keep, in TRL's ``_pending_extra_logs`` (``pending``, changed in place), the ``log_extra`` columns of the
    episodes a refill took and the earlier values (``before``, a copy taken before the refill round) of the others."""
    n = len(local_take)
    for column in set(before) | set(pending):
        old = before.get(column, [None] * n)
        new = pending[column][len(before.get(column, [])) :]
        new = new if len(new) == n else [None] * n
        pending[column] = [b if t else a for a, b, t in zip(old, new, local_take)]


def dynamic_sampling(
    step: ScoredStep,
    settings,
    num_generations: int,
    rank: int,
    draw: Callable[[int, int], list[dict]],
    play: Callable[[list[dict]], ScoredStep],
    pending_logs: dict[str, list],
) -> tuple[ScoredStep, dict[str, float]]:
    """`DynamicSamplingSettings` on a training batch: refill its all-equal groups, then mark those left as dropped.

    Each refill round (``dynamic_sampling="refill"``, at most ``dynamic_sampling_max_rounds``) plays the whole batch
    again on fresh rows, ``draw(round, slots)`` giving one row per group slot (the same draw on every process), with
    ``play`` (the rollout and the scores), and a slot whose group is all-equal takes the round's group when that one
    is not (`refillable_groups`, `splice`; the ``log_extra`` columns of reward functions in ``pending_logs`` follow,
    `splice_extra_logs`). Returns the step with ``dropped`` set and the ``dynamic_sampling/*`` metrics.
    """
    tolerance = settings.dynamic_sampling_tolerance
    zero_std = zero_std_groups(step.rewards, num_generations, tolerance)
    before, refilled, rounds = zero_std.float().mean().item(), torch.zeros_like(zero_std), 0
    n = len(step.rollout.episodes)
    slots = [(rank * n + i) // num_generations for i in range(n)]
    while settings.dynamic_sampling == "refill" and zero_std.any() and rounds < settings.dynamic_sampling_max_rounds:
        rounds += 1
        drawn = draw(rounds, zero_std.numel())
        logs_before = {column: list(values) for column, values in pending_logs.items()}
        fresh = play([drawn[k] for k in slots])
        take = refillable_groups(zero_std, zero_std_groups(fresh.rewards, num_generations, tolerance))
        step = splice(step, fresh, take, rank, num_generations)
        splice_extra_logs(pending_logs, logs_before, [bool(take[k]) for k in slots])
        zero_std, refilled = zero_std & ~take, refilled | take
    metrics = {
        "dynamic_sampling/frac_reward_zero_std_before": before,
        "dynamic_sampling/frac_reward_zero_std_after": zero_std.float().mean().item(),
        "dynamic_sampling/groups_dropped": float(zero_std.sum().item()),
        "dynamic_sampling/groups_refilled": float(refilled.sum().item()),
        "dynamic_sampling/refill_rounds": float(rounds),
    }
    return replace(step, dropped=zero_std.repeat_interleave(num_generations)), metrics
