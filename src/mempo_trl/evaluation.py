"""Evaluation harness: play a model as a MemPO agent over QA rows and report answers, format and token cost.

`evaluate` plays a `MemPOAgent` over QA rows in one context mode (through `mempo_trl.rollout.RolloutEngine`, the
context builder of training) and returns an `EvalResult`: one record per question (the trajectory, its scores and
its token counts) and the metrics, overall and per ``data_source``. ``context_mode="full_history"`` is the Search-R1 style baseline whose
context grows every round; `compare_modes` sets the two side by side on the same questions.

Token accounting is exact: a round's prompt tokens are the ids the model was given, its completion tokens the ids
it produced (cut after the action); per question, the peak context is the largest prompt + completion of any round
and the total is the sum of prompt + completion over the rounds.

`evaluate_model` plays a model directly (greedy by default), and `heldout_metrics` sums its records up with a
pluggable per-row metric (default `exact_match_f1`): what `mempo_trl.callbacks.HeldOutEvalCallback` reports
before and after training. `mempo-trl eval` (`mempo_trl.commands.eval`) runs `evaluate` from the command line.
"""

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mempo_trl.agent import AgentResult, MemPOAgent
from mempo_trl.context import ContextMode
from mempo_trl.environments import has_own_reward
from mempo_trl.protocol import TurnProtocol
from mempo_trl.rewards import episode_metrics, part_scores
from mempo_trl.rollout import Episode, GenerateFn


@dataclass
class EvalResult:
    """The outcome of `evaluate` for one context mode.

    ``records`` holds one JSON-ready dict per question (see `episode_record`); ``metrics`` has ``"overall"`` and
    ``"by_data_source"`` (see `summarize`); ``episodes`` are the rollout's own objects.
    """

    context_mode: str
    records: list[dict]
    metrics: dict[str, Any]
    episodes: list[Episode] = field(repr=False)
    generation_s: float = 0.0
    retrieval_s: float = 0.0


def episode_record(episode: Episode) -> dict:
    """Scores, token counts and rounds of one finished episode, as a JSON-ready dict.

    With an environment, ``question`` is its task, ``golden_answers`` its gold (``em``/``f1``/``sub_em`` are None
    without one), ``reward`` its ``get_reward()`` (when it has one) and ``num_searches`` counts its tool calls.

    Example:
        >>> record = episode_record(episodes[0])  # doctest: +SKIP
        >>> record["total_tokens"] == sum(r["prompt_tokens"] + r["completion_tokens"] for r in record["rounds"])  # doctest: +SKIP
        True
    """
    row = episode.row
    result = AgentResult.from_episode(episode)
    metrics = episode_metrics(episode)
    rounds = [
        {
            "prompt_tokens": len(r.prompt_ids),
            "completion_tokens": len(r.completion_ids),
            "completion": r.text,
            "valid": r.turn.valid,
            "reason": r.turn.reason,
            "mem": r.turn.mem,
            "action": r.turn.action,
            "content": r.turn.content,
            "information": episode.shown_information(t),
            "truncated": r.truncated,
        }
        for t, r in enumerate(episode.rounds)
    ]
    environment = episode.environment
    reward = {"reward": float(environment.get_reward())} if has_own_reward(environment) else {}
    golds = episode.golden_answers
    parts = None if golds is None else part_scores(episode.answer, golds, row.get("sub_answers"), episode.format_valid)
    return {
        "id": row.get("id"),
        "data_source": row.get("data_source", "unknown"),
        "question": episode.question,
        "golden_answers": list(episode.golden_answers or []),
        "sub_answers": list(row.get("sub_answers") or []),
        "answer": episode.answer,
        "em": metrics.get("em"),
        "f1": metrics.get("f1"),
        "sub_em": metrics.get("sub_em"),
        "em_all_parts": None if parts is None else min(em for em, _, _ in parts),
        "f1_all_parts": None if parts is None else min(f1 for _, f1, _ in parts),
        **reward,
        "format_valid": episode.format_valid,
        "turns_valid": all(r.turn.valid for r in episode.rounds),
        "context_overflow": episode.context_overflow,
        "num_turns": result.num_turns,
        "num_searches": result.num_searches,
        "peak_context_tokens": result.peak_context_tokens,
        "total_tokens": result.total_tokens,
        "rounds": rounds,
    }


def _mean(values: Sequence[float | None]) -> float:
    """Mean of the values that are not None; NaN when none is."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else math.nan


def _summary(records: Sequence[dict]) -> dict[str, Any]:
    max_rounds = max((r["num_turns"] for r in records), default=0)
    per_round = [[r["rounds"][k]["prompt_tokens"] for r in records if r["num_turns"] > k] for k in range(max_rounds)]
    reward = {"reward": _mean([r["reward"] for r in records])} if any("reward" in r for r in records) else {}
    return {
        **reward,
        "num_questions": len(records),
        "em": _mean([r["em"] for r in records]),
        "f1": _mean([r["f1"] for r in records]),
        "sub_em": _mean([r["sub_em"] for r in records]),
        "em_all_parts": _mean([r["em_all_parts"] for r in records]),
        "f1_all_parts": _mean([r["f1_all_parts"] for r in records]),
        "format_valid": _mean([float(r["format_valid"]) for r in records]),
        "turns_valid": _mean([float(r["turns_valid"]) for r in records]),
        "context_overflow": _mean([float(r["context_overflow"]) for r in records]),
        "turns_per_question": _mean([r["num_turns"] for r in records]),
        "searches_per_question": _mean([r["num_searches"] for r in records]),
        "prompt_tokens_per_round": [_mean(tokens) for tokens in per_round],
        "questions_per_round": [len(tokens) for tokens in per_round],
        "mean_prompt_tokens": _mean([t for tokens in per_round for t in tokens]),
        "completion_tokens_per_question": _mean([sum(x["completion_tokens"] for x in r["rounds"]) for r in records]),
        "peak_context_tokens": _mean([r["peak_context_tokens"] for r in records]),
        "max_peak_context_tokens": max((r["peak_context_tokens"] for r in records), default=0),
        "total_tokens_per_question": _mean([r["total_tokens"] for r in records]),
        "total_tokens": sum(r["total_tokens"] for r in records),
    }


def summarize(records: Sequence[dict]) -> dict[str, Any]:
    """Metrics of `episode_record` dicts, overall and per ``data_source``.

    Scores, rates and per-question counts are means over questions; on multi-objective rows ``em``/``f1`` give each
    part its share and ``em_all_parts``/``f1_all_parts`` take a question's worst part (EM 1 only when every part is
    right). ``prompt_tokens_per_round[k]`` is the mean prompt length of round k+1 over the questions that reached it
    (``questions_per_round[k]`` of them).
    ``format_valid`` counts episodes whose every round is a valid turn and that end on an answer;
    ``turns_valid`` only asks the former (an episode cut by ``max_turns`` can be turn-valid).
    ``context_overflow`` is the share of episodes ended because a context exceeded the limit (`RolloutEngine`).
    Searches are those the retriever answered (a search in the last allowed round is not run).

    Example:
        >>> summarize(records)["overall"]["em"]  # doctest: +SKIP
        0.42
    """
    sources = sorted({r["data_source"] for r in records})
    return {
        "overall": _summary(records),
        "by_data_source": {s: _summary([r for r in records if r["data_source"] == s]) for s in sources},
    }


class _Progress:
    """Wraps a `GenerateFn`: a bar of finished questions, with the round, the active count and, for a generator
    that reports its batches (`HFGenerator.on_batch`, and within a batch ``on_turns``), how many of the round's turns
    are written so far."""

    def __init__(self, generate: GenerateFn, total: int, max_turns: int, desc: str, enabled: bool):
        from tqdm.auto import tqdm

        self.generate = generate
        self.max_turns = max_turns
        self.round = 0
        self.active = self.written = self.in_batch = 0
        self.shown = ""
        self.bar = tqdm(total=total, desc=desc, unit="q", disable=not enabled, file=sys.stderr)
        self.takes_messages = getattr(generate, "takes_messages", False)
        self.reports_batches = enabled and hasattr(generate, "on_batch")
        if self.reports_batches:
            self.previous_on_batch = generate.on_batch
            generate.on_batch = self._batch_done
        self.reports_turns = enabled and hasattr(generate, "on_turns")
        if self.reports_turns:
            self.previous_on_turns = generate.on_turns
            generate.on_turns = self._turns_written

    def _postfix(self) -> None:
        text = f"round {self.round}/{self.max_turns}, {self.written + self.in_batch}/{self.active} turns written"
        if text != self.shown:
            self.shown = text
            self.bar.set_postfix_str(text)

    def _batch_done(self, size: int) -> None:
        self.written, self.in_batch = self.written + size, 0
        self._postfix()

    def _turns_written(self, count: int) -> None:
        if count != self.in_batch:
            self.in_batch = count
            self._postfix()

    def __call__(self, prompts: list[list[int]], **kwargs):
        self.round += 1
        self.active, self.written = len(prompts), 0
        self.bar.update(self.bar.total - len(prompts) - self.bar.n)
        self._postfix()
        return self.generate(prompts, **kwargs)

    def close(self) -> None:
        if self.reports_batches:
            self.generate.on_batch = self.previous_on_batch
        if self.reports_turns:
            self.generate.on_turns = self.previous_on_turns
        self.bar.update(self.bar.total - self.bar.n)
        self.bar.close()


def evaluate(
    agent: MemPOAgent,
    rows: Sequence[dict],
    *,
    context_mode: ContextMode | None = None,
    progress: bool = True,
) -> EvalResult:
    """Play every row as one episode with `agent` and score it.

    Args:
        agent: a `MemPOAgent` (its `TurnProtocol` gives the turn protocol).
        rows: QA rows (``question``, ``golden_answers``, optional ``data_source``/``sub_answers``), e.g. `load_qa`.
        context_mode: ``"memory"`` (MemPO) or ``"full_history"`` (Search-R1 baseline); default: the agent's.

    Example:
        >>> import tempfile
        >>> from mempo_trl import MemPOAgent, load_qa
        >>> from mempo_trl.kit.demo_world import demo_paths
        >>> from mempo_trl.kit.tiny import build_tiny_model
        >>> model_dir = build_tiny_model(tempfile.mkdtemp())
        >>> agent = MemPOAgent.from_pretrained(model_dir, str(demo_paths().corpus), max_turns=2, max_completion_length=16)
        >>> result = evaluate(agent, list(load_qa(demo_paths().test))[:4], progress=False)
        >>> result.metrics["overall"]["num_questions"], result.records[0]["rounds"][0]["completion_tokens"]
        (4, 16)
    """
    mode = context_mode or agent.protocol.context_mode
    tracked = _Progress(agent.generator, len(rows), agent.protocol.max_turns, f"eval {mode}", progress)
    try:
        rollout = agent.play(rows, tracked, context_mode=mode)
    finally:
        tracked.close()
    records = [episode_record(ep) for ep in rollout.episodes]
    timings = rollout.timings
    return EvalResult(mode, records, summarize(records), list(rollout.episodes), timings.generation, timings.retrieval)


def evaluate_model(
    model,
    tokenizer,
    rows: Sequence[dict],
    retriever,
    protocol: TurnProtocol | None = None,
    *,
    temperature: float = 0.0,
) -> EvalResult:
    """`evaluate` of ``model`` as a `MemPOAgent` over ``retriever``, playing ``protocol`` (default `TurnProtocol()`):
    one episode per row with transformers generation (batches of 32), greedy when ``temperature == 0``; no progress
    bar.

    Example:
        >>> result = evaluate_model(model, tokenizer, rows, retriever, TurnProtocol(max_turns=2))  # doctest: +SKIP
        >>> result.metrics["overall"]["num_questions"] == len(rows)  # doctest: +SKIP
        True
    """
    from mempo_trl.generation import HFGenerator

    protocol = protocol or TurnProtocol()
    generator = HFGenerator(
        model, tokenizer, protocol.max_completion_length, temperature=temperature, batch_size=32, stops=protocol.stops
    )
    return evaluate(MemPOAgent(tokenizer, retriever, generator, protocol), rows, progress=False)


RowMetric = Callable[[dict, dict], Mapping[str, Any]]
"""A per-row metric of `heldout_metrics`: ``(row, record) -> {name: value}`` for a QA row and its `episode_record`;
a value is a number (None or NaN: not counted) or a mapping of them (averaged key by key)."""

HELDOUT_OVERALL = (
    "em",
    "f1",
    "format_valid",
    "turns_per_question",
    "total_tokens_per_question",
    "peak_context_tokens",
)
"""The overall metrics of `summarize` that `heldout_metrics` keeps."""


def exact_match_f1(row: dict, record: dict) -> dict[str, Any]:
    """The default `RowMetric`: the episode's EM and F1 as `episode_record` scored them (`mempo_trl.rewards`).

    Example:
        >>> exact_match_f1({}, {"em": 1.0, "f1": 1.0, "format_valid": True})
        {'em': 1.0, 'f1': 1.0}
    """
    return {"em": record["em"], "f1": record["f1"]}


def mean_metrics(values: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Key by key mean of `RowMetric` values: numbers that are not None or NaN (NaN when none is), mappings
    recursively.

    Example:
        >>> mean_metrics([{"em": 1.0, "kind": {"a": 1.0, "b": 0.0}}, {"em": None, "kind": {"a": 0.0, "b": 1.0}}])
        {'em': 1.0, 'kind': {'a': 0.5, 'b': 0.5}}
    """
    keys = list(dict.fromkeys(key for value in values for key in value))
    means: dict[str, Any] = {}
    for key in keys:
        found = [value[key] for value in values if key in value]
        if any(isinstance(v, Mapping) for v in found):
            means[key] = mean_metrics([v for v in found if isinstance(v, Mapping)])
        else:
            means[key] = _mean([None if v is None or math.isnan(v) else float(v) for v in found])
    return means


def heldout_metrics(result: EvalResult, rows: Sequence[dict], row_metric: RowMetric = exact_match_f1) -> dict:
    """``result``'s overall `HELDOUT_OVERALL` metrics and the mean of ``row_metric`` over its rows (``rows``, in
    the order they were played), and ``by_type``: ``em``, ``f1`` and the mean of ``row_metric`` per ``data_source``.

    Example:
        >>> metrics = heldout_metrics(evaluate_model(model, tokenizer, rows, retriever), rows)  # doctest: +SKIP
        >>> sorted(metrics["by_type"]) == sorted({row["data_source"] for row in rows})  # doctest: +SKIP
        True
    """
    overall = result.metrics["overall"]
    values = [row_metric(row, record) for row, record in zip(rows, result.records, strict=True)]
    metrics: dict[str, Any] = {key: overall[key] for key in HELDOUT_OVERALL}
    metrics.update(mean_metrics(values))
    metrics["by_type"] = {
        source: {
            "em": summary["em"],
            "f1": summary["f1"],
            **mean_metrics([v for v, r in zip(values, result.records) if r["data_source"] == source]),
        }
        for source, summary in result.metrics["by_data_source"].items()
    }
    return metrics


def compare_modes(memory: EvalResult, full_history: EvalResult) -> dict[str, float]:
    """Memory vs full-history on the same questions: token reductions in % and score differences.

    ``total_token_reduction_pct`` is ``100 * (1 - total_memory / total_full)`` over all questions (prompt +
    completion tokens of every round); the deltas are memory minus full history.

    Example:
        >>> compare_modes(memory_result, full_result)["total_token_reduction_pct"]  # doctest: +SKIP
        61.3
    """
    mem, full = memory.metrics["overall"], full_history.metrics["overall"]

    def reduction(key: str) -> float:
        return 100.0 * (1.0 - mem[key] / full[key]) if full[key] else math.nan

    return {
        "total_token_reduction_pct": reduction("total_tokens"),
        "peak_context_reduction_pct": reduction("peak_context_tokens"),
        "mean_prompt_reduction_pct": reduction("mean_prompt_tokens"),
        "em_delta": mem["em"] - full["em"],
        "f1_delta": mem["f1"] - full["f1"],
        "sub_em_delta": mem["sub_em"] - full["sub_em"],
        "turns_delta": mem["turns_per_question"] - full["turns_per_question"],
    }


def questions_per_round(records: Sequence[dict]) -> list[int]:
    """How many questions played round 1, 2, ... (an episode that ended at round r plays rounds 1..r).

    Example:
        >>> questions_per_round([{"rounds": [1, 2]}, {"rounds": [1]}, {"rounds": [1, 2, 3]}])
        [3, 2, 1]
    """
    last = max((len(r["rounds"]) for r in records), default=0)
    return [sum(len(r["rounds"]) >= k for r in records) for k in range(1, last + 1)]


def plot_context_tokens(results: Sequence[EvalResult], path: str | Path, title: str | None = None) -> Path:
    """Save a PNG of the mean prompt tokens per round index, one line per context mode (its EM in the legend), each
    point labelled with the number of questions that played that round; ``title`` names the model and data.

    Example:
        >>> plot_context_tokens([memory_result, full_result], "out/context_tokens.png", "agent on test.jsonl")  # doctest: +SKIP
        PosixPath('out/context_tokens.png')
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for result in results:
        overall = result.metrics["overall"]
        means = overall["prompt_tokens_per_round"]
        rounds = range(1, len(means) + 1)
        label = f"{result.context_mode}: EM {overall['em']:.3f} on {overall['num_questions']} questions"
        (line,) = ax.plot(rounds, means, marker="o", label=label)
        for k, mean, n in zip(rounds, means, questions_per_round(result.records)):
            ax.annotate(
                f"n={n}",
                (k, mean),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize=7,
                color=line.get_color(),
            )
    ax.set_xlabel("round (n = questions that played it)")
    ax.set_ylabel("mean prompt (context) tokens")
    ax.set_title("Context tokens per round" + (f"\n{title}" if title else ""), fontsize=10)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
