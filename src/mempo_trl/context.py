"""The one context builder of MemPO (docs/algorithm.md, "Context rebuild"), shared by training, evaluation and inference:
the prompts, the round messages, the rendering of search results and gold answers, and the scoring contexts.

Round t of an episode is generated from:

- t = 1: ``system + user(question)``;
- t > 1, ``context_mode="memory"`` (MemPO): ``system + user(question) + assistant(output of round t-1) +
  tool(<information> of round t-1)``. Nothing older is kept: what the model still needs must be in its ``<mem>``;
- t > 1, ``context_mode="full_history"`` (Search-R1 baseline): every earlier round's output and result.

Which finished rounds a context shows is one rule, `shown_rounds`, of the context rule ``context_mode`` names
(`CONTEXT_RULES`; a new one is one `register_context_rule` call). With a TRL-style environment
(`mempo_trl.environments`) the question is the task text its ``reset`` returned and the result of round t-1 is its
tool's result; the rebuild is the same.

The same builder renders the two scoring contexts of the memory reward: ``full_traj_t`` is the
full-history context of round t and ``mem_traj_t`` is ``system + user(question)`` followed by round t's ``<mem>``
block at the start of the assistant turn. `mempo_trl.protocol.TurnProtocol` holds the settings these functions take.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mempo_trl.registry import Registry


@dataclass(frozen=True)
class ContextRule:
    """A context rule: which finished rounds a context shows (``shown``: the rounds, oldest first, to those shown)
    and whether training scores the memory reward under it (``scores_memory``: the rule hides earlier rounds, so what
    the agent still needs has to be in its ``<mem>``; False: the memory advantage is off and the run says so)."""

    shown: Callable[[Sequence], Sequence]
    scores_memory: bool = True


CONTEXT_RULES = Registry("context_mode")
"""The context rules by name (`register_context_rule`): the choices of ``context_mode``."""

ContextMode = str
"""A name in `CONTEXT_RULES`."""


def register_context_rule(name: str, shown: Callable[[Sequence], Sequence], help: str, scores_memory: bool = True):
    """Add a context rule: ``context_mode=name`` then shows the rounds ``shown`` picks, and ``help`` is its line in
    the help of ``context_mode``. Returns the `ContextRule`.

    Example:
        >>> rule = register_context_rule("last_two_doc", lambda rounds: rounds[-2:], "the last two rounds")
        >>> shown_rounds([1, 2, 3], "last_two_doc"), rule.scores_memory
        ([2, 3], True)
        >>> _ = CONTEXT_RULES.pop("last_two_doc"), CONTEXT_RULES.helps.pop("last_two_doc")
    """
    return CONTEXT_RULES.register(name, ContextRule(shown, scores_memory), help)


def last_round(rounds: Sequence) -> Sequence:
    """The last finished round only (MemPO)."""
    return rounds[-1:]


def every_round(rounds: Sequence) -> Sequence:
    """Every finished round (append-only)."""
    return rounds


register_context_rule("memory", last_round, "MemPO, the last round only (what is older must be in its `<mem>`)")
register_context_rule(
    "full_history",
    every_round,
    "Search-R1 baseline, every round (TRL's append-only context; no memory reward)",
    scores_memory=False,
)

CONTEXT_MODES = CONTEXT_RULES.keys()
"""The names of the context rules, a live view (a rule registered later is one)."""

COMPARED_CONTEXT_MODES = ("memory", "full_history")
"""The two reference rules that ``--context_mode both`` and `mempo_trl.sweep` compare."""

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

DEFAULT_INSTRUCTION = (
    "Answer the question by searching a knowledge base. Every turn, first write <mem> ... </mem> with everything "
    "useful you know so far (only your latest turn and search result stay visible), then <think> ... </think>, then "
    "exactly one action: <search> query </search> to search, or <answer> final answer </answer> when you know it. "
    "For several questions, give the answers in order separated by ';'.\n\nQuestion: {question}"
)


def initial_messages(
    question: str, system_prompt: str = DEFAULT_SYSTEM_PROMPT, instruction: str = DEFAULT_INSTRUCTION
) -> list[dict[str, str]]:
    """Messages of round 1: ``system + user(instruction with the question)``.

    Example:
        >>> initial_messages("Who founded Orbix?")[1]["role"]
        'user'
    """
    return [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": instruction.format(question=question)},
    ]


def shown_rounds(rounds: Sequence, context_mode: ContextMode = "memory") -> Sequence:
    """The finished rounds a context shows, oldest first, by the rule ``context_mode`` names (`CONTEXT_RULES`): the
    last one (``"memory"``), all of them (``"full_history"``), ... The rebuild (`round_messages`) and the truncation
    of an overlong context (`mempo_trl.rollout.RolloutEngine.fit_prompt`) both follow this one rule.

    Example:
        >>> shown_rounds([1, 2, 3]), shown_rounds([1, 2, 3], "full_history"), shown_rounds([])
        ([3], [1, 2, 3], [])
    """
    return CONTEXT_RULES.resolve(context_mode).shown(rounds)


def scores_memory(context_mode: ContextMode) -> bool:
    """Whether training scores the memory reward under the rule ``context_mode`` names (`ContextRule`).

    Example:
        >>> scores_memory("memory"), scores_memory("full_history")
        (True, False)
    """
    return CONTEXT_RULES.resolve(context_mode).scores_memory


def round_messages(
    base: list[dict[str, str]],
    history: Sequence[tuple[str, str]],
    context_mode: ContextMode = "memory",
) -> list[dict[str, str]]:
    """Messages that generate the next round, from the round-1 messages and the finished rounds.

    Args:
        base: the round-1 messages (`initial_messages`).
        history: one ``(assistant_output, information_block)`` pair per finished round, oldest first.
        context_mode: the context rule (`shown_rounds`): ``"memory"`` keeps only the last pair,
            ``"full_history"`` keeps them all.

    Example:
        >>> base = initial_messages("q")
        >>> len(round_messages(base, [("<mem>a</mem>...", "<information>x</information>")] * 3))
        4
    """
    messages = list(base)
    for output, information in shown_rounds(history, context_mode):
        messages.append({"role": "assistant", "content": output})
        messages.append({"role": "tool", "content": information})
    return messages


ENVIRONMENT_INSTRUCTION = (
    "Solve the task with the tools. Every turn, first write <mem> ... </mem> with everything useful you know so far "
    "(only your latest turn and tool result stay visible), then <think> ... </think>, then exactly one action: "
    '<tool_call>{{"name": tool name, "arguments": {{...}}}}</tool_call> to call a tool, or <answer> final answer '
    "</answer> when you are done.\n\n{question}"
)
"""The default instruction of an environment task: `MemPOConfig.instruction` when it is left at the search one."""


NO_RESULTS = "No results."


def _field(passage: Any, key: str) -> str:
    value = passage[key] if isinstance(passage, Mapping) else getattr(passage, key)
    return str(value).strip()


def passages_text(passages: Sequence[Any]) -> str:
    """The text of a search result, Search-R1 style; passages have ``.title``/``.text`` or are dicts with those keys.
    An empty result list is ``No results.``.

    >>> passages_text([{"title": "Ulm", "text": "A city."}, {"title": "B", "text": "C."}])
    'Doc 1(Title: Ulm) A city.\\nDoc 2(Title: B) C.'
    """
    docs = [f"Doc {i}(Title: {_field(p, 'title')}) {_field(p, 'text')}" for i, p in enumerate(passages, start=1)]
    return "\n".join(docs) if docs else NO_RESULTS


def information_block(text: str) -> str:
    """The message a search result's ``text`` is shown as: ``<information>text</information>``.

    >>> information_block("No results.")
    '<information>No results.</information>'
    """
    return f"<information>{text}</information>"


def render_information(passages: Sequence[Any]) -> str:
    """Search-R1 style result message of ``passages``: `information_block` of their `passages_text`.

    >>> render_information([{"title": "Ulm", "text": "A city."}])
    '<information>Doc 1(Title: Ulm) A city.</information>'
    """
    return information_block(passages_text(passages))


def render_gold_answer(
    golden_answers: Sequence[str], sub_answers: Sequence[Sequence[str]] | None = None
) -> tuple[str, tuple[int, int]]:
    """``<answer> GOLD </answer>`` and the ``[start, end)`` char span of GOLD (the only scored part).

    GOLD is the first alias, or for multi-objective rows (non-empty ``sub_answers``) the first alias of each
    sub-question joined by ``"; "``. Raises ``ValueError`` when there is no alias to render.

    >>> render_gold_answer(["Paris", "paris, France"])
    ('<answer> Paris </answer>', (9, 14))
    >>> render_gold_answer([], [["Ulm"], ["Max", "M."]])[0]
    '<answer> Ulm; Max </answer>'
    """
    if sub_answers:
        if any(not aliases for aliases in sub_answers):
            raise ValueError("every sub-question needs at least one gold alias")
        gold = "; ".join(str(aliases[0]).strip() for aliases in sub_answers)
    elif golden_answers:
        gold = str(golden_answers[0]).strip()
    else:
        raise ValueError("golden_answers is empty and there are no sub_answers")
    prefix = "<answer> "
    return f"{prefix}{gold} </answer>", (len(prefix), len(prefix) + len(gold))


def render_prompt(
    tokenizer,
    messages: list[dict[str, str]],
    tools: list[dict] | None = None,
    chat_template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template and the generation prompt.

    ``tools``: the JSON schemas of an environment's tools (`mempo_trl.environments.tool_schemas`), rendered by the
    chat template (Qwen2.5's: in the system message); None for the search task, whose instruction teaches its action.
    ``chat_template_kwargs``: extra variables of the template (TRL's field of that name, e.g. ``enable_thinking``).
    """
    ids = tokenizer.apply_chat_template(
        messages,
        tools=tools or None,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        **(chat_template_kwargs or {}),
    )
    return list(ids["input_ids"])


@dataclass(frozen=True)
class ScoringItem:
    """A context and the answer continuation to score after it; ``answer_mask`` marks the GOLD tokens."""

    context_ids: list[int]
    answer_ids: list[int]
    answer_mask: list[int]


@dataclass(frozen=True)
class MemoryScoringPair:
    """The two scoring items of one round: ``round_index`` is 0-based (so always >= 1 here); ``answer_parts`` holds
    the part of each answer token (`gold_answer_parts`; empty: one part)."""

    round_index: int
    full: ScoringItem
    mem: ScoringItem
    answer_parts: tuple[int, ...] = ()


def gold_answer_tokens(tokenizer, golden_answers: Sequence[str], sub_answers=None) -> tuple[list[int], list[int]]:
    """Token ids of ``<answer> GOLD </answer>`` and the 0/1 mask of the tokens that overlap GOLD.

    Example:
        >>> ids, mask = gold_answer_tokens(tokenizer, ["Paris"])  # doctest: +SKIP
    """
    ids, mask, _ = gold_answer_encoding(tokenizer, golden_answers, sub_answers)
    return ids, mask


def gold_answer_parts(tokenizer, golden_answers: Sequence[str], sub_answers=None) -> list[int]:
    """The part of each token of ``<answer> GOLD </answer>`` (`gold_answer_tokens`' ids): 1 + the index of the
    sub-question whose alias the token overlaps first (multi-objective rows), 1 for every GOLD token of a single
    answer, 0 outside them (the tags, the ``"; "`` between parts).

    Example:
        >>> gold_answer_parts(tokenizer, [], [["Ulm"], ["Max"]])  # doctest: +SKIP
        [0, 0, 1, 0, 2, 0]
    """
    return gold_answer_encoding(tokenizer, golden_answers, sub_answers)[2]


def gold_answer_encoding(
    tokenizer, golden_answers: Sequence[str], sub_answers=None
) -> tuple[list[int], list[int], list[int]]:
    """`gold_answer_tokens`' ids and mask and `gold_answer_parts`' parts, from one tokenization."""
    text, (start, end) = render_gold_answer(golden_answers, sub_answers)
    spans, at = [], start
    for alias in [str(aliases[0]).strip() for aliases in sub_answers] if sub_answers else [text[start:end]]:
        spans.append((at, at + len(alias)))
        at += len(alias) + len("; ")
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    mask = [int(s < end and e > start) for s, e in offsets]
    parts = [next((k + 1 for k, (a, b) in enumerate(spans) if s < b and e > a), 0) for s, e in offsets]
    return list(encoded["input_ids"]), mask, parts


def memory_context_ids(tokenizer, base_ids: list[int], mem_block: str) -> list[int]:
    """The context P_mem is scored after: ``system + user(question)`` (``base_ids``, rendered) + the ``<mem>`` block
    as tokenized on its own (``<mem> ... </mem>``, no chat-template turn around it)."""
    return base_ids + tokenizer(mem_block, add_special_tokens=False)["input_ids"]
