"""The `mempo-trl` subcommands: argument dataclasses parsed with TRL's `TrlParser`, and what each command runs.

Every subcommand reads its arguments the same way (`--name value`, underscores as in TRL, `--config file.yaml`
for any of them) and uses the same name for the same setting. This layer supplies the offline defaults (the `tiny`
model, the demo world of `mempo_trl.kit`); the library core never imports the kit.
"""

import argparse
from collections.abc import Callable, Sequence
from dataclasses import fields


def add_command(subparsers: argparse._SubParsersAction, name: str, help: str, main: Callable[[list[str]], int]):
    """Register `name` on the dispatcher; `main(argv)` parses its own arguments (with `parse`)."""
    parser = subparsers.add_parser(name, help=help, add_help=False)
    parser.set_defaults(func=lambda args: main(args.extra), accepts_extra=True)
    return parser


def parse(prog: str, dataclass_types: Sequence[type], argv: list[str] | None) -> tuple:
    """Parse `argv` (and `--config file.yaml`) into instances of `dataclass_types`, TRL-style.

    A bad argument raises `CommandError` (one `error:` line). A command with an `output_dir` also gets
    `--overwrite_output_dir` (`OutputArguments`), and its `output_dir` is checked (`prepare_output_dir`) here,
    before the command does any work.

    Example:
        >>> from mempo_trl.commands.kit import BuildDemoArguments
        >>> parse("mempo-trl kit build-demo", [BuildDemoArguments], ["--output_dir", "demo"])[0].output_dir
        'demo'
    """
    from trl import TrlParser

    from mempo_trl.cli import CommandError, one_line_errors
    from mempo_trl.outputs import OutputArguments, prepare_output_dir

    names = {f.name for t in dataclass_types for f in fields(t)}
    writes = "output_dir" in names and "overwrite_output_dir" not in names
    types = [*dataclass_types, OutputArguments] if writes else list(dataclass_types)
    parser = one_line_errors(TrlParser(types, prog=prog), prog)
    *parsed, unknown = parser.parse_args_and_config(args=argv, return_remaining_strings=True)
    if unknown:
        raise CommandError(f"unrecognized arguments: {' '.join(unknown)} (see `{prog} --help`)")
    if not writes:
        return tuple(parsed)
    *parsed, output = parsed
    for args in parsed:
        if getattr(args, "output_dir", None):
            prepare_output_dir(args.output_dir, overwrite=output.overwrite_output_dir)
    return tuple(parsed)
