"""`mempo-trl` command line: one subcommand per concern, each registered by its own module.

Every module listed in `COMMAND_MODULES` exposes `add_cli(subparsers)`, which adds its subcommand(s) and sets
`func(args) -> int` on them; a subcommand that parses its own arguments (`train`, TRL-style) also sets
`accepts_extra=True` and reads them from `args.extra`. Heavy imports (torch, transformers, fastapi) stay inside those `func`s so that
`mempo-trl --help` is instant.
"""

import argparse
import importlib
import sys


COMMAND_MODULES = (
    "mempo_trl.commands.train",
    "mempo_trl.commands.eval",
    "mempo_trl.retrieval.cli",
    "mempo_trl.merge",
    "mempo_trl.commands.kit",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mempo-trl", description="MemPO search-agent training on TRL.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_cli(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)
