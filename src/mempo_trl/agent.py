"""A trained MemPO agent, ready to answer questions or play an environment: `MemPOAgent`.

Training writes its `TurnProtocol` (system prompt, instruction, max turns, top-k, context mode, turn budget, context
budget, action tags) next to the weights as ``mempo_agent.json`` (and pushes it to the Hub with them).
`MemPOAgent.from_pretrained` reads it, so that the agent runs with exactly the protocol it was trained on; an argument
given explicitly overrides a saved value and says so in one log line.

Example:
    >>> from mempo_trl import MemPOAgent
    >>> agent = MemPOAgent.from_pretrained("outputs/quickstart", retriever="data/corpus.jsonl")  # doctest: +SKIP
    >>> result = agent.run("Who founded the company that built the Orbix tower?")  # doctest: +SKIP
    >>> result.answer, result.num_turns, result.memories[-1]  # doctest: +SKIP

With ``use_vllm=True`` the engine runs in processes of its own, which the agent owns: ``with
MemPOAgent.from_pretrained(...) as agent:`` (or `MemPOAgent.close`) shuts them down.

With a TRL-style environment (`mempo_trl.environments`) instead of a retriever, `MemPOAgent.run` takes the row its
``reset`` is called with:

    >>> from mempo_trl.kit.envs import KeyVaultEnv
    >>> agent = MemPOAgent.from_pretrained("outputs/keyvault", environment_factory=KeyVaultEnv)  # doctest: +SKIP
    >>> agent.run({"seed": 7, "num_boxes": 4}).answer  # doctest: +SKIP
"""

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mempo_trl.environments import EnvironmentFactory
from mempo_trl.protocol import PROTOCOL_FILE, TurnProtocol
from mempo_trl.rollout import Episode, GenerateFn, Rollout, RolloutEngine
from mempo_trl.tasks import Task, make_task


logger = logging.getLogger(__name__)


class AgentError(RuntimeError):
    """An agent that cannot be loaded (missing model, no chat template, bad settings); the message says why."""


@dataclass
class AgentResult:
    """One answered question (or played environment task): the answer, every turn, the memories and the token cost.

    ``turns`` holds one dict per round (``mem``, ``action``, ``content``, ``information``: the result as later
    contexts showed it, `Episode.shown_information`, ``valid``, ``prompt_tokens``, ``completion_tokens``); ``memories`` the ``<mem>`` text of every round. A round's prompt
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
        turns: list[dict[str, Any]] = [
            {
                "mem": r.turn.mem,
                "think": r.turn.think,
                "action": r.turn.action,
                "content": r.turn.content,
                "information": episode.shown_information(t),
                "valid": r.turn.valid,
                "prompt_tokens": len(r.prompt_ids),
                "completion_tokens": len(r.completion_ids),
            }
            for t, r in enumerate(episode.rounds)
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
        protocol: the `TurnProtocol` (default: `TurnProtocol()`; with an environment, `TurnProtocol.for_environment`
            of it).
        environment_factory: a TRL-style environment class (`mempo_trl.environments`) to play instead of searching.
        task: instead of either, any `mempo_trl.tasks.Task`.

    `close` (or a ``with`` block) shuts the generator's engine down, if it has one (``use_vllm``; its processes end).
    """

    def __init__(
        self,
        tokenizer: Any,
        retriever: Any,
        generator: GenerateFn,
        protocol: TurnProtocol | None = None,
        environment_factory: EnvironmentFactory | None = None,
        task: Task | None = None,
    ) -> None:
        try:
            self.task = make_task(retriever, environment_factory, task)
        except ValueError as err:
            raise AgentError(f"a MemPOAgent {err}") from None
        self.tokenizer = tokenizer
        self.retriever = getattr(self.task, "retriever", None)
        self.generator = generator
        self.protocol = self.task.protocol(protocol or TurnProtocol())
        self.saved_protocol: TurnProtocol | None = None  # what `from_pretrained` found, before overrides

    @classmethod
    def from_pretrained(
        cls,
        path_or_hub_id: str | Path,
        retriever: Any = None,
        *,
        environment_factory: EnvironmentFactory | None = None,
        task: Task | None = None,
        use_vllm: bool = False,
        revision: str | None = None,
        device: str | None = None,
        dtype: str = "auto",
        temperature: float = 0.0,
        batch_size: int = 16,
        seed: int = 0,
        vllm_kwargs: dict | None = None,
        openai: dict | None = None,
        generator: Callable[[Any, TurnProtocol], GenerateFn] | None = None,
        **overrides: Any,
    ) -> "MemPOAgent":
        """Load a trained agent: the model, its tokenizer and its saved `TurnProtocol`.

        `overrides` (``max_turns=4``, ``context_mode="full_history"``, ...) replace saved fields; each change is
        logged. A model without ``mempo_agent.json`` (e.g. a base model) runs with the defaults. ``use_vllm``
        generates with vLLM's offline engine (``vllm_kwargs`` go to `vllm.LLM`; ``dtype``, unless "auto", too), else
        with transformers. ``openai`` (the arguments of `mempo_trl.endpoint.OpenAIChatGenerator` but the tokenizer:
        ``base_url``, ``model``, ...) generates with an OpenAI-compatible API instead, and ``path_or_hub_id`` then
        gives only the tokenizer and the saved protocol (the search task only). ``generator(tokenizer, protocol)``
        builds the `GenerateFn` instead of loading weights (a scripted teacher, `mempo_trl.oracle.OracleTeacher`):
        ``path_or_hub_id`` then gives only the tokenizer and the saved protocol too. Pass an ``environment_factory``
        instead of a ``retriever`` to play a TRL-style environment.

        Example:
            >>> agent = MemPOAgent.from_pretrained("user/qwen2.5-3b-mempo", "http://127.0.0.1:8000")  # doctest: +SKIP
        """
        from mempo_trl.loading import check_model_path

        path = str(path_or_hub_id)
        if openai is None and generator is None:  # with an endpoint or a scripted teacher, only the tokenizer is read
            check_model_path(path)
        try:
            saved = TurnProtocol.from_pretrained(path, revision=revision)
            protocol, messages = (saved or TurnProtocol()).override(**overrides)
        except ValueError as err:
            raise AgentError(str(err)) from None
        try:
            task = make_task(retriever, environment_factory, task)
        except ValueError as err:
            raise AgentError(f"a MemPOAgent {err}") from None
        if saved is not None and saved.action not in ("search", task.action):  # a search protocol suits any task
            raise AgentError(
                f"{Path(path, PROTOCOL_FILE)}: action {saved.action!r} is the protocol of an agent trained on a "
                "TRL-style environment; play it with its environment (environment_factory, `mempo-trl eval "
                f"--environment`), not with {type(task).__name__}"
            )
        if saved is None:
            logger.info("%s has no %s: the turn protocol is the defaults and the arguments", path, PROTOCOL_FILE)
        for message in messages if saved is not None else []:
            logger.warning("%s (%s of %s)", message, PROTOCOL_FILE, path)
        protocol = task.protocol(protocol)
        tokenizer = load_chat_tokenizer(path, revision=revision)
        if openai is not None and task.action != "search":
            raise AgentError(
                "an OpenAI-compatible endpoint plays the search task; an environment's tool schemas "
                "are not sent to it: drop --openai_base_url or --environment"
            )
        if generator is not None:  # a scripted teacher: no weights to load
            generate = generator(tokenizer, protocol)
        else:
            from mempo_trl.generation import GeneratorOptions, make_generator

            backend = "openai" if openai is not None else "vllm" if use_vllm else "transformers"
            options = GeneratorOptions(device, dtype, revision, temperature, batch_size, seed, vllm_kwargs, openai)
            generate = make_generator(backend, path, tokenizer, protocol, options)
        agent = cls(tokenizer, None, generate, protocol, task=task)
        agent.saved_protocol = saved
        return agent

    def play(
        self, rows: Sequence[dict], generate: GenerateFn | None = None, context_mode: str | None = None
    ) -> Rollout:
        """Play one episode per row (``question`` and any other keys, kept in ``episode.row``; with an environment,
        the keyword arguments of its ``reset``): `RolloutEngine.play`, whose ``episodes`` and ``timings`` say how."""
        return self.rollout_engine(context_mode).play([dict(row) for row in rows], generate or self.generator)

    def rollout_engine(self, context_mode: str | None = None) -> RolloutEngine:
        """The `RolloutEngine` that plays this agent's episodes: its protocol (with ``context_mode`` when given) and
        the context limit of its generator (``max_prompt_length``, e.g. the model's ``max_position_embeddings``
        minus the turn budget), so that a long context is handled as in training (``context_overflow``)."""
        protocol = replace(self.protocol, context_mode=context_mode) if context_mode else self.protocol
        eos = getattr(self.generator, "eos_token_ids", None)
        return RolloutEngine(
            self.tokenizer,
            protocol,
            eos_token_ids=eos if eos is not None else protocol.stop_token_ids(self.tokenizer),
            max_prompt_length=getattr(self.generator, "max_prompt_length", None),
            task=self.task,
        )

    def run_batch(self, questions: Sequence[str | dict]) -> list[AgentResult]:
        """Answer every question (a string, or a row dict: an environment's ``reset`` arguments); their rounds are
        generated together, in batches."""
        rollout = self.play([{"question": q} if isinstance(q, str) else q for q in questions])
        return [AgentResult.from_episode(episode) for episode in rollout.episodes]

    def run(self, question: str | dict) -> AgentResult:
        """Answer one question, or play one environment episode from its row."""
        return self.run_batch([question])[0]

    def close(self) -> None:
        """Shut the generator's engine down (`VLLMGenerator.close`; nothing for one without ``close``)."""
        close = getattr(self.generator, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> "MemPOAgent":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_chat_tokenizer(path: str, revision: str | None = None) -> Any:
    """The tokenizer of a model (`mempo_trl.loading.load_tokenizer`); `AgentError` when it has no chat template."""
    from mempo_trl.loading import load_tokenizer

    tokenizer = load_tokenizer(path, revision=revision)
    if not tokenizer.chat_template:
        raise AgentError(f"the tokenizer of {path} has no chat template; MemPO prompts are chat conversations.")
    return tokenizer
