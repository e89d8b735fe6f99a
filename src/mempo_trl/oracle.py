"""The oracle teacher: a scripted agent that plays rows with known hops through the real protocol (`OracleTeacher`).

A row with ``hop_queries`` (one search per hop, in order) and the facts each hop finds (``hop_facts``, as
`mempo-trl hotpotqa` writes them; the demo world's rows get theirs from their templates, `hop_facts`) is played as:
round r searches the next hop's query with the real retriever; when the hop's gold paragraph (``supporting_ids``) is
not among the results it searches again with the paragraph's title (``supporting_titles``), and when that misses too
the oracle gives up (a turn without an action: the episode ends unanswered, never kept). Its ``<mem>`` holds the facts
of the hops found so far, its ``<think>`` one short sentence, and the last round answers the gold answer
(`mempo_trl.context.render_gold_answer`). `mempo-trl distill --teacher oracle` plays it as a `GenerateFn`, so that its
turns go through the same turn parsing, searches, context rebuild and SFT rows as a model teacher's.

The offline kit's warm start (`mempo_trl.kit.warmstart.oracle_episode_turns`) writes its turns with the same
`turn_text`, thoughts and facts.
"""

import re
from collections.abc import Sequence
from typing import Any

from mempo_trl.context import render_gold_answer


NOTHING_YET = "Nothing yet."
SEARCH_THOUGHT = "I must search."
RETRY_THOUGHT = "The search missed it. I search its title."
ANSWER_THOUGHT = "I know the answer."
GIVE_UP_THOUGHT = "The search did not find it."

_WORD_RE = re.compile(r"[\w,'-]+|[^\w\s]")
# The value a comparison hop reads from its passage, keyed by a word of the hop query (demo-world templates).
_COMPARED_VALUE = {
    "population": re.compile(r"population of ([\d,]+)"),
    "born": re.compile(r"born in (\d+)"),
    "founded": re.compile(r"founded in (\d+)"),
    "long": re.compile(r"([\d,]+) kilometres long"),
    "height": re.compile(r"height of ([\d,]+) metres"),
}


def turn_text(facts: Sequence[str], thought: str, action: str) -> str:
    """An oracle turn: ``<mem>`` with ``facts`` (or `NOTHING_YET`), ``<think>`` with ``thought``, then ``action``.

    Example:
        >>> print(turn_text([], SEARCH_THOUGHT, "<search> Who founded Orbix? </search>"))
        <mem> Nothing yet. </mem>
        <think> I must search. </think>
        <search> Who founded Orbix? </search>
    """
    mem = " ".join(fact for fact in facts if fact) or NOTHING_YET
    return f"<mem> {mem} </mem>\n<think> {thought} </think>\n{action}".rstrip()


def subject(query: str) -> str:
    """The first run of capitalised words after the question word: the entity a single-hop query asks about.

    >>> subject("In which city was Tisdin Purbro born?")
    'Tisdin Purbro'
    """
    words = query.rstrip("?").split()[1:]
    start = next(i for i, word in enumerate(words) if word[0].isupper())
    end = next((i for i in range(start, len(words)) if not words[i][0].isupper()), len(words))
    return " ".join(words[start:end])


def _bridge(question: str, next_query: str) -> str:
    """The bridge entity: what ``next_query`` says where ``question`` has its bridge phrase (word-level diff)."""
    a, b = _WORD_RE.findall(question), _WORD_RE.findall(next_query)
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    return " ".join(b[head : len(b) - tail])


def _compared_value(query: str, passage_text: str) -> str:
    for word, pattern in _COMPARED_VALUE.items():
        if word in query and (match := pattern.search(passage_text)):
            return match.group(1)
    raise ValueError(f"no compared value for {query!r} in {passage_text!r}")


def hop_fact(row: dict, hop: int, passages: Sequence[Any]) -> str:
    """What hop ``hop`` (0-based) of a row finds: its ``hop_facts`` entry when it has them, else (a demo-world row)
    ``"Subject: value."``, read from the templates; ``passages`` are the hop's search results.

    A demo hop's value is the gold answer for the last hop, the bridge entity named by the next hop query for an
    earlier one, the sub-answer of a multi-objective row, and for a comparison the number read from the supporting
    passage (which must be among ``passages``).
    """
    if row.get("hop_facts"):
        return row["hop_facts"][hop]
    queries = row["hop_queries"]
    query = queries[hop]
    if row.get("sub_answers"):
        value = str(row["sub_answers"][hop][0])
    elif row.get("data_source") == "demo_compare":
        passage = next((p for p in passages if p.id == row["supporting_ids"][hop]), None)
        if passage is None:
            raise ValueError(f"the search {query!r} did not return passage {row['supporting_ids'][hop]}")
        value = _compared_value(query, passage.text)
    elif hop + 1 < len(queries):
        value = _bridge(row["question"], queries[hop + 1])
    else:
        value = str(row["golden_answers"][0])
    return f"{subject(query)}: {value}."


def hop_facts(row: dict, results: Sequence[Sequence[Any]]) -> list[str]:
    """`hop_fact` of every hop of ``row``; ``results`` are the hops' passages.

    Example:
        >>> row = {"question": "What is the population of the birthplace of Tisdin Purbro?",
        ...        "golden_answers": ["634,400"], "data_source": "demo_2hop", "supporting_ids": ["52", "93"],
        ...        "hop_queries": ["In which city was Tisdin Purbro born?", "What is the population of Sedo?"],
        ...        "sub_answers": []}
        >>> hop_facts(row, [[], []])
        ['Tisdin Purbro: Sedo.', 'Sedo: 634,400.']
    """
    return [hop_fact(row, hop, passages) for hop, passages in enumerate(results)]


def row_problem(row: dict) -> str | None:
    """Why the oracle cannot play ``row`` (its field and the fix), or None.

    Example:
        >>> row_problem({"question": "Who?", "golden_answers": ["Ada"], "hop_queries": ["Who?"], "hop_facts": []})
        "field 'hop_facts' has 0 entries but 'hop_queries' has 1: give one per hop"
    """
    queries = row.get("hop_queries")
    if not isinstance(queries, list) or not queries or not all(isinstance(q, str) and q.strip() for q in queries):
        return (
            f"field 'hop_queries' is {queries!r:.80}: the oracle teacher needs one search query per hop (rows of "
            "`mempo-trl hotpotqa`, or the demo world's)"
        )
    for name in ("hop_facts", "supporting_ids", "supporting_titles"):
        value = row.get(name)
        if value is not None and (not isinstance(value, list) or len(value) != len(queries)):
            size = len(value) if isinstance(value, list) else type(value).__name__
            return f"field {name!r} has {size} entries but 'hop_queries' has {len(queries)}: give one per hop"
    if row.get("hop_facts") is None:
        sub_answers = row.get("sub_answers") or []
        if not str(row.get("data_source", "")).startswith("demo_") or len(sub_answers) not in (0, len(queries)):
            return (
                "field 'hop_facts' is missing: give the facts each hop finds (rows of `mempo-trl hotpotqa` have "
                "them; the demo world's single-question rows are read from their templates)"
            )
    return None


def oracle_turns(row: dict, retriever, topk: int = 3, max_turns: int = 8) -> list[str]:
    """The oracle's turns on ``row`` (see the module docstring), searching ``retriever`` with ``topk`` as the
    rollout will: one search per hop, one more with the title of a hop whose gold paragraph (``supporting_ids``; a
    row without them counts every hop as found) is not in the results, the answer last. When a paragraph stays
    missing, or ``max_turns`` leaves no room to search and then answer, the last turn gives up (no action).

    Example:
        >>> turns = oracle_turns(hotpotqa_row, BM25Retriever.from_corpus("data/hotpotqa/corpus.jsonl"))  # doctest: +SKIP
        >>> print(turns[-1])  # doctest: +SKIP
        <mem> Tinted Windows is the eponymous debut album ... in Tulsa, Oklahoma ... </mem>
        <think> I know the answer. </think>
        <answer> Tulsa </answer>
    """
    problem = row_problem(row)
    if problem is not None:
        raise ValueError(f"row {row.get('id')!r}: {problem}")
    queries, ids = row["hop_queries"], row.get("supporting_ids")
    titles = row.get("supporting_titles") or [None] * len(queries)
    turns: list[str] = []
    found: list[str] = []
    for i, query in enumerate(queries):
        tries = [(query, SEARCH_THOUGHT)] + ([(titles[i], RETRY_THOUGHT)] if titles[i] not in (None, query) else [])
        hit = None
        for search, thought in tries:
            if len(turns) + 2 > max_turns:  # no room for this search and the answer after it
                break
            turns.append(turn_text(found, thought, f"<search> {search} </search>"))
            passages = retriever.search([search], topk)[0]
            if ids is None or ids[i] in {str(p.id) for p in passages}:
                hit = passages
                break
        if hit is None:
            return turns + [turn_text(found, GIVE_UP_THOUGHT, "")]
        found.append(hop_fact(row, i, hit))
    answer, _ = render_gold_answer(row["golden_answers"], row.get("sub_answers"))
    return turns + [turn_text(found, ANSWER_THOUGHT, answer)]


class OracleTeacher:
    """A `mempo_trl.rollout.GenerateFn` that writes the `oracle_turns` of each episode's row, one round at a time.

    The rollout gives it the active episodes (``takes_episodes``); it returns round r's turn of each row's oracle
    plan as token ids (and an end-of-turn id), so the rollout parses it, runs its search and rebuilds the contexts as
    for a model's turn. The plan of a row is made once (its searches are deterministic, as the rollout's are).

    Example:
        >>> teacher = OracleTeacher(tokenizer, retriever, topk=3, max_turns=8)  # doctest: +SKIP
        >>> MemPOAgent(tokenizer, retriever, teacher, protocol).play(rows).episodes[0].answer  # doctest: +SKIP
        'Tulsa'
    """

    takes_episodes = True

    def __init__(self, tokenizer, retriever, topk: int = 3, max_turns: int = 8):
        self.tokenizer = tokenizer
        self.retriever = retriever
        self.topk = topk
        self.max_turns = max_turns
        self._plans: dict[tuple[str, str], list[str]] = {}

    def plan(self, row: dict) -> list[str]:
        """`oracle_turns` of ``row``, made once per row ``id`` and question."""
        key = (str(row.get("id")), row["question"])
        if key not in self._plans:
            self._plans[key] = oracle_turns(row, self.retriever, self.topk, self.max_turns)
        return self._plans[key]

    def __call__(self, prompts: list[list[int]], episodes: Sequence[Any] = ()) -> tuple[list[list[int]], None]:
        eos = [self.tokenizer.eos_token_id]
        completions = []
        for episode in episodes:
            text = self.plan(episode.row)[len(episode.rounds)]
            completions.append(self.tokenizer(text, add_special_tokens=False)["input_ids"] + eos)
        return completions + [eos] * (len(prompts) - len(completions)), None
