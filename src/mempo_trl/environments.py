"""TRL-style tool environments for MemPO agents (docs/environments.md, "Bring your own environment").

An environment follows TRL 1.16's `environment_factory` convention (`trl.GRPOTrainer`): a class whose instances
have ``reset(**row) -> str | None`` (called with the dataset row at the start of each episode; the text it returns is
the task shown to the agent), public methods that are the agent's tools (their JSON schema comes from the signature
and the Google-style docstring, `transformers.utils.get_json_schema`) and, optionally, ``get_reward() -> float``
(the environment owns the reward, read once per finished episode).

A MemPO agent calls one tool per turn, in the tool-call format of Qwen2.5 / Hermes chat templates, after its
``<mem>`` and ``<think>`` blocks::

    <mem> ... </mem><think> ... </think><tool_call>{"name": "open_box", "arguments": {"box": "B3"}}</tool_call>

or ends the episode with ``<answer> ... </answer>``. Where TRL's trainer mirrors a rule (which methods are tools,
how a failing tool call is reported to the model), this module follows it and names it.
"""

import asyncio
import inspect
import json
from collections.abc import Callable
from typing import Any


EnvironmentFactory = Callable[[], Any]
"""A callable (usually the class itself) that returns a new environment instance."""


class EnvironmentConventionError(ValueError):
    """An environment that does not follow the convention (no ``reset``, a tool without a usable docstring)."""


def _result(value):
    """``value``, awaited when a tool or ``get_reward`` is a coroutine function."""
    return asyncio.run(value) if inspect.iscoroutine(value) else value


def environment_tools(environment) -> list[Callable]:
    """The environment's tools, chosen as TRL 1.16's `GRPOTrainer` chooses them: the public functions of its class
    (bound to the instance), except ``reset`` and ``get_reward``, in name order.

    Example:
        >>> class Env:
        ...     def reset(self, **row): ...
        ...     def look(self) -> str: ...
        ...     def _secret(self): ...
        >>> [tool.__name__ for tool in environment_tools(Env())]
        ['look']
    """
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def tool_schemas(environment) -> list[dict]:
    """The JSON schema of every tool (`transformers.utils.get_json_schema`), as the chat template renders them.

    Raises:
        EnvironmentConventionError: a tool whose signature or docstring does not give a schema (the message names it).
    """
    # Imported here: `mempo-trl train --help` loads no transformers.
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    schemas = []
    for tool in environment_tools(environment):
        try:
            schemas.append(get_json_schema(tool))
        except (DocstringParsingException, TypeHintParsingException) as err:
            raise EnvironmentConventionError(
                f"{type(environment).__name__}.{tool.__name__} is a tool (a public method) but has no JSON schema: "
                f"{err} Give it type hints and a docstring with an `Args:` section, or make it private (`_name`)."
            ) from None
    return schemas


def check_environment(factory: EnvironmentFactory):
    """Build one instance with ``factory`` and check the convention; return the instance.

    Raises:
        EnvironmentConventionError: no callable ``reset``, no tools, or a tool without a schema.
    """
    environment = factory()
    name = type(environment).__name__
    if not callable(getattr(environment, "reset", None)):
        raise EnvironmentConventionError(f"{name} has no `reset(**row)` method: every environment needs one.")
    if not environment_tools(environment):
        raise EnvironmentConventionError(f"{name} has no tools: give it at least one public method.")
    tool_schemas(environment)
    return environment


def environment_factories(environment_factory) -> dict[str | None, EnvironmentFactory]:
    """TRL 1.16's reading of ``environment_factory``: a dict maps the ``environment`` field of each row to its factory
    (several environments); a single factory is ``{None: factory}``, the one environment of every row.

    Example:
        >>> environment_factories(dict), list(environment_factories({"a": dict, "b": list}))
        ({None: <class 'dict'>}, ['a', 'b'])
    """
    if isinstance(environment_factory, dict):
        if not environment_factory:
            raise ValueError("environment_factory is an empty dict: map each environment name to its class.")
        return dict(environment_factory)
    return {None: environment_factory}


def environment_name(row: dict, factories: dict[str | None, EnvironmentFactory]) -> str | None:
    """The environment ``row`` plays: its ``environment`` field with several environments (as in TRL), None with one.

    Raises:
        ValueError: the row names no environment, or one that is not among ``factories`` (TRL's message).
    """
    if None in factories:
        return None
    name = row.get("environment")
    if name not in factories:
        raise ValueError(
            f"Example has `environment={name!r}`, which is not among the environments passed to "
            f"`environment_factory`. Expected one of: {list(factories)}."
        )
    return name


def reset_arguments(row: dict, factories: dict[str | None, EnvironmentFactory]) -> dict:
    """The keyword arguments of ``reset``: the row, less its ``environment`` field with several environments (TRL's
    control field)."""
    return dict(row) if None in factories else {k: v for k, v in row.items() if k != "environment"}


def has_own_reward(environment) -> bool:
    """Whether the environment owns the reward (defines ``get_reward``)."""
    return callable(getattr(environment, "get_reward", None))


def environment_reward_func(environment_class: type) -> Callable:
    """A TRL reward function that reads ``get_reward()`` from each episode's environment instance.

    Mirrors the reward source TRL 1.16's `GRPOTrainer.__init__` adds for an environment with ``get_reward``: it takes
    the ``environments`` keyword (one instance per completion), scores only instances of exactly that class (None,
    i.e. NaN, otherwise) and is named after the class.
    """

    def get_reward(environments, **kwargs) -> list[float | None]:
        return [_result(e.get_reward()) if type(e) is environment_class else None for e in environments]

    get_reward.__name__ = environment_class.__name__
    return get_reward


def environment_reward_funcs(environment_factory, reward_funcs, train_dataset) -> list:
    """Check the environments and the rows before any model is loaded; return the trainer's reward functions.

    ``environment_factory`` is one factory or, as in TRL, a dict of them by name (`environment_factories`): then
    every row names its environment in an ``environment`` column, checked here for all rows. Each environment class
    with ``get_reward`` adds `environment_reward_func` (TRL's rule, once per class); without ``reward_funcs``, the
    default is `mempo_outcome_reward` unless every environment owns its reward, and it needs a gold answer. The first
    row of each environment is reset once. Raises `ValueError` naming the row and what to fix.
    """
    from mempo_trl.rewards import mempo_outcome_reward

    factories = environment_factories(environment_factory)
    environments = {name: check_environment(factory) for name, factory in factories.items()}
    label = " / ".join(type(e).__name__ for e in environments.values())
    owners = list(dict.fromkeys(type(e) for e in environments.values() if has_own_reward(e)))
    if reward_funcs is None:
        every_one_owns = all(has_own_reward(e) for e in environments.values())
        reward_funcs = [] if every_one_owns else [mempo_outcome_reward]
    elif not isinstance(reward_funcs, list):
        reward_funcs = [reward_funcs]
    reward_funcs = [*reward_funcs, *(environment_reward_func(owner) for owner in owners)]
    if train_dataset is None or len(train_dataset) == 0:
        raise ValueError(f"MemPOTrainer with {label} needs a train_dataset: one row of `reset` arguments per task.")
    if None in factories:
        first_rows = {None: 0}
    else:
        names = train_dataset["environment"] if "environment" in getattr(train_dataset, "column_names", []) else None
        names = names if names is not None else [dict(row).get("environment") for row in train_dataset]
        first_rows = {}
        for index, name in enumerate(names):
            if name not in factories:
                raise ValueError(
                    f"train_dataset row {index}: environment={name!r} is not among the environments of "
                    f"`environment_factory` ({list(factories)}); give every row an `environment` column naming one."
                )
            first_rows.setdefault(name, index)
    for name, index in first_rows.items():
        row, environment = dict(train_dataset[index]), environments[name]
        try:
            environment.reset(**reset_arguments(row, factories))
        except Exception as err:
            raise ValueError(
                f"train_dataset row {index}: {type(environment).__name__}.reset(**row) failed: {err!r}. Fix the "
                "row's fields."
            ) from err
        gold = row.get("golden_answers", getattr(environment, "golden_answers", None))
        if gold is None and mempo_outcome_reward in reward_funcs and not has_own_reward(environment):
            raise ValueError(
                f"train_dataset row {index} has no `golden_answers` and {type(environment).__name__} sets none, but "
                "`mempo_outcome_reward` scores the answer against them: add the column, set `self.golden_answers` "
                "in `reset`, or define `get_reward()` / pass your own `reward_funcs`."
            )
    return reward_funcs


def task_text(row: dict, observation: Any) -> str:
    """What the agent is asked: the row's ``question`` (if any), then the text ``reset`` returned (if any).

    Example:
        >>> task_text({"question": "Open the vault."}, "Boxes: B1, B2.")
        'Open the vault.\\n\\nBoxes: B1, B2.'
    """
    parts = [str(part).strip() for part in (row.get("question"), observation) if part is not None]
    return "\n\n".join(part for part in parts if part)


def parse_tool_call(content: str) -> tuple[str, dict] | None:
    """``(name, arguments)`` of the JSON in a ``<tool_call>`` block, or None when it is not a call.

    ``arguments`` may be an object or a JSON string holding one (some models write it that way); missing means none.

    Example:
        >>> parse_tool_call('{"name": "open_box", "arguments": {"box": "B3"}}')
        ('open_box', {'box': 'B3'})
        >>> parse_tool_call("open_box(B3)") is None
        True
    """
    try:
        call = json.loads(content)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return (call["name"], arguments) if isinstance(arguments, dict) else None


def call_tool(environment, name: str, arguments: dict) -> str:
    """Run one tool of ``environment``; its result as text for the tool message.

    As TRL 1.16's tool loop (`GRPOTrainer._tool_call_loop`): the result is ``str(result)``, and an unknown tool or a
    tool that raises gives ``str({"error": message})``, so the model sees what went wrong and the episode goes on.

    Example:
        >>> class Env:
        ...     def reset(self, **row): ...
        ...     def double(self, x: int) -> int: return 2 * x
        >>> call_tool(Env(), "double", {"x": 4}), call_tool(Env(), "halve", {})
        ('8', "{'error': 'Tool halve not found.'}")
    """
    tools = {tool.__name__: tool for tool in environment_tools(environment)}
    try:
        if name not in tools:
            raise ValueError(f"Tool {name} not found.")
        result = _result(tools[name](**arguments))
    except Exception as err:  # noqa: BLE001 - any tool failure is reported to the model, as TRL does
        result = {"error": str(err)}
    return str(result)


def load_environment(spec: str) -> EnvironmentFactory:
    """The environment class an import path names (``my_pkg.envs.MyEnv`` or ``my_pkg.envs:MyEnv``), as `mempo-trl
    train` and `eval` take it (`--environment mempo_trl.kit.envs.KeyVaultEnv`).

    Raises:
        EnvironmentConventionError: nothing importable by that name.

    Example:
        >>> load_environment("mempo_trl.environments:EnvironmentConventionError").__name__
        'EnvironmentConventionError'
    """
    import importlib

    module, _, name = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        raise EnvironmentConventionError(
            f"unknown environment {spec!r}: give an import path (`my_pkg.envs.MyEnv`)."
        ) from None
