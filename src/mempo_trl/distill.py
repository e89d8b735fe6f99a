"""Warm-start data from a teacher: play it as a MemPO agent, keep its good episodes, one SFT row per round.

`distill` plays a `mempo_trl.agent.MemPOAgent` (the teacher: transformers, vLLM or an OpenAI-compatible endpoint)
over QA rows with the turn protocol and context builder of training (`mempo_trl.rollout.RolloutEngine`), a group of
rows at a time, and appends every finished episode to ``episodes.jsonl`` as soon as its group ends, keyed by the row's
``id``: a rerun skips the rows found there (and the endpoint's request cache, ``requests.jsonl``, answers any request
of an unfinished group again without sending it). The kept episodes (`keep_reason`) become ``train.jsonl``: one
prompt-completion row per round in TRL's conversational format (``prompt``: the round's context messages,
``completion``: the assistant message the teacher wrote), which `mempo-trl sft` trains on.
"""

import json
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from mempo_trl.data import append_lines
from mempo_trl.rewards import episode_outcome
from mempo_trl.rollout import Episode


EPISODES_FILE = "episodes.jsonl"
ROWS_FILE = "train.jsonl"
KEEP_RULES = ("correct", "format_valid")


def episode_entry(episode: Episode, context_messages: Callable[[list[dict], list[tuple[str, str]]], list[dict]]):
    """One finished episode as a JSON-ready dict: the row's ``id``, scores and every round's context ``messages``
    (rebuilt with ``context_messages(base, history)``, the protocol's `round_messages`) and turn.

    ``em`` is the exact match, for a multi-objective row the share of its parts answered exactly
    (`mempo_trl.rewards.outcome_score`); None without a gold.
    """
    outcome = episode_outcome(episode)
    rounds, history = [], []
    for t, record in enumerate(episode.rounds):
        rounds.append(
            {
                "messages": context_messages(episode.base_messages, list(history)),
                "completion": record.text,
                "valid": record.turn.valid,
                "reason": record.turn.reason,
                "action": record.turn.action,
                "truncated": record.truncated,
            }
        )
        if record.information is not None:
            history.append((record.text, episode.shown_information(t)))
    row = episode.row
    return {
        "id": row["id"],
        "data_source": row.get("data_source", "unknown"),
        "question": episode.question,
        "golden_answers": list(episode.golden_answers or []),
        "sub_answers": list(row.get("sub_answers") or []),
        "answer": episode.answer,
        "em": None if outcome is None else outcome.em,
        "format_valid": episode.format_valid,
        "context_overflow": episode.context_overflow,
        "rounds": rounds,
    }


def keep_reason(entry: dict, keep: str = "correct", min_share: float = 1.0) -> str:
    """``"kept"``, or why an `episode_entry` is left out: ``"context_overflow"``, ``"format_invalid"`` (a turn that
    does not parse, or no answer within ``max_turns``), ``"no_gold"`` or ``"wrong_answer"`` (``em`` below
    ``min_share``: for a multi-objective row, the share of parts answered exactly). ``keep="format_valid"`` keeps
    every format-valid episode, right or wrong.

    Example:
        >>> keep_reason({"format_valid": True, "context_overflow": False, "em": 2 / 3})
        'wrong_answer'
        >>> keep_reason({"format_valid": True, "context_overflow": False, "em": 2 / 3}, min_share=0.6)
        'kept'
    """
    if keep not in KEEP_RULES:
        raise ValueError(f"keep must be one of {', '.join(KEEP_RULES)}, got {keep!r}")
    if entry["context_overflow"]:
        return "context_overflow"
    if not entry["format_valid"]:
        return "format_invalid"
    if keep == "format_valid":
        return "kept"
    if entry["em"] is None:
        return "no_gold"
    return "kept" if entry["em"] >= min_share else "wrong_answer"


def sft_rows(entries: Sequence[dict], keep: str = "correct", min_share: float = 1.0) -> list[dict]:
    """One TRL conversational prompt-completion row per round of the kept entries (`keep_reason`), with the row's
    ``id`` and the ``round`` (1-based).

    Example:
        >>> entry = {"id": "q1", "format_valid": True, "context_overflow": False, "em": 1.0,
        ...          "rounds": [{"messages": [{"role": "user", "content": "Q"}], "completion": "<answer> A </answer>"}]}
        >>> sft_rows([entry])
        [{'prompt': [{'role': 'user', 'content': 'Q'}], 'completion': [{'role': 'assistant', 'content': '<answer> A </answer>'}], 'id': 'q1', 'round': 1}]
    """
    return [
        {
            "prompt": r["messages"],
            "completion": [{"role": "assistant", "content": r["completion"]}],
            "id": entry["id"],
            "round": t,
        }
        for entry in entries
        if keep_reason(entry, keep, min_share) == "kept"
        for t, r in enumerate(entry["rounds"], 1)
    ]


def read_episodes(path: str | Path) -> dict[str, dict]:
    """The entries of an ``episodes.jsonl`` by row id; a last line cut by a kill is ignored (its row is played
    again)."""
    path = Path(path)
    found = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            found[entry["id"]] = entry
    return found


def distill(
    agent,
    rows: Sequence[dict],
    output_dir: str | Path,
    keep: str = "correct",
    min_share: float = 1.0,
    save_every: int = 16,
    on_group: Callable[[int, int], None] | None = None,
) -> dict:
    """Play ``agent`` over ``rows`` (each with a unique ``id``), ``save_every`` rows at a time, appending the finished
    episodes to ``output_dir/episodes.jsonl`` (rows already there are not played again); then write the rows of the
    kept episodes (`sft_rows`) to ``output_dir/train.jsonl``. Returns the counts: ``played`` (this call),
    ``episodes`` (of ``rows``, in all), ``kept``, ``rows`` (SFT rows) and ``by_reason`` (`keep_reason`), overall and
    ``by_data_source``. ``on_group(done, total)`` is called after each saved group.

    Example:
        >>> teacher = MemPOAgent.from_pretrained("kit/learner/model", "kit/learner/world/corpus.jsonl")  # doctest: +SKIP
        >>> distill(teacher, load_qa("kit/learner/world/warm.jsonl"), "distilled")["kept"]  # doctest: +SKIP
        231
    """
    if save_every < 1:
        raise ValueError(f"save_every must be >= 1, got {save_every}")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    episodes_path = out / EPISODES_FILE
    done = read_episodes(episodes_path)
    todo = [row for row in rows if str(row["id"]) not in done]
    for start in range(0, len(todo), save_every):
        group = [{**row, "id": str(row["id"])} for row in todo[start : start + save_every]]
        entries = [episode_entry(ep, agent.protocol.round_messages) for ep in agent.play(group).episodes]
        append_lines(episodes_path, entries)
        done.update((entry["id"], entry) for entry in entries)
        if on_group is not None:
            on_group(len(rows) - len(todo) + start + len(group), len(rows))
    entries = [done[str(row["id"])] for row in rows]
    kept_rows = sft_rows(entries, keep, min_share)
    with (out / ROWS_FILE).open("w", encoding="utf-8") as f:
        for row in kept_rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    reasons = [keep_reason(entry, keep, min_share) for entry in entries]
    sources = sorted({entry["data_source"] for entry in entries})
    return {
        "played": len(todo),
        "episodes": len(entries),
        "kept": reasons.count("kept"),
        "rows": len(kept_rows),
        "by_reason": dict(Counter(reasons)),
        "by_data_source": {
            source: dict(Counter(r for r, e in zip(reasons, entries) if e["data_source"] == source))
            for source in sources
        },
    }
