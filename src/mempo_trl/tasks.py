"""The task an agent acts in, behind one seam (`Task`): the search task (a retriever) and a TRL-style environment.

`RolloutEngine`, `MemPOTrainer` and `MemPOAgent` play any `Task`: the task starts an episode from a dataset row, runs
one round's actions (all of them at once: the search task answers them with one retriever call), renders their results
as the messages contexts show (`render_result`: the rollout shortens a result's text, never its message), names its
action tags, checks its rows and sets the default reward functions before training, and says whether dynamic sampling may
play further rows (``can_refill``). For `mempo-trl train` it also reads its rows (`read_rows`), says whether the
held-out evaluation plays it (``heldout``) and writes the model card's quick start (`usage`). A new kind of task is one
class with these members (docs/environments.md, "Changing MemPO").
"""

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

from mempo_trl.context import information_block, passages_text
from mempo_trl.data import load_qa, read_jsonl, validate_datasets
from mempo_trl.environments import (
    EnvironmentFactory,
    call_tool,
    check_environment,
    environment_factories,
    environment_name,
    environment_reward_funcs,
    parse_tool_call,
    reset_arguments,
    task_text,
    tool_schemas,
)
from mempo_trl.protocol import TurnProtocol


@dataclass(frozen=True)
class TaskStart:
    """What a task gives an episode at its start: the ``question`` its first context asks, the per-episode
    ``environment`` (an environment instance; None for the search task) and the JSON schemas of its ``tools``
    (rendered in every context; None: none)."""

    question: str
    environment: Any = None
    tools: list[dict] | None = None


class Task(Protocol):
    """A task MemPO agents act in (`SearchTask`, `EnvironmentTask`, or your own class with these members).

    ``action`` is the `TurnProtocol.action` the task plays (``"search"`` or ``"tool_call"``, which fixes its action
    tags and stop strings), ``action_metric`` the name of the ``episode/*`` metric that counts the actions run,
    ``can_refill`` whether `dynamic_sampling="refill"` may play further rows, and ``passes_environments`` whether
    reward functions get each episode's ``environment`` (as TRL's ``environments`` keyword), ``heldout`` whether
    `mempo-trl train`'s held-out evaluation (``heldout_questions``, ``eval_strategy``: EM and F1 on QA rows) plays it.
    """

    action: str
    action_metric: str
    can_refill: bool
    passes_environments: bool
    heldout: bool

    @staticmethod
    def protocol(protocol: TurnProtocol) -> TurnProtocol:
        """The protocol this task is played with, from the one the settings give."""

    @staticmethod
    def read_rows(path: str, split: str, config: str | None = None) -> Any:
        """The rows of ``split`` of the data at ``path`` (a `datasets.Dataset`), as `mempo-trl train` reads them."""

    def prepare(self, reward_funcs: list | None, train_dataset: Any, eval_dataset: Any) -> tuple[list, Any, Any]:
        """Check the rows before any model is loaded; return the reward functions (``reward_funcs`` or the task's
        default) and the datasets."""

    def questions(self, rows: Any) -> list[str] | None:
        """The questions of the rows' first contexts, checked against the context limit when the data is loaded;
        None when they are only known at the start of an episode."""

    def start(self, rows: Sequence[dict]) -> list[TaskStart]:
        """One `TaskStart` per row of a batch."""

    def act(self, environments: Sequence[Any], contents: Sequence[str], topk: int) -> list[str]:
        """The result of each action, as text (``contents``: the text of each action block, ``environments`` those
        of the episodes that wrote them), all of a round at once. A lost retriever raises `RetrieverOutage`."""

    def render_result(self, result: str) -> str:
        """The message a context shows for the text of a result (`act`'s, or its shortened form ending ``" ..."``
        when ``context_overflow="truncate_information"`` cut it)."""

    def action_problem(self, content: str) -> str | None:
        """Why an action block of a valid turn cannot be run (the turn is then invalid), or None."""

    def usage(self, model_id: str, info: dict) -> str:
        """The model card's quick start for an agent trained on this task (``info``: `trainer.model_card_info`).
        Optional: without it the card keeps TRL's quick start."""


class SearchTask:
    """The search task: ``<search> query </search>`` actions, answered by ``retriever`` (anything with
    ``search(queries: list[str], topk: int) -> list[list[Passage]]``) with one call per round; rows hold
    ``question`` and ``golden_answers``. A string ``retriever`` is a `load_retriever` spec."""

    action = "search"
    action_metric = "searches"
    can_refill = True
    passes_environments = False
    heldout = True

    def __init__(self, retriever: Any) -> None:
        if isinstance(retriever, str):  # a `load_retriever` spec
            from mempo_trl.retrieval import load_retriever

            retriever = load_retriever(retriever)
        self.retriever = retriever

    @staticmethod
    def protocol(protocol: TurnProtocol) -> TurnProtocol:
        """``protocol`` as it is."""
        return protocol

    @staticmethod
    def read_rows(path: str, split: str, config: str | None = None) -> Any:
        """Validated QA rows (`load_qa`); a ``split`` that is a file is read as its own QA file."""
        return load_qa(split) if Path(split).is_file() else load_qa(path, split=split, config=config)

    def prepare(self, reward_funcs: list | None, train_dataset: Any, eval_dataset: Any) -> tuple[list, Any, Any]:
        """Every row checked (`validate_qa_rows`); the default reward is `mempo_outcome_reward`."""
        from mempo_trl.rewards import mempo_outcome_reward

        train_dataset, eval_dataset = validate_datasets(train_dataset, eval_dataset)
        return (reward_funcs if reward_funcs is not None else [mempo_outcome_reward]), train_dataset, eval_dataset

    def questions(self, rows: Any) -> list[str]:
        """The rows' ``question`` column."""
        return list(rows["question"]) if hasattr(rows, "column_names") else [row["question"] for row in rows]

    def start(self, rows: Sequence[dict]) -> list[TaskStart]:
        """The row's question."""
        return [TaskStart(row["question"]) for row in rows]

    def act(self, environments: Sequence[Any], contents: Sequence[str], topk: int) -> list[str]:
        """One retriever call for all the round's queries; each result's passages as text (`passages_text`)."""
        return [passages_text(passages) for passages in self.retriever.search(list(contents), topk)]

    def render_result(self, result: str) -> str:
        """An ``<information>`` block (`information_block`)."""
        return information_block(result)

    def action_problem(self, content: str) -> None:
        """Any query can be searched."""
        return None

    def usage(self, model_id: str, info: dict) -> str:
        """`search_usage` with the run's retriever (``retriever_arg``) and a question of its data
        (``example_question``)."""
        from mempo_trl.model_card import search_usage

        retriever = str(info.get("retriever_arg") or "corpus.jsonl")
        return search_usage(model_id, retriever, info.get("example_question") or "your question")


class EnvironmentTask:
    """A TRL-style environment (`mempo_trl.environments`): ``environment_factory`` is a class (or factory), or as in
    TRL a dict of them by name, each row naming its own in an ``environment`` field. Each episode plays one instance,
    taken from a pool (TRL's pooling: built once, reset with the row for every episode; the pool grows when a batch
    needs more instances), and calls one of its tools per turn."""

    action = "tool_call"
    action_metric = "tool_calls"
    can_refill = False
    passes_environments = True
    heldout = False

    def __init__(self, environment_factory: EnvironmentFactory | dict[str, EnvironmentFactory]):
        self.environment_factory = environment_factory
        self.factories = environment_factories(environment_factory)
        self.pool = {name: [check_environment(factory)] for name, factory in self.factories.items()}

    @staticmethod
    def protocol(protocol: TurnProtocol) -> TurnProtocol:
        """`TurnProtocol.for_environment`: tool-call actions and the environment instruction."""
        return protocol.for_environment()

    @staticmethod
    def read_rows(path: str, split: str, config: str | None = None) -> Any:
        """The reset rows of the .jsonl at ``path`` (one file: no splits)."""
        from datasets import Dataset

        return Dataset.from_list(read_jsonl(path))

    def prepare(self, reward_funcs: list | None, train_dataset: Any, eval_dataset: Any) -> tuple[list, Any, Any]:
        """`environment_reward_funcs`: the environments and the first row of each checked, ``get_reward`` added."""
        return (
            environment_reward_funcs(self.environment_factory, reward_funcs, train_dataset),
            train_dataset,
            eval_dataset,
        )

    def questions(self, rows: Any) -> None:
        """Known only from ``reset``."""
        return None

    def start(self, rows: Sequence[dict]) -> list[TaskStart]:
        """Instance k of the pool of each row's environment (`environment_name`) reset with the row: the question is
        the row's ``question`` and what ``reset`` returned (`task_text`)."""
        starts: list[TaskStart] = []
        handed_out: defaultdict[str | None, int] = defaultdict(int)
        for row in rows:
            name = environment_name(row, self.factories)
            pool = self.pool[name]
            while len(pool) <= handed_out[name]:
                pool.append(self.factories[name]())
            environment = pool[handed_out[name]]
            handed_out[name] += 1
            question = task_text(row, environment.reset(**reset_arguments(row, self.factories)))
            starts.append(TaskStart(question, environment, tool_schemas(environment)))
        return starts

    def act(self, environments: Sequence[Any], contents: Sequence[str], topk: int) -> list[str]:
        """Each tool call run on its episode's instance (`call_tool`)."""
        calls = [cast(tuple[str, dict], parse_tool_call(content)) for content in contents]  # valid: `action_problem`
        return [call_tool(env, *call) for env, call in zip(environments, calls)]

    def render_result(self, result: str) -> str:
        """The tool's result as it is (TRL's tool message)."""
        return result

    def action_problem(self, content: str) -> str | None:
        """A ``<tool_call>`` that is not a JSON call."""
        if parse_tool_call(content) is None:
            return '<tool_call> is not a JSON call {"name": ..., "arguments": {...}}'
        return None

    def usage(self, model_id: str, info: dict) -> str:
        """`environment_usage` with this task's environment class."""
        from mempo_trl.model_card import environment_usage

        return environment_usage(model_id, self.environment_factory)


def make_task(retriever: Any = None, environment_factory: Any = None, task: Task | None = None) -> Task:
    """The task of exactly one of ``task``, ``retriever`` (`SearchTask`) and ``environment_factory``
    (`EnvironmentTask`); `ValueError` otherwise."""
    given = [value is not None for value in (task, retriever, environment_factory)]
    if sum(given) != 1:
        raise ValueError("needs exactly one of `retriever` (search), `environment_factory` and `task`.")
    if task is not None:
        return task
    return SearchTask(retriever) if retriever is not None else EnvironmentTask(environment_factory)
