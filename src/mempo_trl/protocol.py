"""The MemPO turn protocol: the rules of the game (`TurnProtocol`, its prompts and round messages), parse one
assistant turn, render environment and gold texts, locate token spans.

One assistant turn is ``<mem>…</mem>``, ``<think>…</think>``, then exactly one of ``<search>…</search>`` or
``<answer>…</answer>``, with nothing but whitespace outside the tags (docs/algorithm.md, "Turn protocol"). With a
TRL-style environment (`mempo_trl.environments`) the tool action is ``<tool_call>…</tool_call>`` instead of
``<search>``: the tool-call tags of Qwen2.5 / Hermes chat templates, holding ``{"name": ..., "arguments": {...}}``.

`TurnProtocol` holds the settings of that game (prompts, turn budget, context mode, context budget, action tags) as
one object: the trainer builds it from `MemPOConfig`, saves it next to the weights (``mempo_agent.json``), and the
rollout, the agent, the evaluation and the callbacks all play by it; `mempo_trl.context` renders its contexts.
"""

import json
import os
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from mempo_trl.settings import field_type_problems, setting, setting_problems


MEMPO_TAGS: tuple[str, ...] = (
    "<mem>",
    "</mem>",
    "<think>",
    "</think>",
    "<search>",
    "</search>",
    "<information>",
    "</information>",
    "<answer>",
    "</answer>",
)

NO_RESULTS = "No results."

SEARCH_ACTIONS = ("search", "answer")
"""The actions of the search task."""
TOOL_ACTIONS = ("tool_call", "answer")
"""The actions of a TRL-style environment: a call of one of its tools, or the final answer."""
ACTION_STOPS = tuple(f"</{action}>" for action in SEARCH_ACTIONS)
"""The strings that end a search-task turn: ``</search>``, ``</answer>``."""
TOOL_STOPS = tuple(f"</{action}>" for action in TOOL_ACTIONS)
"""The strings that end an environment turn: ``</tool_call>``, ``</answer>``."""


def _tag_re(actions: Sequence[str]) -> re.Pattern[str]:
    return re.compile(r"<(/?)(" + "|".join(("mem", "think", *actions, "information")) + r")>")


_TAG_RES = {actions: _tag_re(actions) for actions in (SEARCH_ACTIONS, TOOL_ACTIONS)}


@dataclass(frozen=True)
class Turn:
    """The parse of one assistant turn.

    ``mem``/``mem_chars`` are set whenever the text holds a well-formed mem block (the first ``<mem>`` tag directly
    followed by ``</mem>``), even if the turn is otherwise invalid; ``think``, ``action`` and ``content`` only for
    valid turns. Inner texts are stripped; ``mem_chars`` is the character span ``[start, end)`` from ``<`` of ``<mem>``
    to past ``</mem>`` (`locate_mem_span` maps it to ``mem_span``, the inclusive token span of training rows).
    """

    valid: bool
    reason: str | None
    mem: str | None
    think: str | None
    action: Literal["search", "tool_call", "answer"] | None
    content: str | None
    mem_chars: tuple[int, int] | None


def _first_mem_block(text: str, tags: list[re.Match[str]]) -> tuple[str, tuple[int, int]] | None:
    """Inner text and span of the first ``<mem>`` tag if the next tag after it is ``</mem>``."""
    for k, tag in enumerate(tags):
        if tag.group(2) == "mem" and not tag.group(1):
            if k + 1 < len(tags) and tags[k + 1].group(0) == "</mem>":
                close = tags[k + 1]
                return text[tag.end() : close.start()].strip(), (tag.start(), close.end())
            return None
    return None


def parse_turn(text: str, actions: tuple[str, ...] = SEARCH_ACTIONS) -> Turn:
    """Parse one assistant turn; never raises.

    Invalid on missing, unclosed, nested, repeated or out-of-order tags, no action, two actions, non-whitespace text
    outside the tags, an ``<information>`` tag written by the model, or an empty query/answer. ``actions`` are the
    action tags (`SEARCH_ACTIONS`, or `TOOL_ACTIONS` for an environment); other tags are plain text.

    >>> t = parse_turn("<mem>m</mem> <think>t</think> <answer> Paris </answer>")
    >>> (t.valid, t.action, t.content, t.mem_chars)
    (True, 'answer', 'Paris', (0, 12))
    >>> parse_turn("<mem>m</mem><answer>x</answer>").reason
    'missing <think> block'
    >>> parse_turn('<mem>m</mem><think>t</think><tool_call>{"name": "f"}</tool_call>', TOOL_ACTIONS).action
    'tool_call'
    """
    pattern = _TAG_RES.get(actions) or _tag_re(actions)
    tags = list(pattern.finditer(text))
    mem_block = _first_mem_block(text, tags)
    mem, mem_chars = mem_block if mem_block is not None else (None, None)

    def invalid(reason: str) -> Turn:
        return Turn(False, reason, mem, None, None, None, mem_chars)

    if any(tag.group(2) == "information" for tag in tags):
        return invalid("the model wrote an <information> tag")
    blocks: list[tuple[str, str]] = []
    cursor = 0
    opened: re.Match[str] | None = None
    for tag in tags:
        closing, name = bool(tag.group(1)), tag.group(2)
        if opened is None:
            if closing:
                return invalid(f"</{name}> without a matching <{name}>")
            if text[cursor : tag.start()].strip():
                return invalid(f"text outside tags before <{name}>")
            opened = tag
        elif not closing:
            return invalid(f"<{name}> inside the unclosed <{opened.group(2)}>")
        elif name != opened.group(2):
            return invalid(f"</{name}> closes <{opened.group(2)}>")
        else:
            blocks.append((name, text[opened.end() : tag.start()].strip()))
            cursor, opened = tag.end(), None
    if opened is not None:
        return invalid(f"unclosed <{opened.group(2)}>")
    if not blocks:
        return invalid("no tags")
    if text[cursor:].strip():
        return invalid("text outside tags after the last block")

    names = [name for name, _ in blocks]
    for name in ("mem", "think"):
        if names.count(name) == 0:
            return invalid(f"missing <{name}> block")
        if names.count(name) > 1:
            return invalid(f"repeated <{name}> block")
    written = [name for name in names if name in actions]
    if not written:
        return invalid("no action: expected " + " or ".join(f"<{a}>" for a in actions))
    if len(written) > 1:
        return invalid("more than one action")
    if names != ["mem", "think", written[0]]:
        return invalid("tags out of order: expected <mem>, <think>, then the action")
    content = blocks[2][1]
    if not content:
        return invalid(f"empty <{written[0]}>")
    return Turn(True, None, mem, blocks[1][1], written[0], content, mem_chars)


def extract_answer(turn_texts: Sequence[str]) -> str | None:
    """The answer of the last turn if it is a valid answer turn, else ``None``.

    >>> extract_answer(["<mem>a</mem><think>b</think><search>q</search>", "<mem>a</mem><think>b</think><answer>x</answer>"])
    'x'
    >>> extract_answer(["<mem>a</mem><answer>x</answer>"]) is None
    True
    """
    if not turn_texts:
        return None
    turn = parse_turn(turn_texts[-1])
    return turn.content if turn.valid and turn.action == "answer" else None


def split_answers(answer: str) -> list[str]:
    """Split a multi-objective answer on ``;``; parts are stripped and empty parts kept, so positions stay aligned.

    >>> split_answers("Ulm;  Max ; ")
    ['Ulm', 'Max', '']
    """
    return [part.strip() for part in answer.split(";")]


def _field(passage: Any, key: str) -> str:
    value = passage[key] if isinstance(passage, Mapping) else getattr(passage, key)
    return str(value).strip()


def render_information(passages: Sequence[Any]) -> str:
    """Search-R1 style result message; passages have ``.title``/``.text`` or are dicts with those keys.

    An empty result list renders as ``<information>No results.</information>``.

    >>> render_information([{"title": "Ulm", "text": "A city."}, {"title": "B", "text": "C."}])
    '<information>Doc 1(Title: Ulm) A city.\\nDoc 2(Title: B) C.</information>'
    """
    docs = [f"Doc {i}(Title: {_field(p, 'title')}) {_field(p, 'text')}" for i, p in enumerate(passages, start=1)]
    return "<information>" + ("\n".join(docs) if docs else NO_RESULTS) + "</information>"


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


def locate_char_span(offsets: Sequence[tuple[int, int]], char_start: int, char_end: int) -> tuple[int, int] | None:
    """Inclusive token indices of the first token covering ``char_start`` and the last covering ``char_end - 1``.

    ``offsets`` are per-token ``[start, end)`` char offsets; ``None`` if the span is empty or not covered.

    >>> locate_char_span([(0, 3), (3, 5), (5, 5), (5, 9)], 4, 6)
    (1, 3)
    """
    if char_end <= char_start:
        return None
    first = next((i for i, (s, e) in enumerate(offsets) if s <= char_start < e), None)
    last = next((i for i in reversed(range(len(offsets))) if offsets[i][0] <= char_end - 1 < offsets[i][1]), None)
    if first is None or last is None:
        return None
    return first, last


def _stream_pieces(backend: Tokenizer, ids: list[int], text: str) -> list[str] | None:
    """Per-token text pieces from streaming decoding, or ``None`` if they do not concatenate to ``text``.

    The stream holds text back while a token ends inside a multi-byte char (``" \\xef"`` of ``" ﬁ"``) and releases
    it with a later token; the released text is split back over those tokens, each keeping the chars it completes.
    """
    stream = DecodeStream(skip_special_tokens=False)
    pieces: list[str] = []
    held = 0  # tokens at the end of `pieces` whose text the stream holds back
    try:
        for i, token_id in enumerate(ids):
            piece = stream.step(backend, token_id)
            if piece is None:
                pieces.append("")
                held += 1
                continue
            if held:
                start, done = i - held, 0
                for k in range(start, i):
                    window = backend.decode(ids[start : k + 1], skip_special_tokens=False)
                    end = max(done, len(os.path.commonprefix([window, piece])))
                    pieces[k], done = piece[done:end], end
                piece, held = piece[done:], 0
            pieces.append(piece)
    except Exception:  # decoders that rewrite across tokens make the stream raise "Invalid prefix"
        return None
    return pieces if "".join(pieces) == text else None


def token_char_offsets(token_ids: Sequence[int], tokenizer: Any) -> tuple[str, list[tuple[int, int]]]:
    """Decoded text (special tokens kept) and each token's exact ``[start, end)`` char offsets in it.

    A char belongs to the token that completes it, so a token holding only the leading bytes of a multi-byte char
    gets an empty span; the spans tile the text. ``tokenizer`` is a HF fast tokenizer, a ``tokenizers.Tokenizer``,
    or anything with ``decode(ids, skip_special_tokens=False)``. Fast path: O(n) streaming decoding, checked against
    the full decode; otherwise the offsets come from decoding every prefix (the common prefix with the full text).

    >>> token_char_offsets([5, 6], tokenizer)  # doctest: +SKIP
    ('<mem>', [(0, 4), (4, 5)])
    """
    ids = [int(t) for t in token_ids]
    backend = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        text = backend.decode(ids, skip_special_tokens=False)
        pieces = _stream_pieces(backend, ids, text)
        if pieces is not None:
            offsets, start = [], 0
            for piece in pieces:
                offsets.append((start, start + len(piece)))
                start += len(piece)
            return text, offsets

        def decode(prefix: list[int]) -> str:
            return backend.decode(prefix, skip_special_tokens=False)

    else:

        def decode(prefix: list[int]) -> str:
            return tokenizer.decode(prefix, skip_special_tokens=False)

    text = decode(ids)
    bounds = [0]
    for i in range(1, len(ids)):
        common = len(os.path.commonprefix([decode(ids[:i]), text]))
        bounds.append(max(bounds[-1], common))
    bounds.append(len(text))
    return text, list(zip(bounds[:-1], bounds[1:]))[: len(ids)]


def locate_mem_span(
    token_ids: Sequence[int], tokenizer: Any, actions: tuple[str, ...] = SEARCH_ACTIONS
) -> tuple[int, int] | None:
    """Inclusive token indices from the first token of ``<mem>`` to the last of ``</mem>`` in one turn's ids.

    Uses the well-formed mem block of :func:`parse_turn` on the decoded text; exact whether a tag is one token or
    several. ``None`` when the turn has no well-formed mem block.

    >>> locate_mem_span(tokenizer.encode("<mem>a</mem><think>b</think>"), tokenizer)  # doctest: +SKIP
    (0, 2)
    """
    text, offsets = token_char_offsets(token_ids, tokenizer)
    span = parse_turn(text, actions).mem_chars
    return None if span is None else locate_char_span(offsets, *span)


ContextMode = Literal["memory", "full_history"]
CONTEXT_MODES = ("memory", "full_history")
CONTEXT_OVERFLOWS = ("end_episode", "truncate_information")


PROTOCOL_FILE = "mempo_agent.json"

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


def round_messages(
    base: list[dict[str, str]],
    history: Sequence[tuple[str, str]],
    context_mode: ContextMode = "memory",
) -> list[dict[str, str]]:
    """Messages that generate the next round, from the round-1 messages and the finished rounds.

    Args:
        base: the round-1 messages (`initial_messages`).
        history: one ``(assistant_output, information_block)`` pair per finished round, oldest first.
        context_mode: ``"memory"`` keeps only the last pair; ``"full_history"`` keeps them all.

    Example:
        >>> base = initial_messages("q")
        >>> len(round_messages(base, [("<mem>a</mem>...", "<information>x</information>")] * 3))
        4
    """
    if context_mode not in CONTEXT_MODES:
        raise ValueError(f"context_mode must be one of {CONTEXT_MODES}, got {context_mode!r}.")
    kept = history if context_mode == "full_history" else history[-1:]
    messages = list(base)
    for output, information in kept:
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


def stop_token_ids(
    tokenizer, model_eos: int | Sequence[int] | None = None, stops: Sequence[str] = ACTION_STOPS
) -> list[int]:
    """Ids that end a turn: ``model_eos``, the tokenizer's eos, and each stop tag (``stops``) that is one token.

    Example:
        >>> ids = stop_token_ids(tokenizer)  # doctest: +SKIP
        >>> tokenizer.convert_ids_to_tokens(ids)  # doctest: +SKIP
        ['<|im_end|>', '</search>', '</answer>']
    """
    ids = [] if model_eos is None else [model_eos] if isinstance(model_eos, int) else list(model_eos)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    for stop in stops:
        tag_ids = tokenizer(stop, add_special_tokens=False)["input_ids"]
        if len(tag_ids) == 1:
            ids.append(tag_ids[0])
    return list(dict.fromkeys(int(i) for i in ids))


@dataclass(frozen=True)
class TurnProtocol:
    """How a MemPO episode is played: the prompts, the turn budget, the context rebuild, the context budget, the
    action tags and the chat template's variables.

    The fields of the same names in `MemPOConfig` build it (`from_config`); ``action`` is ``"search"`` for the search
    task and ``"tool_call"`` for a TRL-style environment (`for_environment`). ``max_context_tokens`` (None: no budget)
    is the longest context a round may have; with the generation backend's own limit, the smaller one binds
    (`context_limit`), and ``context_overflow`` says what happens to a longer context (`RolloutEngine`). Training
    saves it next to the weights (`save`) and `MemPOAgent.from_pretrained` reads it back, so that an agent plays
    exactly the protocol it was trained on.

    Example:
        >>> protocol, messages = TurnProtocol(max_turns=4).override(max_turns=6, retrieval_topk=None)
        >>> protocol.max_turns, messages
        (6, ['max_turns=6 overrides the saved max_turns=4'])
        >>> TurnProtocol().stops, TurnProtocol().for_environment().stops
        (('</search>', '</answer>'), ('</tool_call>', '</answer>'))
    """

    system_prompt: str = setting(DEFAULT_SYSTEM_PROMPT, "System message of every context.")
    instruction: str = setting(DEFAULT_INSTRUCTION, "User message template with a `{question}` placeholder.")
    max_turns: int = setting(8, "Rounds per episode at most.", minimum=1)
    retrieval_topk: int = setting(3, "Passages returned for each search.", minimum=1)
    context_mode: ContextMode = setting(
        "memory", "`memory` (MemPO) or `full_history` (Search-R1 baseline).", choices=CONTEXT_MODES
    )
    max_completion_length: int = setting(512, "Tokens per turn at most.", minimum=1)
    max_context_tokens: int | None = setting(
        None,
        "Longest context (prompt tokens) a round may have; longer: `context_overflow`. None: no budget.",
        minimum=1,
    )
    context_overflow: Literal["end_episode", "truncate_information"] = setting(
        "end_episode",
        "A context longer than the generation backend takes: `end_episode` or `truncate_information`.",
        choices=CONTEXT_OVERFLOWS,
    )
    action: Literal["search", "tool_call"] = setting(
        "search",
        "`search` (the search task) or `tool_call` (a TRL-style environment).",
        choices=("search", "tool_call"),
    )
    chat_template_kwargs: dict[str, Any] | None = setting(
        None, "Extra variables of the chat template for every context (e.g. `enable_thinking`); TRL's field."
    )

    def __post_init__(self):
        """Refuse values a protocol cannot be played with, with the rules of `MemPOConfig` (types first)."""
        problems = field_type_problems(self, strict=True)
        for name in ("system_prompt", "instruction"):
            if not isinstance(getattr(self, name), str):
                problems.append(f"{name} must be a string, got {getattr(self, name)!r}.")
        kwargs = self.chat_template_kwargs
        if kwargs is not None and (not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs)):
            problems.append(f"chat_template_kwargs must be a mapping of names to values (or null), got {kwargs!r}.")
        problems += self.problems(self)
        if problems:
            raise ValueError(" ".join(problems))

    @classmethod
    def problems(cls, values: Any) -> list[str]:
        """Why ``values`` (a protocol, a `MemPOConfig` or the overrides of an agent: the fields it has) cannot be
        played: choices, bounds and the instruction template."""
        problems = setting_problems(cls, values)
        if isinstance(getattr(values, "instruction", None), str):
            problems += instruction_problems(values.instruction)
        return problems

    def context_limit(self, backend_limit: int | None) -> int | None:
        """The longest context (tokens) a round may have: ``backend_limit`` (what the generation backend takes; None:
        unknown) or ``max_context_tokens``, whichever is smaller; None when neither is set.

        Example:
            >>> TurnProtocol(max_context_tokens=900).context_limit(3584), TurnProtocol().context_limit(3584)
            (900, 3584)
        """
        limits = [limit for limit in (backend_limit, self.max_context_tokens) if limit is not None]
        return min(limits, default=None)

    @property
    def stops(self) -> tuple[str, ...]:
        """The strings that end a turn: ``</search>``/``</answer>``, or ``</tool_call>``/``</answer>``."""
        return ACTION_STOPS if self.action == "search" else TOOL_STOPS

    def for_environment(self) -> "TurnProtocol":
        """The protocol for a TRL-style environment: tool-call actions, and `ENVIRONMENT_INSTRUCTION` in place of the
        default search instruction (a custom instruction is kept)."""
        instruction = ENVIRONMENT_INSTRUCTION if self.instruction == DEFAULT_INSTRUCTION else self.instruction
        return replace(self, action="tool_call", instruction=instruction)

    def stop_token_ids(self, tokenizer, model_eos: int | Sequence[int] | None = None) -> list[int]:
        """Ids that end a turn of this protocol (`stop_token_ids` with its `stops`)."""
        return stop_token_ids(tokenizer, model_eos, self.stops)

    def initial_messages(self, question: str) -> list[dict[str, str]]:
        """Round-1 messages of ``question`` (`initial_messages` with this protocol's prompts)."""
        return initial_messages(question, self.system_prompt, self.instruction)

    def round_messages(self, base: list[dict[str, str]], history: Sequence[tuple[str, str]]) -> list[dict[str, str]]:
        """Messages of the next round (`round_messages` in this protocol's context mode)."""
        return round_messages(base, history, self.context_mode)

    @classmethod
    def from_config(cls, config, environment: bool = False) -> "TurnProtocol":
        """The protocol of a `MemPOConfig` (or anything with the same attributes); ``environment``: `for_environment`."""
        protocol = cls(**{f.name: getattr(config, f.name) for f in fields(cls) if f.name != "action"})
        return protocol.for_environment() if environment else protocol

    def save(self, directory: str | Path) -> Path:
        """Write ``mempo_agent.json`` into ``directory``; return its path."""
        path = Path(directory) / PROTOCOL_FILE
        path.write_text(json.dumps(asdict(self), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return path

    @classmethod
    def from_pretrained(cls, path_or_hub_id: str | Path, revision: str | None = None) -> "TurnProtocol | None":
        """The protocol saved with a model (a directory or a Hub id), or None when it has none; a file that does not
        hold a valid protocol raises `ValueError` naming it."""
        path = Path(path_or_hub_id, PROTOCOL_FILE)
        if not path.is_file():
            if Path(path_or_hub_id).exists():
                return None
            from huggingface_hub import hf_hub_download
            from huggingface_hub.errors import EntryNotFoundError, HFValidationError, LocalEntryNotFoundError

            try:
                path = Path(hf_hub_download(str(path_or_hub_id), PROTOCOL_FILE, revision=revision))
            except (EntryNotFoundError, LocalEntryNotFoundError, HFValidationError, OSError):
                return None
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(saved, dict):
                raise ValueError(f"it holds {type(saved).__name__} {_short(saved)}, not a JSON object of settings")
            known = {f.name for f in fields(cls)}
            return cls(**{key: value for key, value in saved.items() if key in known})
        except ValueError as err:  # JSON, encoding (UnicodeDecodeError) and the checks of __post_init__
            raise ValueError(f"{path}: not a valid turn protocol ({err}); delete it or save it again") from None

    def override(self, **values: Any) -> tuple["TurnProtocol", list[str]]:
        """Replace the fields given with a value other than None; one message per field that changes.

        Example:
            >>> TurnProtocol().override(max_turns=None)[1]
            []
        """
        given = {key: value for key, value in values.items() if value is not None}
        messages = [
            f"{key}={_short(value)} overrides the saved {key}={_short(getattr(self, key))}"
            for key, value in given.items()
            if value != getattr(self, key)
        ]
        return replace(self, **given), messages


def _short(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def instruction_problems(instruction: str) -> list[str]:
    """Why `instruction` cannot be filled with `instruction.format(question=...)` (empty list if it can).

    Example:
        >>> instruction_problems("Q: {question} {other}")
        ['instruction may only use the `{question}` placeholder, got {other}; write a literal brace as {{ or }}.']
    """
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(instruction) if name is not None}
    except ValueError as e:
        return [f"instruction is not a valid template ({e}); write a literal brace as {{{{ or }}}}."]
    problems = []
    if "question" not in names:
        problems.append("instruction must contain the `{question}` placeholder.")
    others = sorted(names - {"question"})
    if others:
        shown = ", ".join("{" + name + "}" for name in others)
        problems.append(
            f"instruction may only use the `{{question}}` placeholder, got {shown}; write a literal brace as "
            "{{ or }}."
        )
    return problems
