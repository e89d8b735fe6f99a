"""The MemPO turn: its tags, its actions and the strings that end it, and `parse_turn`, the one parser of a turn.

One assistant turn is ``<mem>…</mem>``, ``<think>…</think>``, then exactly one of ``<search>…</search>`` or
``<answer>…</answer>``, with nothing but whitespace outside the tags (docs/algorithm.md, "Turn protocol"). With a
TRL-style environment (`mempo_trl.environments`) the tool action is ``<tool_call>…</tool_call>`` instead of
``<search>``: the tool-call tags of Qwen2.5 / Hermes chat templates, holding ``{"name": ..., "arguments": {...}}``.
"""

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


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


def split_answers(answer: str) -> list[str]:
    """Split a multi-objective answer on ``;``; parts are stripped and empty parts kept, so positions stay aligned.

    >>> split_answers("Ulm;  Max ; ")
    ['Ulm', 'Max', '']
    """
    return [part.strip() for part in answer.split(";")]


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
