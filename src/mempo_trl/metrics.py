"""The metrics MemPO adds to TRL's (docs/training.md, "Metrics"): per episode, per round, of the memory reward."""

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


ROUND_METRICS = (
    "episode/em",
    "episode/f1",
    "episode/sub_em",
    "episode/format_valid",
    "episode/answer_rate",
    "episode/turns",
    "episode/actions",
    "episode/truncated_turns",
    "episode/context_overflow",
    "tokens/prompt_per_round",
    "tokens/mem_length",
    "memory/p_full",
    "memory/p_mem",
    "memory/reward",
    "memory/advantage",
    "memory/scored_rounds",
)
"""The metrics `MemPOTrainer` adds to TRL's, averaged over processes (and ``memory/{reward,advantage}/round_<t>``);
``episode/actions`` stands for the task's count of actions run (`Task.action_metric`: ``episode/searches``,
``episode/tool_calls``)."""


def round_metric_values(
    rows: Sequence, stats: Sequence[dict[str, float]], scores, memory_advantages, max_turns: int, action_metric: str
):
    """This process's values of every MemPO metric, by name (every name of `ROUND_METRICS`, ``episode/actions`` named
    ``episode/<action_metric>``, and the per-round memory ones up to ``max_turns``, empty lists included, so that all
    processes gather the same names).

    ``rows`` are the step's `TrainingRow`s, ``stats`` each episode's `episode_metrics`, ``scores`` the rows'
    `MemoryScores` and ``memory_advantages`` the (rows, completion tokens) memory advantages.
    """
    values: dict[str, list[float]] = defaultdict(list)
    for episode_stats in stats:
        for name, value in episode_stats.items():
            values[f"episode/{name}"].append(value)
    columns = {name: column.tolist() for name, column in scores._asdict().items()}
    for i, row in enumerate(rows):
        values["episode/truncated_turns"].append(float(row.truncated))
        values["tokens/prompt_per_round"].append(float(len(row.prompt_ids)))
        if row.mem_span is not None:
            values["tokens/mem_length"].append(float(row.mem_span[1] - row.mem_span[0] + 1))
        if not math.isnan(columns["reward"][i]):
            advantage = float(memory_advantages[i, row.mem_span[0]].item())
            for name, column in columns.items():
                values[f"memory/{name}"].append(column[i])
            values["memory/advantage"].append(advantage)
            values[f"memory/reward/round_{row.round_index + 1}"].append(columns["reward"][i])
            values[f"memory/advantage/round_{row.round_index + 1}"].append(advantage)
    values["memory/scored_rounds"].append(float(sum(not math.isnan(r) for r in columns["reward"])))
    names = [name.replace("/actions", f"/{action_metric}") for name in ROUND_METRICS]
    for t in range(2, max_turns + 1):
        names += [f"memory/reward/round_{t}", f"memory/advantage/round_{t}"]
    return {name: values[name] for name in names}


def mean_metrics(
    values: dict[str, list[float]], gather_sum: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, float]:
    """The mean over all processes of each metric of ``values`` (this process's, by name) that has a value on any,
    and of the ``memory/reward*`` and ``memory/advantage*`` ones their std as ``<name>_std``; ``gather_sum`` sums a
    tensor over processes.

    Example:
        >>> mean_metrics({"memory/reward": [1.0, 3.0], "episode/em": []}, lambda t: t)
        {'memory/reward': 2.0, 'memory/reward_std': 1.0}
    """
    local = torch.tensor([[sum(v), len(v), sum(x * x for x in v)] for v in values.values()], dtype=torch.float32)
    means = {}
    for name, (total, count, total_sq) in zip(values, gather_sum(local).tolist()):
        if count:
            means[name] = mean = total / count
            if name.startswith(("memory/reward", "memory/advantage")):
                means[f"{name}_std"] = math.sqrt(max(total_sq / count - mean * mean, 0.0))
    return means


def final_metrics(history: Sequence[dict]) -> dict[str, float]:
    """The numeric metrics of the last logged training step, plus those of the last evaluation (`eval_*`).

    Each comes whole from one log entry: a metric missing at that step (no memory round was scored, say) is
    missing here, never filled in from an earlier step. `step` is the step they were logged at.
    """
    evals = [e for e in history if any(k.startswith("eval_") for k in e)]
    steps = [e for e in history if "train_runtime" not in e and not any(k.startswith("eval_") for k in e)]
    last = {
        **(steps[-1] if steps else {}),
        **{k: v for k, v in (evals[-1:] or [{}])[0].items() if k.startswith("eval_")},
    }
    return {k: v for k, v in last.items() if isinstance(v, int | float) and not isinstance(v, bool)}


@dataclass
class StepAccount:
    """What one process did in the current optimizer step so far: the prompt and completion tokens of the rows it
    generated (what ``num_tokens`` counts over all processes), and its seconds of generation, retrieval and memory
    scoring."""

    tokens: int = 0
    generation: float = 0.0
    retrieval: float = 0.0
    memory_scoring: float = 0.0

    def add(self, rows: Sequence, timings, memory_scoring: float) -> None:
        """Count a batch's ``rows`` (with ``prompt_ids`` and ``completion_ids``), its rollout's ``timings``
        (``generation``, ``retrieval``) and its seconds of memory scoring."""
        self.tokens += sum(len(row.prompt_ids) + len(row.completion_ids) for row in rows)
        self.generation += timings.generation
        self.retrieval += timings.retrieval
        self.memory_scoring += memory_scoring

    def metrics(self, step_time: float) -> dict[str, float]:
        """``tokens_per_second`` (the tokens over ``step_time``, TRL's) and ``time/other`` (``step_time`` less the
        generation, retrieval and memory scoring).

        >>> StepAccount(100, 1.0, 0.5, 0.25).metrics(2.0)
        {'tokens_per_second': 50.0, 'time/other': 0.25}
        """
        parts = self.generation + self.retrieval + self.memory_scoring
        return {
            "tokens_per_second": self.tokens / step_time if step_time > 0 else 0.0,
            "time/other": step_time - parts,
        }
