"""The MemPO advantage of a batch of rounds: GRPO outcome advantage per trajectory plus the memory advantage.

`mempo_advantages` is the one place where the pieces are combined (docs/algorithm.md, "Advantages"); the trainer
calls it on the rounds of all processes and nothing else re-implements it.
"""

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from mempo_trl.memory import normalize_memory_rewards, scatter_span_values
from mempo_trl.settings import MemoryRewardSettings


def group_outcome_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str | bool = "group"
) -> torch.Tensor:
    """GRPO advantages of trajectory rewards ``(N,) -> (N,)``, consecutive groups of ``num_generations`` rows.

    Matches TRL 1.16 ``GRPOTrainer`` (``sum_then_normalize``): ``r - group mean``, divided by ``std + 1e-4`` where
    std is the unbiased (Bessel) std of the group (``"group"``/``True``) or of the whole batch (``"batch"``); no
    division for ``"none"``/``False``. A group (or batch) of one value has std 0, as in TRL. A NaN reward (every
    reward function returned None: unscorable) is left out of the means and stds and gets advantage 0, as in TRL.

    >>> group_outcome_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 2, "none")
    tensor([ 0.5000, -0.5000,  0.0000,  0.0000])
    >>> group_outcome_advantages(torch.tensor([1.0, 0.0, float("nan")]), 3, "none")
    tensor([ 0.5000, -0.5000,  0.0000])
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
    advantages = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)).view(-1)
    if scale == "group":
        std = _nanstd(grouped) if num_generations > 1 else torch.zeros(grouped.shape[0], device=rewards.device)
        advantages = advantages / (std.repeat_interleave(num_generations) + 1e-4)
    elif scale == "batch":
        std = _nanstd(rewards.view(1, -1))[0] if rewards.numel() > 1 else rewards.new_zeros(())
        advantages = advantages / (std + 1e-4)
    return advantages.masked_fill(torch.isnan(rewards), 0.0)


def normalize_then_sum_advantages(
    rewards_per_func: torch.Tensor, reward_weights: torch.Tensor, num_generations: int
) -> torch.Tensor:
    """GRPO advantages of per-function trajectory rewards ``(N, F), (F,) -> (N,)``, as TRL 1.16's
    ``multi_objective_aggregation="normalize_then_sum"`` computes them: each function's rewards are normalised in
    their group of ``num_generations`` (``(r - mean) / (std + 1e-4)``), weighted and summed, and the sums normalised
    over the batch. NaN rewards (None) are left out; a trajectory every function left unscored gets advantage 0.

    >>> normalize_then_sum_advantages(torch.tensor([[1.0, 0.0], [0.0, 0.0]]), torch.tensor([1.0, 1.0]), 2)
    tensor([ 0.7070, -0.7070])
    """
    if rewards_per_func.dim() != 2 or rewards_per_func.shape[0] % num_generations:
        raise ValueError(f"rewards {tuple(rewards_per_func.shape)} do not split into groups of {num_generations}")
    grouped = rewards_per_func.float().view(-1, num_generations, rewards_per_func.shape[1])
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    std = _nanstd(grouped.transpose(1, 2).reshape(-1, num_generations)).view(-1, 1, grouped.shape[2])
    normalized = ((grouped - mean) / (std + 1e-4)).view(-1, grouped.shape[2])
    rewards = (normalized * reward_weights.to(normalized)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    std = _nanstd(rewards.view(1, -1))[0] if rewards.numel() > 1 else rewards.new_zeros(())
    return torch.nan_to_num((rewards - torch.nanmean(rewards)) / (std + 1e-4), nan=0.0)


def _nanstd(rows: torch.Tensor) -> torch.Tensor:
    """Unbiased std of each row ``(G, N) -> (G,)`` over its non-NaN values (0 for a row with one value)."""
    count = (~torch.isnan(rows)).sum(dim=1)
    squares = ((rows - torch.nanmean(rows, dim=1, keepdim=True)) ** 2).nansum(dim=1)
    return torch.where(count > 1, squares / (count - 1).clamp(min=1), torch.zeros_like(squares)).sqrt()


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


class MemPOAdvantages(NamedTuple):
    """What `mempo_advantages` returns: ``advantages`` (B, T) for the loss, ``outcome`` (N,) per trajectory and
    ``memory`` (B, T), the normalised (and gated) memory advantage on the ``<mem>`` tokens, before ``memory_coef``."""

    advantages: torch.Tensor
    outcome: torch.Tensor
    memory: torch.Tensor


def mempo_advantages(
    outcome_rewards: torch.Tensor,
    row_trajectories: Sequence[int],
    row_rounds: Sequence[int],
    memory_rewards: Sequence[float | None],
    mem_spans: Sequence[tuple[int, int] | None],
    completion_mask: torch.Tensor,
    local_rows: slice,
    num_generations: int,
    scale_rewards: str | bool = "group",
    settings: MemoryRewardSettings = MemoryRewardSettings(),
    outcome_advantages: torch.Tensor | None = None,
) -> MemPOAdvantages:
    """Per-token advantages of the rounds ``local_rows`` of a batch of N trajectories played as R rounds (rows).

    Args:
        outcome_rewards: ``(N,)`` trajectory rewards; trajectories ``g * G ... g * G + G - 1`` (G =
            ``num_generations``) answer the same question, so ``trajectory // G`` is the group key of a row.
        row_trajectories, row_rounds: ``(R,)`` each row's trajectory (index into ``outcome_rewards``) and 0-based
            round index.
        memory_rewards: ``(R,)`` the memory reward of each row, ``None`` where the round is not scored.
        mem_spans: ``(R,)`` inclusive token span of the row's ``<mem>`` block in its completion, or ``None``.
        completion_mask: ``(B, T)`` mask of the rows ``local_rows`` (``B >= len(local_rows)``); rows past them are
            placeholder rows and get 0.
        local_rows: which of the R rows this call returns (a process's own rows; the pools use all R).
        scale_rewards: GRPO's outcome scaling (`group_outcome_advantages`).
        outcome_advantages: ``(N,)`` the trajectories' outcome advantages when computed otherwise (TRL's
            ``normalize_then_sum``: `normalize_then_sum_advantages`); None: `group_outcome_advantages` of
            ``outcome_rewards``.
        settings: the memory advantage's settings; it reads ``memory_coef`` (its weight), ``memory_pooling``
            (``"question"`` pools the memory rewards of all rounds of a question's G trajectories,
            ``"question_round"`` per (question, round index)), ``memory_scale_rewards`` (the memory rewards' std: of
            their pool, of the batch, or ``"none"``; `normalize_memory_rewards`), ``memory_center_rewards`` (take the
            pool's mean off) and ``memory_gate_on_outcome`` (keep the memory advantage only on rows whose outcome
            advantage is ``>= 0``).

    Returns:
        `MemPOAdvantages`: ``advantages`` ``(B, T)`` = outcome advantage of the row's trajectory on every completion
        token + ``settings.memory_coef`` x ``memory`` ``(B, T)`` (the pooled-normalised memory reward on the ``<mem>``
        tokens), masked; ``outcome`` ``(N,)``.

    >>> out = mempo_advantages(torch.tensor([1.0, 0.0]), [0, 0, 1], [0, 1, 0], [None, 0.3, None],
    ...                        [None, (0, 1), None], torch.ones(3, 3), slice(0, 3), 2, "none")
    >>> out.advantages
    tensor([[ 0.5000,  0.5000,  0.5000],
            [ 0.8000,  0.8000,  0.5000],
            [-0.5000, -0.5000, -0.5000]])
    """
    num_rows = len(row_trajectories)
    if not len(row_rounds) == len(memory_rewards) == len(mem_spans) == num_rows:
        raise ValueError(
            f"row_trajectories, row_rounds, memory_rewards and mem_spans need one entry per row ({num_rows})"
        )
    rows = range(num_rows)[local_rows]
    if completion_mask.dim() != 2 or completion_mask.shape[0] < len(rows):
        raise ValueError(f"completion_mask {tuple(completion_mask.shape)} needs at least {len(rows)} rows")
    if any(memory_rewards[i] is not None and mem_spans[i] is None for i in rows):
        raise ValueError("a scored row needs its <mem> span")
    outcome = outcome_advantages
    if outcome is None:
        outcome = group_outcome_advantages(outcome_rewards, num_generations, scale_rewards)
    scored = [[float(r)] if r is not None else [] for r in memory_rewards]
    normalized = normalize_memory_rewards(
        [t // num_generations for t in row_trajectories],
        scored,
        [[t] * len(v) for t, v in zip(row_rounds, scored)] if settings.memory_pooling == "question_round" else None,
        settings.memory_scale_rewards,
        center=settings.memory_center_rewards,
    )
    if settings.memory_gate_on_outcome:
        normalized = [v if outcome[t] >= 0 else [0.0] * len(v) for t, v in zip(row_trajectories, normalized)]
    placeholders = [[]] * (completion_mask.shape[0] - len(rows))
    spans = [[mem_spans[i]] if scored[i] else [] for i in rows] + placeholders
    memory = scatter_span_values(
        completion_mask.cpu(),
        [[start for start, _ in row] for row in spans],
        [[end for _, end in row] for row in spans],
        [normalized[i] for i in rows] + placeholders,
    ).to(completion_mask.device)
    index = torch.tensor([row_trajectories[i] for i in rows], dtype=torch.long, device=outcome.device)
    row_outcome = torch.cat([outcome[index], outcome.new_zeros(len(placeholders))]).to(completion_mask.device)
    advantages = combine_advantages(row_outcome, memory, completion_mask, settings.memory_coef)
    return MemPOAdvantages(advantages, outcome, memory)


def row_table(rows: Sequence, memory_rewards: torch.Tensor, first: int, num_rows: int) -> torch.Tensor:
    """What the memory pools need of each row, as one tensor that gathers over processes: ``(num_rows, 5)`` float64
    of trajectory (``first + row.episode_index``; -1 on the ``num_rows - len(rows)`` placeholder rows), round, memory
    reward (NaN: not scored) and the ``<mem>`` span's first and last token (-1: none).

    >>> from types import SimpleNamespace
    >>> row_table([SimpleNamespace(episode_index=1, round_index=2, mem_span=(3, 5))], torch.tensor([0.5]), 4, 2)
    tensor([[ 5.0000,  2.0000,  0.5000,  3.0000,  5.0000],
            [-1.0000,  0.0000,     nan, -1.0000, -1.0000]], dtype=torch.float64)
    """
    values = [
        [first + row.episode_index, row.round_index, reward, *(row.mem_span or (-1, -1))]
        for row, reward in zip(rows, memory_rewards.tolist())
    ]
    values += [[-1, 0, math.nan, -1, -1]] * (num_rows - len(rows))
    return torch.tensor(values, dtype=torch.float64).reshape(num_rows, 5)


def batch_advantages(
    rewards_per_func: torch.Tensor,
    reward_weights: torch.Tensor,
    rows: Sequence,
    memory_rewards: torch.Tensor,
    completion_mask: torch.Tensor,
    rank: int,
    episodes_per_process: int,
    gather: Callable[[torch.Tensor], torch.Tensor],
    num_generations: int,
    scale_rewards: str | bool = "group",
    aggregation: str = "sum_then_normalize",
    settings: MemoryRewardSettings = MemoryRewardSettings(),
) -> MemPOAdvantages:
    """`mempo_advantages` on the rounds of all processes, returned for the ``rows`` of process ``rank``.

    Args:
        rewards_per_func: ``(N, F)`` the reward functions' values for the trajectories of all processes (NaN: none),
            weighted by ``reward_weights`` ``(F,)`` and aggregated as ``aggregation`` says (TRL's
            ``multi_objective_aggregation``: ``"sum_then_normalize"`` or ``"normalize_then_sum"``); a trajectory of
            all-NaN rewards is unscorable, advantage 0.
        rows: this process's training rows (anything with ``episode_index``, ``round_index`` and ``mem_span``, e.g.
            the rollout's `TrainingRow`s). A trajectory's global index is ``rank * episodes_per_process + episode``
            (the order in which TRL's `_calculate_rewards` gathers ``rewards_per_func``), so memory pools span
            processes exactly like GRPO's groups.
        memory_rewards: ``(len(rows),)`` their memory rewards, NaN where the round is not scored.
        completion_mask: ``(B, T)`` of this process's rows and placeholder rows (B the same on every process).
        gather: the ``(B, 5)`` `row_table` of every process, concatenated in process order (`accelerator.gather`;
            one process: the table itself).

    >>> out = batch_advantages(torch.tensor([[1.0], [0.0]]), torch.ones(1), [], torch.tensor([]), torch.ones(1, 2),
    ...                        0, 2, lambda table: table, 2, "none")
    >>> out.outcome, out.advantages
    (tensor([ 0.5000, -0.5000]), tensor([[0., 0.]]))
    """
    rewards = (rewards_per_func * reward_weights.unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    outcome = None
    if aggregation == "normalize_then_sum":
        outcome = normalize_then_sum_advantages(rewards_per_func, reward_weights, num_generations)
    num_rows = completion_mask.shape[0]
    table = row_table(rows, memory_rewards, rank * episodes_per_process, num_rows).to(completion_mask.device)
    everything = gather(table).cpu()
    start = int((everything[: rank * num_rows, 0] >= 0).sum())
    everything = everything[everything[:, 0] >= 0].tolist()
    return mempo_advantages(
        rewards,
        row_trajectories=[int(row[0]) for row in everything],
        row_rounds=[int(row[1]) for row in everything],
        memory_rewards=[None if math.isnan(row[2]) else row[2] for row in everything],
        mem_spans=[None if row[3] < 0 else (int(row[3]), int(row[4])) for row in everything],
        completion_mask=completion_mask,
        local_rows=slice(start, start + len(rows)),
        num_generations=num_generations,
        scale_rewards=scale_rewards,
        settings=settings,
        outcome_advantages=outcome,
    )
