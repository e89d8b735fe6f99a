"""The MemPO turn protocol: parse one assistant turn, render environment and gold texts, locate token spans.

One assistant turn is ``<mem>…</mem>``, ``<think>…</think>``, then exactly one of ``<search>…</search>`` or
``<answer>…</answer>``, with nothing but whitespace outside the tags (docs/algorithm.md, "Turn protocol"). With a
TRL-style environment (`mempo_trl.environments`) the tool action is ``<tool_call>…</tool_call>`` instead of
``<search>``: the tool-call tags of Qwen2.5 / Hermes chat templates, holding ``{"name": ..., "arguments": {...}}``.
"""

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


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

    ``mem``/``mem_span`` are set whenever the text holds a well-formed mem block (the first ``<mem>`` tag directly
    followed by ``</mem>``), even if the turn is otherwise invalid; ``think``, ``action`` and ``content`` only for
    valid turns. Inner texts are stripped; ``mem_span`` is ``[start, end)`` from ``<`` of ``<mem>`` to past ``</mem>``.
    """

    valid: bool
    reason: str | None
    mem: str | None
    think: str | None
    action: Literal["search", "tool_call", "answer"] | None
    content: str | None
    mem_span: tuple[int, int] | None


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
    >>> (t.valid, t.action, t.content, t.mem_span)
    (True, 'answer', 'Paris', (0, 12))
    >>> parse_turn("<mem>m</mem><answer>x</answer>").reason
    'missing <think> block'
    >>> parse_turn('<mem>m</mem><think>t</think><tool_call>{"name": "f"}</tool_call>', TOOL_ACTIONS).action
    'tool_call'
    """
    pattern = _TAG_RES.get(actions) or _tag_re(actions)
    tags = list(pattern.finditer(text))
    mem_block = _first_mem_block(text, tags)
    mem, mem_span = mem_block if mem_block is not None else (None, None)

    def invalid(reason: str) -> Turn:
        return Turn(False, reason, mem, None, None, None, mem_span)

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
    return Turn(True, None, mem, blocks[1][1], written[0], content, mem_span)


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
    span = parse_turn(text, actions).mem_span
    return None if span is None else locate_char_span(offsets, *span)
