"""The `mempo-trl` subcommands: argument dataclasses parsed with TRL's `TrlParser`, and what each command runs.

Every subcommand reads its arguments the same way (`--name value`, underscores as in TRL, `--config file.yaml`
for any of them) and uses the same name for the same setting. This layer supplies the offline defaults (the `tiny`
model, the demo world of `mempo_trl.kit`); the library core never imports the kit.
"""

import argparse
from collections.abc import Callable, Sequence


def add_command(subparsers: argparse._SubParsersAction, name: str, help: str, main: Callable[[list[str]], int]):
    """Register `name` on the dispatcher; `main(argv)` parses its own arguments (with `parse`)."""
    parser = subparsers.add_parser(name, help=help, add_help=False)
    parser.set_defaults(func=lambda args: main(args.extra), accepts_extra=True)
    return parser


def parse(prog: str, dataclass_types: Sequence[type], argv: list[str] | None) -> tuple:
    """Parse `argv` (and `--config file.yaml`) into instances of `dataclass_types`, TRL-style.

    Example:
        >>> from mempo_trl.commands.kit import BuildDemoArguments
        >>> parse("mempo-trl kit build-demo", [BuildDemoArguments], ["--output_dir", "demo"])[0].output_dir
        'demo'
    """
    from trl import TrlParser

    return TrlParser(list(dataclass_types), prog=prog).parse_args_and_config(args=argv)
