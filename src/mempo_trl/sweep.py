"""The objectives sweep: accuracy and token cost against the number of questions per row, memory vs full history.

MemPO's central comparison: as a row asks more questions (K objectives, `mempo_trl.compose`), a full-history agent's
context grows with every search while a memory agent's stays bounded. `evaluate_objectives` plays one agent over one
evaluation set per K in each context mode (`mempo_trl.evaluation.evaluate`, the per-question accounting of
`mempo-trl eval`), `objectives_table` sets the results side by side and `plot_objectives` draws them.
`mempo-trl eval --objectives 1 2 4 8` runs it from the command line.
"""

from collections.abc import Mapping, Sequence
from pathlib import Path

from mempo_trl.agent import MemPOAgent
from mempo_trl.context import COMPARED_CONTEXT_MODES, ContextMode
from mempo_trl.evaluation import EvalResult, evaluate


TABLE_COLUMNS = (
    "num_questions",
    "em",
    "f1",
    "em_all_parts",
    "f1_all_parts",
    "format_valid",
    "turns_per_question",
    "searches_per_question",
    "total_tokens_per_question",
    "peak_context_tokens",
)
"""The overall metrics of `mempo_trl.evaluation.summarize` a sweep row keeps (``em``/``f1``: each part's share)."""


def evaluate_objectives(
    agent: MemPOAgent,
    rows_by_objectives: Mapping[int, Sequence[dict]],
    context_modes: Sequence[ContextMode] = COMPARED_CONTEXT_MODES,
    progress: bool = True,
) -> dict[int, dict[str, EvalResult]]:
    """`evaluate` ``agent`` on the rows of every K (number of objectives) in every context mode: ``{K: {mode:
    EvalResult}}``.

    Example:
        >>> results = evaluate_objectives(agent, {1: rows_k1, 2: rows_k2})  # doctest: +SKIP
        >>> results[2]["full_history"].metrics["overall"]["peak_context_tokens"]  # doctest: +SKIP
        412.5
    """
    return {
        k: {mode: evaluate(agent, list(rows), context_mode=mode, progress=progress) for mode in context_modes}
        for k, rows in rows_by_objectives.items()
    }


def objectives_table(results: Mapping[int, Mapping[str, EvalResult]]) -> list[dict]:
    """One row per K and context mode: ``objectives``, ``context_mode`` and the `TABLE_COLUMNS` of its overall metrics.

    Example:
        >>> objectives_table(evaluate_objectives(agent, {2: rows}, ["memory"]))[0]["objectives"]  # doctest: +SKIP
        2
    """
    return [
        {"objectives": k, "context_mode": mode, **{c: result.metrics["overall"][c] for c in TABLE_COLUMNS}}
        for k, by_mode in sorted(results.items())
        for mode, result in by_mode.items()
    ]


def format_table(table: Sequence[dict]) -> str:
    """`objectives_table` as aligned text, one line per K and context mode.

    Example:
        >>> print(format_table([{"objectives": 2, "context_mode": "memory", "num_questions": 3, "em": 0.5,
        ...     "f1": 0.75, "em_all_parts": 0.0, "f1_all_parts": 0.5, "format_valid": 1.0, "turns_per_question": 3.0,
        ...     "searches_per_question": 2.0, "total_tokens_per_question": 900.0, "peak_context_tokens": 320.0}]))
         K mode             n     EM     F1 EM(all) F1(all) format turns search  tokens/q peak ctx
         2 memory           3  0.500  0.750   0.000   0.500  1.000  3.00   2.00     900.0    320.0
    """
    lines = [
        f"{'K':>2} {'mode':<13} {'n':>4} {'EM':>6} {'F1':>6} {'EM(all)':>7} {'F1(all)':>7} {'format':>6} "
        f"{'turns':>5} {'search':>6} {'tokens/q':>9} {'peak ctx':>8}"
    ]
    for r in table:
        lines.append(
            f"{r['objectives']:>2} {r['context_mode']:<13} {r['num_questions']:>4} {r['em']:>6.3f} {r['f1']:>6.3f} "
            f"{r['em_all_parts']:>7.3f} {r['f1_all_parts']:>7.3f} {r['format_valid']:>6.3f} "
            f"{r['turns_per_question']:>5.2f} {r['searches_per_question']:>6.2f} "
            f"{r['total_tokens_per_question']:>9.1f} {r['peak_context_tokens']:>8.1f}"
        )
    return "\n".join(lines)


def plot_objectives(table: Sequence[dict], path: str | Path, title: str | None = None) -> Path:
    """Save a PNG of `objectives_table` against K, one line per context mode: F1 (each part's share, solid) and EM of
    all parts (dashed) on the left; total tokens per question (solid) and peak context (dashed) on the right.

    Example:
        >>> plot_objectives(objectives_table(results), "out/objectives.png", "agent on nq")  # doctest: +SKIP
        PosixPath('out/objectives.png')
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (accuracy, tokens) = plt.subplots(1, 2, figsize=(10, 4.2), dpi=120)
    for mode in dict.fromkeys(r["context_mode"] for r in table):
        rows = [r for r in table if r["context_mode"] == mode]
        ks = [r["objectives"] for r in rows]
        (line,) = accuracy.plot(ks, [r["f1"] for r in rows], marker="o", label=f"{mode}: F1 (share of parts)")
        accuracy.plot(
            ks,
            [r["em_all_parts"] for r in rows],
            marker="s",
            linestyle="--",
            color=line.get_color(),
            label=f"{mode}: EM (all parts)",
        )
        tokens.plot(
            ks,
            [r["total_tokens_per_question"] for r in rows],
            marker="o",
            color=line.get_color(),
            label=f"{mode}: total tokens / question",
        )
        tokens.plot(
            ks,
            [r["peak_context_tokens"] for r in rows],
            marker="s",
            linestyle="--",
            color=line.get_color(),
            label=f"{mode}: peak context",
        )
    for ax, ylabel in ((accuracy, "score"), (tokens, "tokens")):
        ax.set_xlabel("objectives (questions per row)")
        ax.set_ylabel(ylabel)
        ax.set_xticks(sorted({r["objectives"] for r in table}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    accuracy.set_ylim(-0.02, 1.02)
    fig.suptitle("Accuracy and tokens against the number of objectives" + (f"\n{title}" if title else ""), fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
