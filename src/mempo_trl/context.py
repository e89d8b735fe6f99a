"""The one context builder of MemPO (docs/algorithm.md, "Context rebuild"), shared by training, evaluation and inference.

Round t of an episode is generated from:

- t = 1: ``system + user(question)``;
- t > 1, ``context_mode="memory"`` (MemPO): ``system + user(question) + assistant(output of round t-1) +
  tool(<information> of round t-1)``. Nothing older is kept: what the model still needs must be in its ``<mem>``;
- t > 1, ``context_mode="full_history"`` (Search-R1 baseline): every earlier round's output and result.

With a TRL-style environment (`mempo_trl.environments`) the question is the task text its ``reset`` returned and the
result of round t-1 is its tool's result; the rebuild is the same.

The same builder renders the two scoring contexts of the memory reward: ``full_traj_t`` is the
full-history context of round t and ``mem_traj_t`` is ``system + user(question)`` followed by round t's ``<mem>``
block at the start of the assistant turn.

The settings of that game (`TurnProtocol`), its prompts and the round messages live with the turn format in
`mempo_trl.protocol` (``mempo_trl.context.TurnProtocol`` and ``CONTEXT_MODES`` still name them for the lab and the
notebook).
"""

from collections.abc import Sequence
from dataclasses import dataclass

from mempo_trl.protocol import CONTEXT_MODES as CONTEXT_MODES
from mempo_trl.protocol import TurnProtocol as TurnProtocol
from mempo_trl.protocol import render_gold_answer


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
    """The two scoring items of one round: ``round_index`` is 0-based (so always >= 1 here)."""

    round_index: int
    full: ScoringItem
    mem: ScoringItem


def gold_answer_tokens(tokenizer, golden_answers: Sequence[str], sub_answers=None) -> tuple[list[int], list[int]]:
    """Token ids of ``<answer> GOLD </answer>`` and the 0/1 mask of the tokens that overlap GOLD.

    Example:
        >>> ids, mask = gold_answer_tokens(tokenizer, ["Paris"])  # doctest: +SKIP
    """
    text, (start, end) = render_gold_answer(golden_answers, sub_answers)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(s < end and e > start) for s, e in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


def memory_context_ids(tokenizer, base_ids: list[int], mem_block: str) -> list[int]:
    """The context P_mem is scored after: ``system + user(question)`` (``base_ids``, rendered) + the ``<mem>`` block
    as tokenized on its own (``<mem> ... </mem>``, no chat-template turn around it)."""
    return base_ids + tokenizer(mem_block, add_special_tokens=False)["input_ids"]
