"""`TurnProtocol`: the rules of a MemPO episode (prompts, turn budget, context mode and budget, action tags) as one
object, checked when built, saved next to the weights (``mempo_agent.json``) and read back.

The trainer builds it from `MemPOConfig`; the rollout, the agent, the evaluation and the callbacks all play by it.
The turn format is `mempo_trl.turns`, the contexts it renders are `mempo_trl.context`.
"""

import json
import string
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

from mempo_trl.context import (
    CONTEXT_MODES,
    CONTEXT_RULES,
    DEFAULT_INSTRUCTION,
    DEFAULT_SYSTEM_PROMPT,
    ENVIRONMENT_INSTRUCTION,
    ContextMode,
    initial_messages,
    round_messages,
)
from mempo_trl.settings import field_type_problems, setting, setting_problems
from mempo_trl.turns import ACTION_STOPS, SEARCH_ACTIONS, TOOL_ACTIONS, TOOL_STOPS, stop_token_ids


CONTEXT_OVERFLOWS = ("end_episode", "truncate_information")

PROTOCOL_FILE = "mempo_agent.json"


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
        "memory", CONTEXT_RULES.help_text("Which earlier rounds a context shows:"), choices=CONTEXT_MODES
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

    def __post_init__(self) -> None:
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
    def actions(self) -> tuple[str, ...]:
        """The action tags of a turn: ``search``/``answer``, or ``tool_call``/``answer``."""
        return SEARCH_ACTIONS if self.action == "search" else TOOL_ACTIONS

    @property
    def stops(self) -> tuple[str, ...]:
        """The strings that end a turn: ``</search>``/``</answer>``, or ``</tool_call>``/``</answer>``."""
        return ACTION_STOPS if self.action == "search" else TOOL_STOPS

    def for_environment(self) -> "TurnProtocol":
        """The protocol for a TRL-style environment: tool-call actions, and `ENVIRONMENT_INSTRUCTION` in place of the
        default search instruction (a custom instruction is kept)."""
        instruction = ENVIRONMENT_INSTRUCTION if self.instruction == DEFAULT_INSTRUCTION else self.instruction
        return replace(self, action="tool_call", instruction=instruction)

    def stop_token_ids(self, tokenizer: Any, model_eos: int | Sequence[int] | None = None) -> list[int]:
        """Ids that end a turn of this protocol (`stop_token_ids` with its `stops`)."""
        return stop_token_ids(tokenizer, model_eos, self.stops)

    def initial_messages(self, question: str) -> list[dict[str, str]]:
        """Round-1 messages of ``question`` (`initial_messages` with this protocol's prompts)."""
        return initial_messages(question, self.system_prompt, self.instruction)

    def round_messages(self, base: list[dict[str, str]], history: Sequence[tuple[str, str]]) -> list[dict[str, str]]:
        """Messages of the next round (`round_messages` in this protocol's context mode)."""
        return round_messages(base, history, self.context_mode)

    @classmethod
    def from_config(cls, config: Any, environment: bool = False) -> "TurnProtocol":
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
