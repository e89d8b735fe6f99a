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
"""

from collections.abc import Sequence
from typing import Literal


ContextMode = Literal["memory", "full_history"]
CONTEXT_MODES = ("memory", "full_history")

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


def render_prompt(tokenizer, messages: list[dict[str, str]], tools: list[dict] | None = None) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template and the generation prompt.

    ``tools``: the JSON schemas of an environment's tools (`mempo_trl.environments.tool_schemas`), rendered by the
    chat template (Qwen2.5's: in the system message); None for the search task, whose instruction teaches its action.
    """
    ids = tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(ids["input_ids"])
