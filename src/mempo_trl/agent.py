"""A trained MemPO agent, ready to answer questions or play an environment: `MemPOAgent` and its settings.

Training writes `AgentSettings` (system prompt, instruction, max turns, top-k, context mode, turn budget) next to
the weights as ``mempo_agent.json`` (and pushes it to the Hub with them). `MemPOAgent.from_pretrained` reads them,
so that the agent runs with exactly the protocol it was trained on; an argument given explicitly overrides a saved
value and says so in one log line.

Example:
    >>> from mempo_trl import MemPOAgent
    >>> agent = MemPOAgent.from_pretrained("outputs/quickstart", retriever="data/corpus.jsonl")  # doctest: +SKIP
    >>> result = agent.run("Who founded the company that built the Orbix tower?")  # doctest: +SKIP
    >>> result.answer, result.num_turns, result.memories[-1]  # doctest: +SKIP

With a TRL-style environment (`mempo_trl.environments`) instead of a retriever, `MemPOAgent.run` takes the row its
``reset`` is called with:

    >>> from mempo_trl.kit.envs import KeyVaultEnv
    >>> agent = MemPOAgent.from_pretrained("outputs/keyvault", environment_factory=KeyVaultEnv)  # doctest: +SKIP
    >>> agent.run({"seed": 7, "num_boxes": 4}).answer  # doctest: +SKIP
"""

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from mempo_trl.context import CONTEXT_MODES, DEFAULT_INSTRUCTION, DEFAULT_SYSTEM_PROMPT
from mempo_trl.environments import ENVIRONMENT_INSTRUCTION, TOOL_STOPS, EnvironmentFactory
from mempo_trl.rollout import ACTION_STOPS, Episode, GenerateFn, RolloutEngine, RolloutTimings


AGENT_FILE = "mempo_agent.json"
logger = logging.getLogger(__name__)


class AgentError(RuntimeError):
    """An agent that cannot be loaded (missing model, no chat template, bad settings); the message says why."""


@dataclass
class AgentSettings:
    """The turn protocol of a MemPO agent (the `MemPOConfig` fields of the same names).

    Example:
        >>> settings, messages = AgentSettings(max_turns=4).override(max_turns=6, retrieval_topk=None)
        >>> settings.max_turns, messages
        (6, ['max_turns=6 overrides the saved max_turns=4'])
    """

    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    instruction: str = DEFAULT_INSTRUCTION
    max_turns: int = 8
    retrieval_topk: int = 3
    context_mode: str = "memory"
    max_completion_length: int = 512

    def __post_init__(self):
        if self.context_mode not in CONTEXT_MODES:
            raise AgentError(f"context_mode must be one of {CONTEXT_MODES}, got {self.context_mode!r}")
        if "{question}" not in self.instruction:
            raise AgentError("instruction must contain the `{question}` placeholder")
        if self.max_turns < 1 or self.retrieval_topk < 1 or self.max_completion_length < 1:
            raise AgentError("max_turns, retrieval_topk and max_completion_length must be >= 1")

    @classmethod
    def from_config(cls, config) -> "AgentSettings":
        """The settings of a `MemPOConfig` (or anything with the same attributes)."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})

    def save(self, directory: str | Path) -> Path:
        """Write ``mempo_agent.json`` into `directory`; return its path."""
        path = Path(directory) / AGENT_FILE
        path.write_text(json.dumps(asdict(self), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return path

    @classmethod
    def from_pretrained(cls, path_or_hub_id: str | Path, revision: str | None = None) -> "AgentSettings | None":
        """The settings saved with a model (a directory or a Hub id), or None when it has none."""
        path = Path(path_or_hub_id, AGENT_FILE)
        if not path.is_file():
            if Path(path_or_hub_id).exists():
                return None
            from huggingface_hub import hf_hub_download
            from huggingface_hub.errors import EntryNotFoundError, HFValidationError, LocalEntryNotFoundError

            try:
                path = Path(hf_hub_download(str(path_or_hub_id), AGENT_FILE, revision=revision))
            except (EntryNotFoundError, LocalEntryNotFoundError, HFValidationError, OSError):
                return None
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
            known = {f.name for f in fields(cls)}
            return cls(**{key: value for key, value in saved.items() if key in known})
        except (json.JSONDecodeError, TypeError, AgentError) as err:
            raise AgentError(f"{path}: not valid agent settings ({err}); delete it or save it again") from None

    def override(self, **values: Any) -> tuple["AgentSettings", list[str]]:
        """Replace the fields given with a value other than None; one message per field that changes.

        Example:
            >>> AgentSettings().override(max_turns=None)[1]
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


@dataclass
class AgentResult:
    """One answered question (or played environment task): the answer, every turn, the memories and the token cost.

    ``turns`` holds one dict per round (``mem``, ``action``, ``content``, ``information``, ``valid``,
    ``prompt_tokens``, ``completion_tokens``); ``memories`` the ``<mem>`` text of every round. A round's prompt
    tokens are the context the model was given; ``total_tokens`` sums prompt + completion over the rounds and
    ``peak_context_tokens`` is the largest prompt + completion of one round.
    """

    question: str
    answer: str | None
    turns: list[dict]
    memories: list[str]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    peak_context_tokens: int
    format_valid: bool
    episode: Episode = field(repr=False)

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def num_searches(self) -> int:
        return self.episode.num_searches

    @classmethod
    def from_episode(cls, episode: Episode) -> "AgentResult":
        turns = [
            {
                "mem": r.turn.mem,
                "think": r.turn.think,
                "action": r.turn.action,
                "content": r.turn.content,
                "information": r.information,
                "valid": r.turn.valid,
                "prompt_tokens": len(r.prompt_ids),
                "completion_tokens": len(r.completion_ids),
            }
            for r in episode.rounds
        ]
        processed = [t["prompt_tokens"] + t["completion_tokens"] for t in turns]
        return cls(
            question=episode.question,
            answer=episode.answer,
            turns=turns,
            memories=[r.turn.mem for r in episode.rounds if r.turn.mem is not None],
            prompt_tokens=sum(t["prompt_tokens"] for t in turns),
            completion_tokens=sum(t["completion_tokens"] for t in turns),
            total_tokens=sum(processed),
            peak_context_tokens=max(processed, default=0),
            format_valid=episode.format_valid,
            episode=episode,
        )


class MemPOAgent:
    """A policy, its tokenizer, a retriever or an environment, and the turn protocol: plays MemPO episodes.

    Args:
        tokenizer: the policy's tokenizer (with a chat template).
        retriever: anything with ``search(queries, topk)``, or a `load_retriever` spec (``corpus.jsonl``,
            ``http://host:port``, ...); None with an ``environment_factory``.
        generator: a `GenerateFn` (`HFGenerator`, `VLLMGenerator` or your own). Its ``eos_token_ids`` attribute,
            if any, tells the rollout which ids end a turn.
        settings: the turn protocol (default: `AgentSettings()`; with an environment, a search-task instruction
            becomes `ENVIRONMENT_INSTRUCTION`).
        environment_factory: a TRL-style environment class (`mempo_trl.environments`) to play instead of searching.
    """

    def __init__(
        self,
        tokenizer,
        retriever,
        generator: GenerateFn,
        settings: AgentSettings | None = None,
        environment_factory: EnvironmentFactory | None = None,
    ):
        if (retriever is None) == (environment_factory is None):
            raise AgentError("a MemPOAgent needs exactly one of a retriever (search) and an environment_factory")
        if isinstance(retriever, str):
            from mempo_trl.retrieval import load_retriever

            retriever = load_retriever(retriever)
        settings = settings or AgentSettings()
        if environment_factory is not None and settings.instruction == DEFAULT_INSTRUCTION:
            settings = replace(settings, instruction=ENVIRONMENT_INSTRUCTION)
        self.tokenizer = tokenizer
        self.retriever = retriever
        self.generator = generator
        self.settings = settings
        self.environment_factory = environment_factory
        self.saved_settings: AgentSettings | None = None  # what `from_pretrained` found, before overrides

    @classmethod
    def from_pretrained(
        cls,
        path_or_hub_id: str | Path,
        retriever=None,
        *,
        environment_factory: EnvironmentFactory | None = None,
        use_vllm: bool = False,
        revision: str | None = None,
        device: str | None = None,
        dtype: str = "auto",
        temperature: float = 0.0,
        batch_size: int = 16,
        seed: int = 0,
        vllm_kwargs: dict | None = None,
        **overrides: Any,
    ) -> "MemPOAgent":
        """Load a trained agent: the model, its tokenizer and its saved `AgentSettings`.

        `overrides` (``max_turns=4``, ``context_mode="full_history"``, ...) replace saved settings; each change is
        logged. A model without ``mempo_agent.json`` (e.g. a base model) runs with the defaults. ``use_vllm``
        generates with vLLM's offline engine (``vllm_kwargs`` go to `vllm.LLM`), else with transformers. Pass an
        ``environment_factory`` instead of a ``retriever`` to play a TRL-style environment.

        Example:
            >>> agent = MemPOAgent.from_pretrained("user/qwen2.5-3b-mempo", "http://127.0.0.1:8000")  # doctest: +SKIP
        """
        from mempo_trl.loading import check_model_path

        path = str(path_or_hub_id)
        check_model_path(path)
        saved = AgentSettings.from_pretrained(path, revision=revision)
        settings, messages = (saved or AgentSettings()).override(**overrides)
        if saved is None:
            logger.info("%s has no %s: the agent settings are the defaults and the arguments", path, AGENT_FILE)
        for message in messages if saved is not None else []:
            logger.warning("%s (%s of %s)", message, AGENT_FILE, path)
        tokenizer = load_chat_tokenizer(path, revision=revision)
        stops = ACTION_STOPS if environment_factory is None else TOOL_STOPS
        if use_vllm:
            from mempo_trl.generation import VLLMGenerator

            generator = VLLMGenerator(
                path,
                tokenizer,
                settings.max_completion_length,
                temperature,
                seed=seed,
                stops=stops,
                **(vllm_kwargs or {}),
            )
        else:
            import torch

            from mempo_trl.generation import HFGenerator

            torch.manual_seed(seed)
            model = load_model(path, device=device, dtype=dtype, revision=revision)
            generator = HFGenerator(
                model, tokenizer, settings.max_completion_length, temperature, batch_size=batch_size, stops=stops
            )
        agent = cls(tokenizer, retriever, generator, settings, environment_factory)
        agent.saved_settings = saved
        return agent

    def play(
        self, rows: Sequence[dict], generate: GenerateFn | None = None, context_mode: str | None = None
    ) -> tuple[list[Episode], RolloutTimings]:
        """Play one episode per row (``question`` and any other keys, kept in ``episode.row``; with an environment,
        the keyword arguments of its ``reset``)."""
        generate = generate or self.generator
        eos = getattr(self.generator, "eos_token_ids", None)
        engine = RolloutEngine(
            self.tokenizer,
            self.retriever,
            max_turns=self.settings.max_turns,
            topk=self.settings.retrieval_topk,
            context_mode=context_mode or self.settings.context_mode,
            system_prompt=self.settings.system_prompt,
            instruction=self.settings.instruction,
            eos_token_ids=eos if eos is not None else [self.tokenizer.eos_token_id],
            environment_factory=self.environment_factory,
        )
        return engine.run([dict(row) for row in rows], generate)

    def run_batch(self, questions: Sequence[str | dict]) -> list[AgentResult]:
        """Answer every question (a string, or a row dict: an environment's ``reset`` arguments); their rounds are
        generated together, in batches."""
        episodes, _ = self.play([{"question": q} if isinstance(q, str) else q for q in questions])
        return [AgentResult.from_episode(episode) for episode in episodes]

    def run(self, question: str | dict) -> AgentResult:
        """Answer one question, or play one environment episode from its row."""
        return self.run_batch([question])[0]


def load_chat_tokenizer(path: str, revision: str | None = None):
    """The tokenizer of a model (`mempo_trl.loading.load_tokenizer`); `AgentError` when it has no chat template."""
    from mempo_trl.loading import load_tokenizer

    tokenizer = load_tokenizer(path, revision=revision)
    if not tokenizer.chat_template:
        raise AgentError(f"the tokenizer of {path} has no chat template; MemPO prompts are chat conversations.")
    return tokenizer


def load_model(path: str, device: str | None = None, dtype: str = "auto", revision: str | None = None):
    """A causal LM in eval mode on `device` (default: cuda when available)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype if dtype == "auto" else getattr(torch, dtype), revision=revision
    )
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device).eval()
