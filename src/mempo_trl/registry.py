"""Named choices as registries (PEFT's `register_peft_method`, verl's `register`): a setting whose value is a name
(`memory_reward_type`, `memory_reward_parts`, `context_mode`) takes its choices and its help text from one
`Registry`, so that a new choice is one ``register_*`` call and no help string lists names by hand.

Torch-free, so that the settings (and `mempo-trl train --help`) read the names without importing torch; an entry may
be a ``"module:attribute"`` path, imported on first use (`Registry.resolve`).
"""

import importlib
from typing import Any


class Registry(dict):
    """The entries of one kind of choice by name, each with a one-line ``help``; the keys are the setting's choices.

    Example:
        >>> colours = Registry("colour")
        >>> colours.register("red", 1, "warm"), colours.help_text("Pick one.")
        (1, 'Pick one. `red`: warm.')
    """

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.helps: dict[str, str] = {}

    def register(self, name: str, entry: Any, help: str) -> Any:
        """Add ``entry`` under ``name`` (a taken name raises `ValueError`); return the entry."""
        if name in self:
            raise ValueError(f"{self.kind} {name!r} is already registered.")
        self[name] = entry
        self.helps[name] = help.rstrip(".")
        return entry

    def resolve(self, name: str) -> Any:
        """The entry of ``name``, a ``"module:attribute"`` path imported; an unknown name raises `ValueError`
        naming the choices."""
        if name not in self:
            raise ValueError(f"{self.kind} must be one of {tuple(self)}, got {name!r}.")
        entry = self[name]
        if isinstance(entry, str) and ":" in entry:
            module, attribute = entry.split(":")
            entry = self[name] = getattr(importlib.import_module(module), attribute)
        return entry

    def help_text(self, lead: str = "") -> str:
        """``lead`` followed by every name and its help, in registration order."""
        listed = "; ".join(f"`{name}`: {help}" for name, help in self.helps.items())
        return f"{lead} {listed}.".strip()
