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

`TurnProtocol` holds the settings of that game (prompts, turn budget, context mode, context budget, action tags) as
one object: the trainer builds it from `MemPOConfig`, saves it next to the weights (``mempo_agent.json``), and the
rollout, the agent, the evaluation and the callbacks all play by it.
"""

import json
import math
import string
import types
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

from mempo_trl.environments import ENVIRONMENT_INSTRUCTION
from mempo_trl.protocol import ACTION_STOPS, TOOL_STOPS, render_gold_answer
from mempo_trl.settings import setting, setting_problems


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


def render_prompt(tokenizer, messages: list[dict[str, str]], tools: list[dict] | None = None) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template and the generation prompt.

    ``tools``: the JSON schemas of an environment's tools (`mempo_trl.environments.tool_schemas`), rendered by the
    chat template (Qwen2.5's: in the system message); None for the search task, whose instruction teaches its action.
    """
    ids = tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=True, tokenize=True, return_dict=True
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
    """How a MemPO episode is played: the prompts, the turn budget, the context rebuild, the context budget and the
    action tags.

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

    def __post_init__(self):
        """Refuse values a protocol cannot be played with, with the rules of `MemPOConfig` (types first)."""
        problems = field_type_problems(self, strict=True)
        for name in ("system_prompt", "instruction"):
            if not isinstance(getattr(self, name), str):
                problems.append(f"{name} must be a string, got {getattr(self, name)!r}.")
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


def field_type_problems(config, strict: bool = False) -> list[str]:
    """One sentence per field of `config` whose value does not fit its declared `int` or `float` type.

    `int` fields take integers only (a float such as 2.7 is refused, not truncated); `float` fields take finite
    numbers only (`.nan` and `.inf` in a YAML recipe are refused: they would train to NaN weights). Booleans are
    neither. Strings and None are left to the parser that converts them (TRL's) and to the other checks, unless
    ``strict`` (a saved JSON file, which nothing converts): then a string is refused, and None too where the type
    does not allow it.

    Example:
        >>> from dataclasses import make_dataclass
        >>> Toy = make_dataclass("Toy", [("retrieval_topk", int), ("memory_coef", float)])
        >>> field_type_problems(Toy(retrieval_topk=2.7, memory_coef=float("nan")))
        ['retrieval_topk must be an integer, got 2.7.', 'memory_coef must be a finite number, got nan.']
    """
    problems = []
    for f in fields(config):
        kinds = set(f.type.__args__) if isinstance(f.type, types.UnionType) else {f.type}
        value = getattr(config, f.name, None)
        left = value is None and (not strict or type(None) in kinds) or isinstance(value, str) and not strict
        if left or not kinds & {int, float}:
            continue
        if int in kinds and float not in kinds and (isinstance(value, bool) or not isinstance(value, int)):
            problems.append(f"{f.name} must be an integer, got {value!r}.")
        elif float in kinds and (isinstance(value, bool) or not isinstance(value, int | float)):
            problems.append(f"{f.name} must be a number, got {value!r}.")
        elif float in kinds and not math.isfinite(value):
            problems.append(f"{f.name} must be a finite number, got {value!r}.")
    weights = getattr(config, "reward_weights", None) or []
    if not all(isinstance(w, int | float) and not isinstance(w, bool) and math.isfinite(w) for w in weights):
        problems.append(f"reward_weights must be finite numbers, got {weights!r}.")
    return problems


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
