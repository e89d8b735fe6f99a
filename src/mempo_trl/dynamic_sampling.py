"""Dynamic sampling (DAPO, arXiv 2503.14476): what happens to the groups whose rewards are all equal.

Such a group has outcome advantage 0 on every row, so in GRPO it only dilutes the token-level loss. `MemPOTrainer`
keeps it (TRL's behaviour), drops it from the loss, or replaces it with groups of further prompts
(`mempo_trl.settings.DynamicSamplingSettings`); the decisions are the pure functions below.
"""

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
