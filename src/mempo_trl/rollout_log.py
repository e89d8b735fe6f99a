"""Rollout logs while training (docs/viewer.md): every ``rollout_log_steps`` steps, the first ``rollout_log_episodes``
episodes of the main process, every round with its memory, action, result and credit, one JSON Lines file per step.

``output_dir/rollouts/step-000012.jsonl`` holds a header line (`ROLLOUT_LOG_FORMAT`, `ROLLOUT_LOG_VERSION`, the step,
the context mode, the episode count) and one line per episode: `mempo_trl.evaluation.episode_record` (what
``mempo-trl eval`` writes to ``trajectories.jsonl``) plus the step's training values: ``step``, ``reward`` (the
weighted outcome reward), ``rewards`` (per reward function), ``outcome_advantage``, ``dropped`` (by dynamic
sampling), and on each round ``p_full``, ``p_mem``, ``memory_reward``, ``memory_advantage`` (normalised, before
``memory_coef``), ``advantage`` (what the loss puts on the ``<mem>`` tokens) and ``mem_tokens``; None where the round
was not scored. A round's context is not stored: it is the question plus the earlier rounds `shown_rounds` picks,
whose outputs and results the record holds, and ``prompt_tokens`` is its length.

A step's file is written when the step ends, at once (a temporary file renamed over it): a run cut short leaves whole
files only, and a resumed run that plays step N again replaces step N's file whole. Where ``report_to`` names wandb
or trackio, the same rounds go there as a table, one row per round (`log_rollout_table`, as TRL logs its completions
table).
"""

import json
import math
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from transformers import TrainerCallback

from mempo_trl.evaluation import episode_record


ROLLOUT_LOG_FORMAT = "mempo-trl rollouts"
"""The ``format`` of a rollout log's header line."""
ROLLOUT_LOG_VERSION = 1
"""The ``version`` of the rollout log's layout; a reader refuses another one."""
ROLLOUTS_DIR = "rollouts"
"""The folder of ``output_dir`` that holds the step files."""
TEMPORARY_PREFIX = ".step-"
"""Files being written start with this; a reader skips them."""


def step_file(directory: str | os.PathLike, step: int) -> Path:
    """The log file of ``step`` in ``directory``.

    >>> step_file("out/rollouts", 12).name
    'step-000012.jsonl'
    """
    return Path(directory) / f"step-{step:06d}.jsonl"


def _number(value) -> float | None:
    """``value`` as a float for JSON, None for NaN (not scored)."""
    value = float(value)
    return None if math.isnan(value) else value


def round_values(row, scores, memory, advantages, index: int) -> dict:
    """The training values of one round (``row``, the ``index``-th `TrainingRow` of the batch): P_full, P_mem, the
    memory reward and advantage (NaN/absent: None) and the advantage on its ``<mem>`` tokens."""
    span = row.mem_span
    scored = not math.isnan(float(scores.reward[index]))
    return {
        "p_full": _number(scores.p_full[index]),
        "p_mem": _number(scores.p_mem[index]),
        "memory_reward": _number(scores.reward[index]),
        "memory_advantage": _number(memory[index, span[0]]) if scored else None,
        "advantage": _number(advantages[index, span[0]]) if span is not None else None,
        "mem_tokens": span[1] - span[0] + 1 if span is not None else 0,
    }


def episode_log_records(
    step: int, batch, scored, advantages, scores, reward_names: Sequence[str], limit: int
) -> list[dict]:
    """One log record per episode of the first ``limit`` episodes of the main process's ``batch`` (its episodes
    come first among all processes' trajectories): `episode_record` plus the step's values.

    ``batch`` is the step's `RoundBatch` (``episodes``, ``rows``), ``scored`` its `ScoredStep` (``rewards_per_func``
    ``(N, F)`` named ``reward_names``, ``rewards`` ``(N,)``, ``dropped``), ``advantages`` its `MemPOAdvantages`
    (``advantages`` and ``memory`` of shape (rows, tokens), ``outcome`` (N,)) and ``scores`` the rows'
    `MemoryScores`.
    """
    records = [episode_record(ep) for ep in batch.episodes[:limit]]
    for e, record in enumerate(records):
        record.update(
            step=step,
            reward=_number(scored.rewards[e]),
            rewards={name: _number(v) for name, v in zip(reward_names, scored.rewards_per_func[e].tolist())},
            outcome_advantage=_number(advantages.outcome[e]),
            dropped=scored.dropped is not None and bool(scored.dropped[e]),
        )
    for i, row in enumerate(batch.rows):
        if row.episode_index < len(records):
            values = round_values(row, scores, advantages.memory, advantages.advantages, i)
            records[row.episode_index]["rounds"][row.round_index].update(values)
    return records


TABLE_COLUMNS = (
    "question",
    "golden_answers",
    "answer",
    "em",
    "reward",
    "outcome_advantage",
)
"""The episode fields each row of the tracker table repeats (`table_rows`)."""
ROUND_COLUMNS = (
    "prompt_tokens",
    "mem",
    "action",
    "content",
    "information",
    "p_full",
    "p_mem",
    "memory_reward",
    "memory_advantage",
    "advantage",
)
"""The round fields of each row of the tracker table."""


def table_rows(records: Sequence[dict]) -> list[dict]:
    """One row per round of the log ``records``: step, episode and round (1-based), `TABLE_COLUMNS` and
    `ROUND_COLUMNS` (lists as text, so that every tracker takes them).

    >>> table_rows([{"step": 2, "question": "q", "rounds": [{"mem": "m", "p_mem": 0.5}]}])[0]["round"]
    1
    """
    rows = []
    for e, record in enumerate(records):
        for t, round_record in enumerate(record.get("rounds", []), start=1):
            row = {"step": record.get("step"), "episode": e, "round": t}
            row.update({name: record.get(name) for name in TABLE_COLUMNS})
            row.update({name: round_record.get(name) for name in ROUND_COLUMNS})
            rows.append({k: json.dumps(v) if isinstance(v, list | dict) else v for k, v in row.items()})
    return rows


def log_rollout_table(report_to: Sequence[str] | None, records: Sequence[dict]) -> None:
    """Log the rounds of ``records`` as the table ``rollouts`` to the trackers of ``report_to`` that take tables
    (wandb with a run, trackio), as `GRPOTrainer.log` logs its completions table; nothing for the others."""
    report_to = report_to or []
    backends = []
    if "wandb" in report_to:
        import wandb

        if wandb.run is not None:
            backends.append(wandb)
    if "trackio" in report_to:
        import trackio

        backends.append(trackio)
    if not backends or not records:
        return
    import pandas as pd

    frame = pd.DataFrame(table_rows(records))
    for backend in backends:
        backend.log({"rollouts": backend.Table(dataframe=frame)})


def write_step_log(directory: str | os.PathLike, step: int, header: dict, records: Sequence[dict]) -> Path:
    """Write the log file of ``step`` at once: a temporary file in ``directory``, synced, renamed over the step's
    file (`step_file`), which a reader therefore sees whole or not at all. Returns its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    head = {"format": ROLLOUT_LOG_FORMAT, "version": ROLLOUT_LOG_VERSION, "step": step, **header}
    head.update(episodes=len(records), written=datetime.now(UTC).isoformat(timespec="seconds"))
    temporary = directory / f"{TEMPORARY_PREFIX}{uuid.uuid4().hex}.tmp"
    with temporary.open("w", encoding="utf-8") as f:
        for line in (head, *records):
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    path = step_file(directory, step)
    os.replace(temporary, path)
    return path


@dataclass
class RolloutLog(TrainerCallback):
    """The rollout log of a run, held by `MemPOTrainer` (as ``trainer.rollout_log``) and called back by it.

    The trainer hands it each training step's values (`record`, main process only); it keeps the records of the
    steps to log (every ``every`` steps: steps ``every``, ``2 * every``, ...; at most ``episodes`` per step) and
    writes each step's file when that step ends (`on_step_end`, `write_step_log`), then logs its table
    (`log_rollout_table`). ``header`` is what every file's header line adds (context mode, group size, ...).
    """

    directory: Path
    every: int
    episodes: int
    header: dict = field(default_factory=dict)
    report_to: Sequence[str] = ()
    pending: dict[int, list[dict]] = field(default_factory=dict)

    def wants(self, step: int) -> bool:
        """Whether ``step`` (1-based, the optimizer step being played) is logged."""
        return self.every > 0 and step % self.every == 0

    def record(self, step: int, batch, scored, advantages, scores, reward_names: Sequence[str]) -> None:
        """Keep the episodes of a training batch of ``step`` (`episode_log_records`), when that step is logged and
        fewer than ``episodes`` are kept for it (a step may generate more than one batch)."""
        if not self.wants(step):
            return
        kept = self.pending.setdefault(step, [])
        left = self.episodes - len(kept)
        if left > 0:
            kept += episode_log_records(step, batch, scored, advantages, scores, reward_names, left)

    def on_train_begin(self, args, state, control, **kwargs):
        """Remove the temporary files a run cut short while writing left behind."""
        if state.is_world_process_zero and self.directory.is_dir():
            for path in self.directory.glob(f"{TEMPORARY_PREFIX}*.tmp"):
                path.unlink(missing_ok=True)

    def on_step_end(self, args, state, control, **kwargs):
        """Write the kept records of every step up to this one."""
        for step in sorted(s for s in self.pending if s <= state.global_step):
            records = self.pending.pop(step)
            write_step_log(self.directory, step, self.header, records)
            log_rollout_table(self.report_to, records)
