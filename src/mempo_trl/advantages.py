"""Outcome advantages (GRPO, per trajectory), their expansion to per-round rows, and the final per-token sum."""

from collections.abc import Sequence

import torch


def group_outcome_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str | bool = "group"
) -> torch.Tensor:
    """GRPO advantages of trajectory rewards ``(N,) -> (N,)``, consecutive groups of ``num_generations`` rows.

    Matches TRL 1.16 ``GRPOTrainer`` (``sum_then_normalize``): ``r - group mean``, divided by ``std + 1e-4`` where
    std is the unbiased (Bessel) std of the group (``"group"``/``True``) or of the whole batch (``"batch"``); no
    division for ``"none"``/``False``. A group (or batch) of one value has std 0, as in TRL.

    >>> group_outcome_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 2, "none")
    tensor([ 0.5000, -0.5000,  0.0000,  0.0000])
    """
    scale = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    if num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {num_generations}")
    rewards = rewards.float()
    grouped = rewards.view(-1, num_generations)
    advantages = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    if scale == "group":
        std = grouped.std(dim=1) if num_generations > 1 else torch.zeros(grouped.shape[0], device=rewards.device)
        advantages = advantages / (std.repeat_interleave(num_generations) + 1e-4)
    elif scale == "batch":
        std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
        advantages = advantages / (std + 1e-4)
    return advantages


def expand_to_rounds(values: torch.Tensor, rounds_per_trajectory: Sequence[int]) -> torch.Tensor:
    """Repeat each trajectory's value once per round, ``(N,) -> (sum(rounds),)``.

    >>> expand_to_rounds(torch.tensor([0.5, -1.0]), [2, 3])
    tensor([ 0.5000,  0.5000, -1.0000, -1.0000, -1.0000])
    """
    if len(rounds_per_trajectory) != values.shape[0]:
        raise ValueError(f"{len(rounds_per_trajectory)} round counts for {values.shape[0]} trajectories")
    if any(n < 0 for n in rounds_per_trajectory):
        raise ValueError("round counts must be >= 0")
    repeats = torch.as_tensor(list(rounds_per_trajectory), dtype=torch.long, device=values.device)
    return values.repeat_interleave(repeats, dim=0)


def combine_advantages(
    outcome_row_advantages: torch.Tensor,
    memory_advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    memory_coef: float = 1.0,
) -> torch.Tensor:
    """Per-token advantage ``(R,), (R, T), (R, T) -> (R, T)``: outcome on every token plus ``coef`` x memory, masked.

    >>> combine_advantages(torch.tensor([0.75]), torch.tensor([[1.2, 0.0, 0.0]]), torch.tensor([[1, 1, 0]]))
    tensor([[1.9500, 0.7500, 0.0000]])
    """
    if memory_advantages.shape != completion_mask.shape or outcome_row_advantages.shape != (
        memory_advantages.shape[0],
    ):
        raise ValueError(
            f"shapes {tuple(outcome_row_advantages.shape)}, {tuple(memory_advantages.shape)}, "
            f"{tuple(completion_mask.shape)} do not match (R,), (R, T), (R, T)"
        )
    combined = outcome_row_advantages.float().unsqueeze(1) + memory_coef * memory_advantages.float()
    return combined * completion_mask.to(combined.dtype)
