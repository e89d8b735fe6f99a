"""The lab's analytics of a warm-started learner on the demo world (`mempo_trl.kit.learner`): why episodes miss,
what RL can gain before any is spent, and how much remembering a fact raises P(gold).

- `failure_kind` says why a greedy episode missed (`FAILURE_KINDS`), from the values its answer turn had to see
  (`answer_time_facts`);
- `lab_row_metric` is the held-out metric of `lab/learning.py` (a `mempo_trl.evaluation.RowMetric`): the quick
  start's EM, F1 and memory recall, plus the failure kind of each row (averaged into shares);
- `headroom` measures what RL can gain before any is spent: the failure kinds of the greedy episodes, and how often
  sampled episodes of a row disagree (the GRPO groups that carry a reward signal);
- `memory_signal`: how much remembering a fact raises P(gold), the memory reward's raw material, per question type.
"""

from collections.abc import Sequence
from typing import Any

from mempo_trl.context import DEFAULT_INSTRUCTION, DEFAULT_SYSTEM_PROMPT
from mempo_trl.kit.learner import found_facts, memory_recall_metric, needed_facts


FAILURE_KINDS = ("correct", "no_answer", "invalid_format", "not_retrieved", "forgotten", "miscopied", "wrong_choice")
"""What `failure_kind` returns, in the order it checks."""


def failure_kind(record: dict, needed: Sequence[str] = (), memory_context: bool = True) -> str:
    """Why an episode (a `mempo_trl.evaluation.evaluate` record) missed, the first of `FAILURE_KINDS` that applies.

    ``needed``: the values the answer turn must see (`answer_time_facts`); default: the gold answer (any alias).

    - ``correct``: EM 1; ``no_answer``: well-formed turns, but no answer within ``max_turns`` (still searching);
      ``invalid_format``: a malformed turn;
    - ``not_retrieved``: a needed value is in none of the retrieved passages;
    - ``forgotten`` (memory context only): all were retrieved, but one is in neither the memory nor the search result
      that the answer turn saw (the previous round's), so the memory dropped it;
    - ``miscopied``: a part of the answer (multi-objective answers are ``;``-separated) is in neither the passages nor
      the question: a name or number copied wrong;
    - ``wrong_choice``: every part is a value of the passages or the question, just not the right one.

    Example:
        >>> info = "<information>Doc 1(Title: Seikeis) Seikeis was founded in 1492.</information>"
        >>> rounds = [{"mem": "Nothing yet.", "information": info}, {"mem": "Seikeis: 1492.", "information": None}]
        >>> record = {"question": "When was Seikeis founded?", "golden_answers": ["1492"], "em": 0.0,
        ...           "format_valid": True, "answer": "1409", "rounds": rounds}
        >>> failure_kind(record), failure_kind({**record, "answer": "Seikeis"})
        ('miscopied', 'wrong_choice')
        >>> failure_kind({**record, "rounds": [{"mem": "", "information": None}]})
        'not_retrieved'
        >>> rounds = [{"mem": "", "information": info}, {"mem": "", "information": "<information>x</information>"}]
        >>> failure_kind({**record, "rounds": [*rounds, {"mem": "", "information": None}]})
        'forgotten'
    """
    import re

    rounds = record["rounds"]
    if record["em"] == 1.0:
        return "correct"
    if record["answer"] is None and all(r.get("valid", True) for r in rounds):
        return "no_answer"
    if not record["format_valid"]:
        return "invalid_format"
    passages = " ".join(r.get("information") or "" for r in rounds)

    def within(value: str, text: str) -> bool:  # as whole words, case and punctuation aside
        words = " ".join(re.findall(r"\w+", value.lower()))
        return bool(words) and f" {words} " in " " + " ".join(re.findall(r"\w+", text.lower())) + " "

    groups = [[value] for value in needed] or [list(record["golden_answers"])]
    if not all(any(within(v, passages) for v in group) for group in groups):
        return "not_retrieved"
    seen = f"{rounds[-2].get('mem') or ''} {rounds[-2].get('information') or ''}" if len(rounds) > 1 else ""
    if memory_context and not all(any(within(v, seen) for v in group) for group in groups):
        return "forgotten"
    parts = [part for part in record["answer"].split(";") if part.strip()]
    copied = all(within(part, passages + " " + record["question"]) for part in parts)
    return "wrong_choice" if parts and copied else "miscopied"


def answer_time_facts(row: dict, needed: Sequence[str]) -> list[str]:
    """The values a demo-world row's answer turn must see, from its ``needed`` facts (`needed_facts`): all but a
    bridge's.

    A 2-hop answer needs only the second hop's value; a comparison both compared values; a multi-objective row every
    sub-answer. Empty (meaning: the gold answer) when ``needed`` is.
    """
    return list(needed[-1:] if row.get("data_source") == "demo_2hop" else needed)


def lab_row_metric(retriever, memory_context: bool = True):
    """`mempo_trl.kit.learner.memory_recall_metric` plus ``failures``: the row's `failure_kind` as one share per
    kind of `FAILURE_KINDS` (1.0 for its kind), so that their means are the share of rows per kind."""
    recall = memory_recall_metric(retriever)

    def metric(row: dict, record: dict) -> dict[str, Any]:
        kind = failure_kind(record, answer_time_facts(row, needed_facts(row, retriever)), memory_context)
        return {**recall(row, record), "failures": {k: float(k == kind) for k in FAILURE_KINDS}}

    return metric


def headroom(
    model, tokenizer, rows: Sequence[dict], retriever, protocol, samples: int = 4, temperature: float = 1.0
) -> dict[str, Any]:
    """What RL can gain on ``rows``, measured before training.

    Greedy: ``greedy_em`` and the share of rows per `failure_kind` (``failures``, with `answer_time_facts`). Sampled (``samples`` episodes
    per row at ``temperature``, seeds 0..samples-1): ``mean_at_1`` (mean EM), ``pass_at_k`` (share of rows right at
    least once) and ``mixed_groups`` (share of rows whose samples disagree: the GRPO groups that carry an outcome
    signal). The same keys per question type in ``by_type``. ``protocol``: the `TurnProtocol` the episodes play.
    """
    import torch

    from mempo_trl.evaluation import evaluate_model

    greedy = evaluate_model(model, tokenizer, rows, retriever, protocol).records
    memory_context = protocol.context_mode == "memory"
    kinds = [
        failure_kind(r, answer_time_facts(row, needed_facts(row, retriever)), memory_context)
        for row, r in zip(rows, greedy)
    ]
    sampled = []
    for seed in range(samples):
        torch.manual_seed(seed)
        result = evaluate_model(model, tokenizer, rows, retriever, protocol, temperature=temperature)
        sampled.append([r["em"] for r in result.records])

    def summary(index: list[int]) -> dict[str, Any]:
        n = max(1, len(index))
        kinds_here = [kinds[i] for i in index]
        wins = [sum(run[i] for run in sampled) for i in index]
        return {
            "rows": len(index),
            "greedy_em": sum(greedy[i]["em"] for i in index) / n,
            "mean_at_1": sum(wins) / (n * samples),
            "pass_at_k": sum(w > 0 for w in wins) / n,
            "mixed_groups": sum(0 < w < samples for w in wins) / n,
            "failures": {kind: kinds_here.count(kind) / n for kind in FAILURE_KINDS},
        }

    types: dict[str, list[int]] = {}
    for i, record in enumerate(greedy):
        types.setdefault(record["data_source"], []).append(i)
    return {
        "samples": samples,
        "temperature": temperature,
        **summary(list(range(len(rows)))),
        "by_type": {source: summary(index) for source, index in sorted(types.items())},
    }


def memory_signal(
    model,
    tokenizer,
    rows: Sequence[dict],
    retriever,
    threshold: float | None = None,
    instruction: str = DEFAULT_INSTRUCTION,
    system_prompt: str = DEFAULT_SYSTEM_PROMPT,
) -> dict[str, Any]:
    """How much a memory's content moves P(gold), the quantity the memory reward is made of, per question type.

    For each row, the gold answer is scored (`mempo_trl.scoring.answer_token_logps`, then
    `mempo_trl.memory.answer_probability` with ``threshold``) after the memory context the trainer scores P_mem in
    (``system + user(question)`` + a ``<mem>`` block), with the memory holding: every fact the row's hops find
    (`mempo_trl.kit.warmstart.hop_facts`, ``p_all``), each fact but one (``p_drop``: mean over the facts), or
    nothing (``p_none``: ``Nothing yet.``). ``fact_value = p_all - p_drop`` is what keeping one more fact earns in
    memory reward: near 0 on a type, the memory advantage has nothing to teach there. Rows without hops, or
    whose hops do not retrieve their facts, are skipped. Returns the means overall and per ``data_source``, with ``rows``.
    """
    from mempo_trl.context import ScoringItem, gold_answer_tokens, initial_messages, memory_context_ids, render_prompt
    from mempo_trl.memory import answer_probability
    from mempo_trl.oracle import NOTHING_YET
    from mempo_trl.scoring import answer_token_logps

    items, owners = [], []  # owners[i]: (row index, "all" | "drop" | "none")
    for index, row in enumerate(rows):
        facts = found_facts(row, retriever)
        if not facts:
            continue
        base = render_prompt(tokenizer, initial_messages(row["question"], system_prompt, instruction))
        answer_ids, answer_mask = gold_answer_tokens(tokenizer, row["golden_answers"], row.get("sub_answers") or None)
        memories = [("all", facts), *(("drop", facts[:i] + facts[i + 1 :]) for i in range(len(facts))), ("none", [])]
        for kind, kept in memories:
            context = memory_context_ids(tokenizer, base, f"<mem> {' '.join(kept) or NOTHING_YET} </mem>")
            items.append(ScoringItem(context, answer_ids, answer_mask))
            owners.append((index, kind))
    logps, mask = answer_token_logps(model, items, tokenizer.pad_token_id)
    probs = answer_probability(logps, mask, threshold).tolist()
    per_row: dict[int, dict[str, list[float]]] = {}
    for (index, kind), prob in zip(owners, probs):
        per_row.setdefault(index, {}).setdefault(kind, []).append(prob)

    def summary(indices: list[int]) -> dict[str, Any]:
        n = max(1, len(indices))
        mean = {k: sum(sum(per_row[i][k]) / len(per_row[i][k]) for i in indices) / n for k in ("all", "drop", "none")}
        return {
            "rows": len(indices),
            "p_all": mean["all"],
            "p_drop": mean["drop"],
            "p_none": mean["none"],
            "fact_value": mean["all"] - mean["drop"],
        }

    types: dict[str, list[int]] = {}
    for index in per_row:
        types.setdefault(rows[index].get("data_source", "all"), []).append(index)
    return {
        "threshold": threshold,
        **summary(list(per_row)),
        "by_type": {source: summary(indices) for source, indices in sorted(types.items())},
    }


if __name__ == "__main__":  # a module of the lab's scripts: running it would do nothing
    import sys

    sys.stderr.write(
        "error: lab/analytics.py is a module, not a script: learning.py and long_horizon.py import it (see lab/README.md).\n"
    )
    sys.exit(2)
