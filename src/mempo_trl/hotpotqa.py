"""HotpotQA rows to the project's QA rows and one corpus of Wikipedia paragraphs (`mempo-trl hotpotqa`).

A HotpotQA row (the Hub dataset ``hotpotqa/hotpot_qa``, ``distractor`` or ``fullwiki``: ``id``, ``question``,
``answer``, ``type``, ``supporting_facts {title, sent_id}``, ``context {title, sentences}``; the original JSON files'
``_id`` and ``[title, ...]`` pairs are read too) becomes:

- a QA row (`qa_row`): ``id``, ``question``, ``golden_answers``, ``data_source`` (``hotpotqa_bridge`` or
  ``hotpotqa_comparison``), ``type``, and per hop, in hop order: ``supporting_titles``, ``supporting_ids`` (the corpus
  ids of the gold paragraphs), ``hop_queries`` (one search per hop: for a bridge question the question itself, then
  the bridge entity's title; for a comparison each title) and ``hop_facts`` (the supporting sentences of the hop's
  paragraph, joined), which the oracle teacher plays (`mempo_trl.oracle`);
- passages (`row_passages`): one per paragraph of its context, ``contents`` = ``"Title"\\ntext``, with an id derived
  from the title and text (`passage_id`), so that the same paragraph gets the same id on any run and any subset of
  questions, and pooling the questions' paragraphs deduplicates them. Other questions' paragraphs are the
  distractors.

Rows are checked first (`check_row`): a bad one raises `DataError` naming the source, the row (1-based) and the field.
"""

import hashlib
import re
from collections import Counter
from collections.abc import Iterable, Sequence

from mempo_trl.data import DataError, has_answer_text, has_visible_text


LICENSE = (
    "HotpotQA (Yang et al., EMNLP 2018, hotpotqa.github.io), CC BY-SA 4.0: credit HotpotQA and keep the license "
    "for data built from it."
)
TYPES = ("bridge", "comparison")
HUB_ROW = (
    '{"id": ..., "question": ..., "answer": ..., "type": "bridge", "supporting_facts": {"title": [...], '
    '"sent_id": [...]}, "context": {"title": [...], "sentences": [[...], ...]}}'
)


def passage_id(title: str, text: str) -> str:
    """The corpus id of a paragraph: the first 16 hex digits of the SHA-256 of ``title``, a newline and ``text``.

    Example:
        >>> passage_id("Ulm", "Ulm is a city.")
        'a888aa29955a87b0'
    """
    return hashlib.sha256(f"{title}\n{text}".encode()).hexdigest()[:16]


def passage_contents(title: str, text: str) -> str:
    """The corpus ``contents`` of a paragraph: the title in quotes, a newline, the text (wiki-18's form)."""
    return f'"{title}"\n{text}'


def _fail(where: str, field: str, problem: str, fix: str) -> DataError:
    return DataError(f"{where}: field '{field}' {problem}. {fix}")


def _pairs(value, names: tuple[str, str]) -> dict | None:
    """A Hub-style ``{a: [...], b: [...]}`` from the original JSON's ``[[a, b], ...]`` (None when it is neither)."""
    if isinstance(value, dict):
        return value
    if isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        return {names[0]: [p[0] for p in value], names[1]: [p[1] for p in value]}
    return None


def normalize_row(row: dict) -> dict:
    """``row`` in the Hub schema: the original JSON files' ``_id`` and ``[[title, ...], ...]`` lists are converted;
    anything else is left for `check_row` to judge."""
    row = dict(row)
    if "id" not in row and "_id" in row:
        row["id"] = row.pop("_id")
    for name, names in (("supporting_facts", ("title", "sent_id")), ("context", ("title", "sentences"))):
        converted = _pairs(row.get(name), names)
        if converted is not None:
            row[name] = converted
    return row


def _check_list(where: str, field: str, value, kind: type, what: str) -> None:
    if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        raise _fail(where, field, f"must be a list of {what}, got {value!r:.80}", f"Write a list of {what}.")


def check_row(row: dict, where: str) -> None:
    """Raise `DataError` (``where``: the source and row, e.g. ``dev.jsonl, row 3``) naming the field for a row
    `qa_row` cannot convert: a missing or mistyped field, an unknown ``type``, lists of unequal length, a
    supporting title absent from ``context``, a supporting paragraph without text."""
    for name in ("id", "question", "answer", "type", "supporting_facts", "context"):
        if row.get(name) is None:
            raise _fail(where, name, "is missing", f"Every row needs the fields of {HUB_ROW}.")
    if not isinstance(row["id"], str | int) or isinstance(row["id"], bool) or not str(row["id"]).strip():
        raise _fail(where, "id", f"must be a non-empty string, got {row['id']!r:.80}", "Give every question its id.")
    if not isinstance(row["question"], str) or not has_visible_text(row["question"]):
        raise _fail(where, "question", f"must be text, got {row['question']!r:.80}", "Write the question.")
    if not isinstance(row["answer"], str) or not has_answer_text(row["answer"]):
        raise _fail(
            where,
            "answer",
            f"must be an answer string, got {row['answer']!r:.80}",
            "Write the gold answer (rows without one, such as fullwiki's test split, cannot be converted).",
        )
    if row["type"] not in TYPES:
        raise _fail(where, "type", f"is {row['type']!r:.80}", f"Use one of {', '.join(TYPES)}.")
    facts, context = row["supporting_facts"], row["context"]
    for name, value, keys in (
        ("supporting_facts", facts, ("title", "sent_id")),
        ("context", context, ("title", "sentences")),
    ):
        if not isinstance(value, dict) or any(key not in value for key in keys):
            raise _fail(
                where, name, f"must be an object with {' and '.join(keys)}, got {value!r:.80}", f"See {HUB_ROW}."
            )
    _check_list(where, "supporting_facts.title", facts["title"], str, "titles")
    _check_list(where, "supporting_facts.sent_id", facts["sent_id"], int, "sentence numbers")
    _check_list(where, "context.title", context["title"], str, "titles")
    _check_list(where, "context.sentences", context["sentences"], list, "sentence lists")
    for name, a, b in (("supporting_facts", "title", "sent_id"), ("context", "title", "sentences")):
        if len(row[name][a]) != len(row[name][b]):
            raise _fail(
                where,
                f"{name}.{b}",
                f"has {len(row[name][b])} entries but {name}.{a} has {len(row[name][a])}",
                "Give one entry per title.",
            )
    if not facts["title"]:
        raise _fail(where, "supporting_facts.title", "is empty", "Name the paragraphs that support the answer.")
    for k, sentences in enumerate(context["sentences"]):
        _check_list(where, f"context.sentences[{k}]", sentences, str, "sentence strings")
    paragraphs = dict(zip(context["title"], context["sentences"]))
    for k, title in enumerate(facts["title"]):
        if title not in paragraphs:
            raise _fail(
                where,
                f"supporting_facts.title[{k}]",
                f"is {title!r}, which is not a title of the row's context",
                "Add that paragraph to context, or fix the title (it must match exactly).",
            )
        if not "".join(paragraphs[title]).strip():
            raise _fail(
                where,
                f"supporting_facts.title[{k}]",
                f"is {title!r}, whose paragraph in context has no text",
                "Give the supporting paragraph's sentences.",
            )


def _core_title(title: str) -> str:
    """A title without its disambiguation (``"Up (film)"`` -> ``"up"``), lower-cased, for finding it in a text."""
    return re.sub(r"\s*\(.*\)$", "", title).lower()


def bridge_order(question: str, answer: str, titles: Sequence[str], facts: dict[str, str]) -> tuple[list[str], str]:
    """The two paragraphs of a bridge question in hop order, and the rule that decided (HotpotQA does not say):

    ``title_in_fact``: one paragraph's supporting facts name the other's title (the bridge entity, hop 2);
    ``title_in_question``: the question names one title (hop 1); ``answer_in_fact``: one paragraph's facts hold
    the answer (hop 2); ``as_given``: none of these tells them apart, the order of ``supporting_facts``.

    Example:
        >>> bridge_order("Where was the director of Up born?", "Ulm", ["Max Doe", "Up (film)"],
        ...              {"Up (film)": "Up is a film by Max Doe.", "Max Doe": "Max Doe was born in Ulm."})
        (['Up (film)', 'Max Doe'], 'title_in_fact')
    """
    if len(titles) != 2:
        return list(titles), "as_given"
    a, b = titles
    rules = (
        ("title_in_fact", _core_title(b) in facts[a].lower(), _core_title(a) in facts[b].lower()),
        ("title_in_question", _core_title(a) in question.lower(), _core_title(b) in question.lower()),
        ("answer_in_fact", answer.lower() in facts[b].lower(), answer.lower() in facts[a].lower()),
    )
    for name, a_first, b_first in rules:
        if a_first != b_first:
            return ([a, b] if a_first else [b, a]), name
    return [a, b], "as_given"


def paragraph_text(sentences: Sequence[str]) -> str:
    """A paragraph's text: its sentences joined as HotpotQA splits them (each but the first starts with a space)."""
    return "".join(sentences).strip()


def qa_row(row: dict) -> tuple[dict, str, int]:
    """The QA row of a checked HotpotQA row (`check_row`), the rule that ordered its hops (`bridge_order`; ``titles``
    for a comparison) and how many supporting sentence numbers point past their paragraph (left out of
    ``hop_facts``)."""
    context = dict(zip(row["context"]["title"], row["context"]["sentences"]))
    titles = list(dict.fromkeys(row["supporting_facts"]["title"]))
    sentences: dict[str, list[str]] = {title: [] for title in titles}
    missing = 0
    for title, sent_id in zip(row["supporting_facts"]["title"], row["supporting_facts"]["sent_id"]):
        if 0 <= sent_id < len(context[title]):
            sentences[title].append(context[title][sent_id].strip())
        else:
            missing += 1
    facts = {title: " ".join(s for s in sentences[title] if s) for title in titles}
    question, answer = row["question"].strip(), row["answer"].strip()
    if row["type"] == "bridge":
        titles, rule = bridge_order(question, answer, titles, facts)
        queries = [question, *titles[1:]]
    else:
        rule, queries = "titles", list(titles)
    qa = {
        "id": str(row["id"]),
        "question": question,
        "golden_answers": [answer],
        "data_source": f"hotpotqa_{row['type']}",
        "type": row["type"],
        "supporting_titles": titles,
        "supporting_ids": [passage_id(title, paragraph_text(context[title])) for title in titles],
        "hop_queries": queries,
        "hop_facts": [facts[title] for title in titles],
    }
    return qa, rule, missing


def row_passages(row: dict) -> list[dict]:
    """The corpus passages (``id``, ``contents``) of a checked row's context paragraphs with text, in order."""
    passages = []
    for title, sentences in zip(row["context"]["title"], row["context"]["sentences"]):
        text = paragraph_text(sentences)
        if text:
            passages.append({"id": passage_id(title, text), "contents": passage_contents(title, text)})
    return passages


def convert_hotpotqa(splits: dict[str, Iterable[tuple[str, dict]]]) -> tuple[dict[str, list[dict]], list[dict], dict]:
    """QA rows per split, the pooled corpus and a report, from ``{split: [(where, HotpotQA row), ...]}``.

    Every row is checked first (`check_row`); a question id in two splits (or twice in one) raises `DataError` naming
    both rows. The corpus holds each paragraph once (first seen first), over all questions and splits; the report
    counts questions (per split and type), passages, duplicates dropped, empty paragraphs left out and how bridge
    hops were ordered (`bridge_order`).

    Example:
        >>> row = {"id": "a1", "question": "Is Ulm a city?", "answer": "yes", "type": "comparison",
        ...        "supporting_facts": {"title": ["Ulm"], "sent_id": [0]},
        ...        "context": {"title": ["Ulm", "Bonn"], "sentences": [["Ulm is a city."], ["Bonn is a city."]]}}
        >>> rows, corpus, report = convert_hotpotqa({"train": [("t.jsonl, row 1", row)], "dev": [("d.jsonl, row 1", row)]})
        Traceback (most recent call last):
        mempo_trl.data.DataError: d.jsonl, row 1: field 'id' is 'a1', the id of t.jsonl, row 1 (split train) too. A question must be in one split only: remove it from one of them.
    """
    seen: dict[str, tuple[str, str]] = {}
    checked: dict[str, list[dict]] = {}
    for split, rows in splits.items():
        checked[split] = []
        for where, raw in rows:
            row = normalize_row(raw) if isinstance(raw, dict) else raw
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}. Write one {HUB_ROW}.")
            check_row(row, where)
            key = str(row["id"])
            if key in seen:
                first, first_split = seen[key]
                raise _fail(
                    where,
                    "id",
                    f"is {key!r}, the id of {first} (split {first_split}) too",
                    "A question must be in one split only: remove it from one of them."
                    if first_split != split
                    else "Give every question its own id.",
                )
            seen[key] = (where, split)
            checked[split].append(row)
    out: dict[str, list[dict]] = {}
    corpus: dict[str, dict] = {}
    paragraphs = empty = missing = 0
    rules: Counter = Counter()
    for split, rows in checked.items():
        out[split] = []
        for row in rows:
            qa, rule, lost = qa_row(row)
            out[split].append(qa)
            rules[rule] += 1
            missing += lost
            passages = row_passages(row)
            paragraphs += len(row["context"]["title"])
            empty += len(row["context"]["title"]) - len(passages)
            corpus.update((p["id"], p) for p in passages if p["id"] not in corpus)
    report = {
        "splits": {
            split: {"questions": len(rows), **{t: sum(r["type"] == t for r in rows) for t in TYPES}}
            for split, rows in out.items()
        },
        "passages": len(corpus),
        "paragraphs_read": paragraphs,
        "duplicates_dropped": paragraphs - empty - len(corpus),
        "empty_paragraphs_dropped": empty,
        "supporting_sentences_missing": missing,
        "hop_order_rules": dict(sorted(rules.items())),
        "license": LICENSE,
    }
    return out, list(corpus.values()), report


def gold_recall(rows: Sequence[dict], retriever, ks: Sequence[int] = (1, 3, 5, 10), batch_size: int = 64) -> dict:
    """How often one search with the question as the query finds the gold paragraphs: for each k of ``ks``, the
    share of ``rows`` (with ``supporting_ids``) whose top k results hold at least one (``one``) and all (``all``) of
    them, overall and per ``data_source``.

    Example:
        >>> class Fixed:  # always returns the passages "a", then "b", then "c"
        ...     def search(self, queries, topk):
        ...         return [[type("P", (), {"id": i})() for i in "abc"[:topk]] for _ in queries]
        >>> rows = [{"question": "q1", "supporting_ids": ["b", "c"], "data_source": "x"},
        ...         {"question": "q2", "supporting_ids": ["a", "z"], "data_source": "x"}]
        >>> gold_recall(rows, Fixed(), ks=(1, 3))["one"], gold_recall(rows, Fixed(), ks=(1, 3))["all"]
        ({'1': 0.5, '3': 1.0}, {'1': 0.0, '3': 0.5})
    """
    found: list[tuple[str, list[int]]] = []  # per row: its data source, the rank (1-based) of each gold paragraph
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        results = retriever.search([row["question"] for row in batch], max(ks))
        for row, passages in zip(batch, results):
            ranks = {str(p.id): rank for rank, p in enumerate(passages, 1)}
            gold = [ranks.get(str(pid), len(passages) + max(ks) + 1) for pid in row["supporting_ids"]]
            found.append((row.get("data_source", "unknown"), gold))

    def shares(ranks: list[list[int]]) -> dict:
        n = max(len(ranks), 1)
        return {
            "questions": len(ranks),
            "one": {str(k): round(sum(min(r) <= k for r in ranks) / n, 4) for k in ks},
            "all": {str(k): round(sum(max(r) <= k for r in ranks) / n, 4) for k in ks},
        }

    sources = sorted({source for source, _ in found})
    return {
        **shares([r for _, r in found]),
        "by_data_source": {s: shares([r for source, r in found if source == s]) for s in sources},
    }
