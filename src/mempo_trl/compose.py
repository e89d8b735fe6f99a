"""Multi-objective QA rows: K questions of a QA source asked in one prompt, answered as ``a1; a2; ...; aK``.

MemPO's main setting (and MEM1's) asks several questions at once: the agent must search for every one and keep what
it found in its memory until it answers all of them. `compose_objectives` builds such rows from any QA rows
(`mempo_trl.load_qa`): the questions numbered one per line (``1. ...\\n2. ...``, as the demo world's
multi-objective rows), ``golden_answers`` the first alias of every part joined by ``"; "`` (the rendered gold of the
memory reward, `mempo_trl.context.render_gold_answer`), and ``sub_questions``/``sub_answers``, which the share-of-parts
and all-parts rewards score part by part (`mempo_trl.rewards.outcome_score`). `mempo-trl compose` writes them.
"""

import random
from collections.abc import Iterable, Sequence
from typing import Any

from mempo_trl.data import DataError, has_answer_text


COMPOSED_COLUMNS = ("sub_ids", "sub_data_sources", "num_objectives")
"""The columns a composed row adds to the QA columns: the source ``id`` and ``data_source`` of every part, and K."""
HOP_COLUMNS = ("supporting_titles", "supporting_ids", "hop_queries", "hop_facts")
"""Per-hop columns (`mempo-trl hotpotqa` rows, the demo world's) a composed row keeps, every part's hops in part order,
when every part has them: what the oracle teacher (`mempo_trl.oracle`) plays."""


def _split_of(row: dict) -> str | None:
    """The split a row says it belongs to (``split``, or Search-R1's ``extra_info.split``), None when it does not."""
    extra = row.get("extra_info")
    return row.get("split") or (extra.get("split") if isinstance(extra, dict) else None)


def _scorable_aliases(row: dict) -> list[str]:
    """The row's aliases that a ``;``-separated answer can match (an alias holding ``;`` would be cut in two)."""
    return [alias for alias in row["golden_answers"] if ";" not in alias]


def check_source_rows(rows: Sequence[dict], source_name: str = "dataset") -> None:
    """Raise `DataError` naming the row (1-based) and the field for a row `compose_objectives` cannot use: no
    ``golden_answers`` with answer text, or an ``id`` (within its ``data_source``) seen on an earlier row.

    Example:
        >>> check_source_rows([{"id": "a", "question": "Who?", "golden_answers": ["Ada"]}] * 2, "qa.jsonl")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        mempo_trl.data.DataError: qa.jsonl, row 2: field 'id' is 'a', the id of row 1 too. ...
    """
    seen: dict[tuple[str, str], int] = {}
    for number, row in enumerate(rows, 1):
        key = (str(row.get("data_source", "unknown")), str(row.get("id", number - 1)))
        where = f"{source_name}, row {number} (id {key[1]!r} of {key[0]!r})"
        golds = row.get("golden_answers")
        if not isinstance(golds, list) or not any(isinstance(g, str) and has_answer_text(g) for g in golds):
            raise DataError(
                f"{where}: field 'golden_answers' is {golds!r:.80}, no answer to score a part against. Give every "
                "row at least one answer string, or remove the row."
            )
        if key in seen:
            raise DataError(
                f"{source_name}, row {number}: field 'id' is {key[1]!r}, the id of row {seen[key]} too. Give every row its own id, so "
                "that a composed row says which questions it holds."
            )
        seen[key] = number


def compose_row(parts: Sequence[dict], row_id: str) -> dict:
    """One row asking the questions of ``parts`` (QA rows) in order; with one part, its question as it is. The
    `HOP_COLUMNS` every part has are kept, the parts' hops one after the other.

    Example:
        >>> row = compose_row([{"id": "3", "question": "Where was Ada born?", "golden_answers": ["Ulm", "Ulm, DE"],
        ...                     "data_source": "nq"}, {"id": "8", "question": "Who is Max?", "golden_answers": ["Bob"],
        ...                     "data_source": "hotpotqa"}], "k2_0")
        >>> print(row["question"])
        1. Where was Ada born?
        2. Who is Max?
        >>> row["golden_answers"], row["sub_answers"], row["data_source"], row["sub_data_sources"]
        (['Ulm; Bob'], [['Ulm', 'Ulm, DE'], ['Bob']], 'hotpotqa+nq', ['nq', 'hotpotqa'])
    """
    aliases = [_scorable_aliases(part) for part in parts]
    sources = [str(part.get("data_source", "unknown")) for part in parts]
    single = len(parts) == 1
    questions = [part["question"].strip() for part in parts]
    return {
        "id": row_id,
        "question": questions[0] if single else "\n".join(f"{n}. {q}" for n, q in enumerate(questions, 1)),
        "golden_answers": aliases[0] if single else ["; ".join(a[0] for a in aliases)],
        "data_source": "+".join(sorted(set(sources))),
        "sub_questions": [] if single else questions,
        "sub_answers": [] if single else aliases,
        "sub_ids": [str(part["id"]) for part in parts],
        "sub_data_sources": sources,
        "num_objectives": len(parts),
        **{
            name: [hop for part in parts for hop in part[name]]
            for name in HOP_COLUMNS
            if all(isinstance(part.get(name), list) for part in parts)
        },
    }


def compose_objectives(
    dataset: Iterable[dict],
    num_objectives: int,
    seed: int = 0,
    max_rows: int | None = None,
    source_name: str = "dataset",
) -> list[dict]:
    """K-objective rows (`compose_row`) from the QA rows of ``dataset`` (e.g. `mempo_trl.load_qa`), K =
    ``num_objectives``.

    The rows are shuffled with ``seed`` and dealt K at a time, so the result depends only on the rows and the seed,
    and every source question is used at most once (``max_rows`` caps the count, default all ``len // K``). Rows
    that name their split (``split`` or ``extra_info.split``) are dealt within it: no composed row mixes splits.
    Aliases holding ``;`` are dropped (a ``;``-separated answer cannot match them); a row left without any is not
    used, nor is a row that is already multi-objective (``sub_answers``; `composition_report` counts both). Bad rows (`check_source_rows`) and a K larger than the pool raise `DataError`, before anything is composed.

    Example:
        >>> rows = [{"id": str(i), "question": f"q{i}?", "golden_answers": [f"a{i}"]} for i in range(5)]
        >>> [r["sub_ids"] for r in compose_objectives(rows, 2, seed=0)]
        [['2', '1'], ['0', '4']]
    """
    rows = [dict(row) for row in dataset]
    if not isinstance(num_objectives, int) or num_objectives < 1:
        raise DataError(f"num_objectives must be a whole number >= 1, got {num_objectives!r}.")
    if max_rows is not None and max_rows < 1:
        raise DataError(f"max_rows must be >= 1, got {max_rows!r}.")
    check_source_rows(rows, source_name)
    pools: dict[str | None, list[dict]] = {}
    for row in rows:
        if _scorable_aliases(row) and not row.get("sub_answers"):
            pools.setdefault(_split_of(row), []).append(row)
    largest = max((len(pool) for pool in pools.values()), default=0)
    if num_objectives > largest:
        sizes = ", ".join(f"{len(p)} in split {s}" if s else f"{len(p)}" for s, p in pools.items()) or "0"
        composed = sum(1 for row in rows if row.get("sub_answers"))
        semicolons = sum(1 for row in rows if not row.get("sub_answers") and not _scorable_aliases(row))
        why = "".join(
            f" ({n} {what} left out)"
            for n, what in (
                (semicolons, "row(s) whose every gold answer holds ';', which joins the parts,"),
                (composed, "multi-objective row(s)"),
            )
            if n
        )
        raise DataError(
            f"{source_name}: {num_objectives} objectives need {num_objectives} distinct questions, but the pool has "
            f"{sizes} usable question(s){why}. Ask for fewer objectives, or give more rows."
        )
    rng = random.Random(seed)
    composed: list[dict] = []
    for split, pool in pools.items():
        order = list(range(len(pool)))
        rng.shuffle(order)
        for start in range(0, len(order) - num_objectives + 1, num_objectives):
            if max_rows is not None and len(composed) >= max_rows:
                return composed
            prefix = f"k{num_objectives}_{split}_" if split else f"k{num_objectives}_"
            parts = [pool[i] for i in order[start : start + num_objectives]]
            composed.append(compose_row(parts, f"{prefix}{len(composed)}"))
    return composed


def composition_report(source_rows: Sequence[dict], composed: Sequence[dict]) -> dict[str, Any]:
    """What `compose_objectives` made of ``source_rows``: rows, questions used and left over (the rows left out as
    already multi-objective among them), parts per data source.

    Example:
        >>> rows = [{"id": str(i), "question": f"q{i}?", "golden_answers": [f"a{i}"]} for i in range(5)]
        >>> composition_report(rows, compose_objectives(rows, 2))
        {'num_rows': 2, 'num_source_rows': 5, 'questions_used': 4, 'questions_unused': 1, 'multi_objective_rows_left_out': 0, 'parts_by_data_source': {'unknown': 4}}
    """
    used = [source for row in composed for source in row["sub_data_sources"]]
    return {
        "num_rows": len(composed),
        "num_source_rows": len(source_rows),
        "questions_used": len(used),
        "questions_unused": len(source_rows) - len(used),
        "multi_objective_rows_left_out": sum(bool(row.get("sub_answers")) for row in source_rows),
        "parts_by_data_source": {source: used.count(source) for source in sorted(set(used))},
    }
