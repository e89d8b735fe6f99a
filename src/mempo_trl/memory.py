"""Memory reward and memory advantage (docs/algorithm.md, "Memory reward: P_full and P_mem", "Memory advantage:
pooling and spans").

``P = exp(mean kept log p(answer token))`` under the full history and under the ``<mem>`` block only;
``mem_reward = P_mem - P_full``; rewards are normalised per question (optionally per question and round) and written
on the ``<mem>…</mem>`` tokens of their round.
"""

import math
from collections import defaultdict
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch

from mempo_trl.memory_rewards import MEMORY_REWARDS, PART_REWARDS


def answer_probability(
    logps: torch.Tensor, mask: torch.Tensor, threshold: float | None = math.log(0.5)
) -> torch.Tensor:
    """Geometric-mean probability of the kept answer tokens, ``(N, K) -> (N,)``.

    Kept = ``mask & (logps > threshold)`` (just ``mask`` when ``threshold`` is ``None``). A row with no kept token
    gets P = 0, not the 1 that ``count + 1e-8`` would give. Values at masked-out positions are never read.

    >>> answer_probability(torch.tensor([[-0.1, -0.3, -2.0], [-2.0, -3.0, 0.0]]), torch.tensor([[1, 1, 1], [1, 1, 0]]))
    tensor([0.8187, 0.0000])
    """
    if logps.shape != mask.shape:
        raise ValueError(f"logps {tuple(logps.shape)} and mask {tuple(mask.shape)} must have the same shape")
    keep = mask.bool()
    if threshold is not None:
        keep = keep & (logps > threshold)
    count = keep.sum(dim=-1)
    total = torch.where(keep, logps, torch.zeros_like(logps)).sum(dim=-1)
    mean = total / count.clamp(min=1).to(total.dtype)
    return torch.where(count > 0, mean.exp(), torch.zeros_like(mean))


def quantile_threshold(logps: torch.Tensor, mask: torch.Tensor, q: float) -> float:
    """The ``q``-quantile (linear interpolation, like ``numpy.quantile``) of the masked log-probs of the batch.

    For the adaptive confidence filter (docs/algorithm.md, "Variants"): pass the result as ``threshold`` to :func:`answer_probability`.
    An empty mask returns ``-inf`` (no filter; nothing is scored anyway). ``-inf`` log-probs sort first.

    >>> quantile_threshold(torch.tensor([[-0.1, -0.5], [-1.0, -9.0]]), torch.tensor([[1, 1], [1, 0]]), 0.5)
    -0.5
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    if logps.shape != mask.shape:
        raise ValueError(f"logps {tuple(logps.shape)} and mask {tuple(mask.shape)} must have the same shape")
    values = torch.sort(logps[mask.bool()].double()).values.tolist()
    if not values:
        return float("-inf")
    pos = q * (len(values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(values) - 1)
    low, high = values[lo], values[hi]
    if pos == lo or low == high or math.isinf(low):
        return low
    return low + (pos - lo) * (high - low)


def memory_reward(
    p_mem: torch.Tensor,
    p_full: torch.Tensor,
    mode: str = "diff",
    eps: float = 1e-6,
    mem_lengths: torch.Tensor | Sequence[int] | None = None,
    length_penalty: float = 0.0,
    max_mem_tokens: int | None = None,
) -> torch.Tensor:
    """Memory reward per round, ``(N,), (N,) -> (N,)``: the variant ``mode`` names (`MEMORY_REWARDS`).

    With ``length_penalty > 0`` subtracts ``length_penalty * mem_lengths / max_mem_tokens``.

    >>> memory_reward(torch.tensor([0.12, 0.71]), torch.tensor([0.35, 0.68]))
    tensor([-0.2300,  0.0300])
    """
    if p_mem.shape != p_full.shape:
        raise ValueError(f"p_mem {tuple(p_mem.shape)} and p_full {tuple(p_full.shape)} must have the same shape")
    reward = MEMORY_REWARDS.resolve(mode)(p_mem, p_full, eps)
    return reward - memory_length_penalty(reward, mem_lengths, length_penalty, max_mem_tokens)


def memory_length_penalty(
    reward: torch.Tensor,
    mem_lengths: torch.Tensor | Sequence[int] | None,
    length_penalty: float,
    max_mem_tokens: int | None,
) -> torch.Tensor:
    """``length_penalty * mem_lengths / max_mem_tokens`` in the shape, dtype and device of ``reward`` (zeros when the
    penalty is 0).

    >>> memory_length_penalty(torch.zeros(2), [20, 200], 0.1, 100)
    tensor([0.0200, 0.2000])
    """
    if length_penalty < 0:
        raise ValueError(f"length_penalty must be >= 0, got {length_penalty}")
    if length_penalty == 0:
        return torch.zeros_like(reward)
    if mem_lengths is None or max_mem_tokens is None or max_mem_tokens <= 0:
        raise ValueError("length_penalty > 0 needs mem_lengths and a positive max_mem_tokens")
    lengths = torch.as_tensor(mem_lengths, dtype=reward.dtype, device=reward.device)
    if lengths.shape != reward.shape:
        raise ValueError(f"mem_lengths {tuple(lengths.shape)} must have the shape of p_mem {tuple(reward.shape)}")
    return length_penalty * lengths / max_mem_tokens


class MemoryScores(NamedTuple):
    """P_full, P_mem and the memory reward of each row of a batch, shape (rows,); NaN where not scored."""

    p_full: torch.Tensor
    p_mem: torch.Tensor
    reward: torch.Tensor

    @classmethod
    def unscored(cls, num_rows: int) -> "MemoryScores":
        """Scores of ``num_rows`` rows none of which is scored."""
        return cls(*(torch.full((num_rows,), math.nan) for _ in cls._fields))


def part_rewards(
    full: tuple[torch.Tensor, torch.Tensor],
    mem: tuple[torch.Tensor, torch.Tensor],
    parts: torch.Tensor,
    mode: str = "diff",
    eps: float = 1e-6,
    threshold: float | None = math.log(0.5),
) -> torch.Tensor:
    """The memory reward of each answer part on its own tokens, ``(N, K) x 2, (N, K) -> (N, P)``.

    ``full`` and ``mem`` are the answer-token log-probs and masks under the full history and the memory; ``parts``
    the part of each answer token (1, 2, ..., P; 0: in none, `mempo_trl.context.gold_answer_parts`). Column ``p - 1``
    is part ``p``'s `memory_reward` from the `answer_probability` of its tokens; NaN where a row has no token of it.

    >>> full = (torch.log(torch.tensor([[0.9, 0.9, 0.5]])), torch.tensor([[1, 1, 1]]))
    >>> mem = (torch.log(torch.tensor([[0.95, 0.95, 0.1]])), torch.tensor([[1, 1, 1]]))
    >>> part_rewards(full, mem, torch.tensor([[1, 1, 2]]), threshold=None)  # 0.95 - 0.9, 0.1 - 0.5
    tensor([[ 0.0500, -0.4000]])
    """
    parts = parts.to(full[0].device)
    columns = []
    for part in range(1, int(parts.max()) + 1 if parts.numel() else 1):
        where = parts == part
        p_full = answer_probability(full[0], full[1].bool() & where, threshold)
        p_mem = answer_probability(mem[0], mem[1].bool() & where, threshold)
        reward = memory_reward(p_mem, p_full, mode, eps)
        columns.append(torch.where(where.any(dim=-1), reward, torch.full_like(reward, math.nan)))
    return torch.stack(columns, dim=-1) if columns else torch.empty(parts.shape[0], 0, device=parts.device)


def weakest_part_reward(
    full: tuple[torch.Tensor, torch.Tensor],
    mem: tuple[torch.Tensor, torch.Tensor],
    parts: torch.Tensor,
    mode: str = "diff",
    eps: float = 1e-6,
    threshold: float | None = math.log(0.5),
) -> torch.Tensor:
    """The memory reward of each row's weakest answer part, ``(N, K) x 2, (N, K) -> (N,)``: the lowest of its
    `part_rewards`. A row with one part, or with no token in a part, gets the joint reward.

    >>> full = (torch.log(torch.tensor([[0.9, 0.9, 0.5]])), torch.tensor([[1, 1, 1]]))
    >>> mem = (torch.log(torch.tensor([[0.95, 0.95, 0.1]])), torch.tensor([[1, 1, 1]]))
    >>> weakest_part_reward(full, mem, torch.tensor([[1, 1, 2]]), threshold=None)  # part 2: 0.1 - 0.5
    tensor([-0.4000])
    """
    joint = memory_reward(answer_probability(*mem, threshold), answer_probability(*full, threshold), mode, eps)
    per_part = part_rewards(full, mem, parts, mode, eps, threshold)
    weakest = (
        per_part.nan_to_num(math.inf).min(dim=-1).values if per_part.shape[-1] else torch.full_like(joint, math.inf)
    )
    return torch.where(torch.isinf(weakest), joint, weakest)


def losses_reward(
    full: tuple[torch.Tensor, torch.Tensor],
    mem: tuple[torch.Tensor, torch.Tensor],
    parts: torch.Tensor,
    mode: str = "diff",
    eps: float = 1e-6,
    threshold: float | None = math.log(0.5),
) -> torch.Tensor:
    """The memory reward that never pays for a lost part, ``(N, K) x 2, (N, K) -> (N,)``: where any of a row's
    `part_rewards` is below 0, the mean of ``min(part reward, 0)`` over its parts (a memory that lost two parts
    scores lower than one that lost one, and a gain on one part hides no loss on another); else the joint reward.

    >>> full = (torch.log(torch.tensor([[0.9, 0.9, 0.5], [0.5, 0.5, 0.5]])), torch.ones(2, 3))
    >>> mem = (torch.log(torch.tensor([[0.95, 0.95, 0.1], [0.6, 0.7, 0.8]])), torch.ones(2, 3))
    >>> losses_reward(full, mem, torch.tensor([[1, 1, 2], [1, 1, 2]]), threshold=None)  # (0 - 0.4) / 2; 0.6952 - 0.5
    tensor([-0.2000,  0.1952])
    """
    joint = memory_reward(answer_probability(*mem, threshold), answer_probability(*full, threshold), mode, eps)
    per_part = part_rewards(full, mem, parts, mode, eps, threshold)
    present = ~per_part.isnan()
    losses = per_part.nan_to_num(0.0).clamp(max=0.0)
    lost = (losses < 0).any(dim=-1)
    mean_loss = losses.sum(dim=-1) / present.sum(dim=-1).clamp(min=1)
    return torch.where(lost, mean_loss.to(joint.dtype), joint)


def joint_reward(
    full: tuple[torch.Tensor, torch.Tensor],
    mem: tuple[torch.Tensor, torch.Tensor],
    parts: torch.Tensor | None = None,
    mode: str = "diff",
    eps: float = 1e-6,
    threshold: float | None = math.log(0.5),
) -> torch.Tensor:
    """The memory reward of one P over all gold tokens (the paper's), ``(N, K) x 2 -> (N,)``; ``parts`` is unused.

    >>> full = (torch.log(torch.tensor([[0.9, 0.5]])), torch.tensor([[1, 1]]))
    >>> mem = (torch.log(torch.tensor([[0.9, 0.1]])), torch.tensor([[1, 1]]))
    >>> joint_reward(full, mem, threshold=None)  # geometric means: sqrt(0.9 * 0.1) - sqrt(0.9 * 0.5)
    tensor([-0.3708])
    """
    return memory_reward(answer_probability(*mem, threshold), answer_probability(*full, threshold), mode, eps)


def memory_scores(
    num_rows: int,
    scored: Sequence[int],
    full: tuple[torch.Tensor, torch.Tensor],
    mem: tuple[torch.Tensor, torch.Tensor],
    mem_lengths: Sequence[int],
    settings,
    threshold: float | None,
    max_mem_tokens: int,
    parts: torch.Tensor | None = None,
) -> MemoryScores:
    """The `MemoryScores` of ``num_rows`` rows from the answer-token log-probs and masks of the ``scored`` rows, each
    ``(len(scored), K)``, under the full history (``full``) and the memory (``mem``); ``settings`` is a
    `MemoryRewardSettings` (the variant, its eps, the answer parts, the length penalty), ``threshold`` the one
    `answer_probability` applies, ``parts`` ``(len(scored), K)`` the part of each answer token (for
    ``memory_reward_parts``: `PART_REWARDS`). P_full and P_mem are always over all gold
    tokens."""
    scores = MemoryScores.unscored(num_rows)
    if not scored:
        return scores
    p_full = answer_probability(*full, threshold).cpu()
    p_mem = answer_probability(*mem, threshold).cpu()
    mode, eps = settings.memory_reward_type, settings.memory_reward_eps
    if parts is None:
        rewards = memory_reward(p_mem, p_full, mode, eps)
    else:
        rewards = PART_REWARDS.resolve(settings.memory_reward_parts)(full, mem, parts, mode, eps, threshold).cpu()
    lengths = [float(length) for length in mem_lengths]
    rewards = rewards - memory_length_penalty(rewards, lengths, settings.memory_length_penalty, max_mem_tokens)
    index = torch.tensor(list(scored))
    for column, values in zip(scores, (p_full, p_mem, rewards)):
        column[index] = values.float()
    return scores


def _pool_stats(values: list[float]) -> tuple[float, float]:
    """Mean and unbiased std of a pool; ``(0, 1)`` for fewer than two values, exactly ``(v, 0)`` for equal values."""
    if len(values) < 2:
        return 0.0, 1.0
    if min(values) == max(values):
        return values[0], 0.0
    mean = math.fsum(values) / len(values)
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))


def normalize_memory_rewards(
    group_ids: Sequence[Hashable],
    rewards: Sequence[Sequence[float]],
    round_ids: Sequence[Sequence[Hashable]] | None = None,
    scale: str = "group",
    center: bool = True,
) -> list[list[float]]:
    """Normalise memory rewards within their pool, keeping the nested per-row structure.

    Pool = all rewards of the rows with the same group id (the G trajectories of a question, all rounds), or per
    ``(group, round)`` when ``round_ids`` (aligned with ``rewards``) is given. Each reward minus its pool's mean, divided
    by ``std + 1e-6`` (unbiased std; ``r - mean`` where that std is 0): the pool's std with ``scale="group"`` (paper),
    the std of all the rewards given with ``"batch"``, no division with ``"none"`` (TRL's ``scale_rewards`` values). A
    pool of 0 or 1 values uses mean 0 (and std 1 under ``"group"``). ``center=False`` takes no mean off (the std is
    still the pool's, the batch's or none): each value keeps its sign, a reward below 0 stays a negative advantage
    whatever its pool. Pure function: call it on the rewards of all ranks, then slice.

    >>> normalize_memory_rewards(["q1", "q2", "q1"], [[1.0], [5.0], [3.0, 2.0]])
    [[-0.99999...], [4.99999...], [0.99999..., 0.0]]
    >>> normalize_memory_rewards(["q1", "q1", "q2", "q2"], [[0.1], [0.3], [0.0], [0.0]], scale="batch")
    [[-0.7071...], [0.7071...], [0.0], [0.0]]
    >>> normalize_memory_rewards(["q1", "q1"], [[-0.1], [-0.3]], scale="none", center=False)
    [[-0.1], [-0.3]]
    """
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    if len(group_ids) != len(rewards):
        raise ValueError(f"{len(group_ids)} group ids for {len(rewards)} reward rows")
    if round_ids is not None and (
        len(round_ids) != len(rewards) or any(len(r) != len(v) for r, v in zip(round_ids, rewards))
    ):
        raise ValueError("round_ids must have the nested shape of rewards")
    keys = [
        [(gid,) if round_ids is None else (gid, round_ids[i][j]) for j in range(len(row))]
        for i, (gid, row) in enumerate(zip(group_ids, rewards))
    ]
    pools: dict[tuple, list[float]] = defaultdict(list)
    for row_keys, row in zip(keys, rewards):
        for key, value in zip(row_keys, row):
            pools[key].append(float(value))
    stats = {key: _pool_stats(values) for key, values in pools.items()}
    if not center:
        stats = {key: (0.0, std) for key, (_, std) in stats.items()}
    if scale != "group":
        batch_std = _pool_stats([float(v) for row in rewards for v in row])[1] if scale == "batch" else 0.0
        stats = {key: (mean, batch_std) for key, (mean, _) in stats.items()}
    out = []
    for row_keys, row in zip(keys, rewards):
        normed = []
        for key, value in zip(row_keys, row):
            mean, std = stats[key]
            normed.append((float(value) - mean) / (std + 1e-6) if std > 0 else float(value) - mean)
        out.append(normed)
    return out


def scatter_span_values(
    completion_mask: torch.Tensor,
    span_starts: Sequence[Sequence[int]],
    span_ends: Sequence[Sequence[int]],
    values: Sequence[Sequence[float]],
) -> torch.Tensor:
    """Write each value on its inclusive ``[start, end]`` token span, ``(B, T) -> (B, T)`` float32.

    Spans are clipped to ``[0, T)``, the result is multiplied by ``completion_mask``; other positions are 0.

    >>> scatter_span_values(torch.ones(2, 4), [[1], []], [[2], []], [[0.5], []])
    tensor([[0.0000, 0.5000, 0.5000, 0.0000],
            [0.0000, 0.0000, 0.0000, 0.0000]])
    """
    batch, length = completion_mask.shape
    if not len(span_starts) == len(span_ends) == len(values) == batch:
        raise ValueError(f"span_starts, span_ends and values need {batch} rows")
    out = torch.zeros(batch, length, dtype=torch.float32, device=completion_mask.device)
    for i, (starts, ends, row) in enumerate(zip(span_starts, span_ends, values)):
        if not len(starts) == len(ends) == len(row):
            raise ValueError(f"row {i}: {len(starts)} starts, {len(ends)} ends and {len(row)} values")
        for start, end, value in zip(starts, ends, row):
            lo, hi = max(int(start), 0), min(int(end), length - 1)
            if lo <= hi:
                out[i, lo : hi + 1] = float(value)
    return out * completion_mask.to(out.dtype)
