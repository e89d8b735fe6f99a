"""`mempo-trl` command line: one subcommand per concern, each registered by its own module.

Every module in `command_modules()` exposes `add_cli(subparsers)`, which adds its subcommand(s) and sets
`func(args) -> int` on them; a subcommand that parses its own arguments (`train`, TRL-style) also sets
`accepts_extra=True` and reads them from `args.extra`. Those modules import neither torch, transformers nor fastapi
at module level, so that `mempo-trl --help` is instant; they never import this module back (errors and parsing
helpers live in `mempo_trl.commands`).
"""

import argparse
import sys

from mempo_trl.commands import USAGE_EXIT, CommandError, quiet_upstream_noise, run


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise CommandError(f"{message} (see `{self.prog} --help`)")


def command_modules() -> tuple:
    """The modules that register the subcommands, in `--help` order (the kit registers its own `mempo-trl kit`)."""
    from mempo_trl.commands import ask, compose, distill, eval, hotpotqa, merge, retrieval, sft, train, view
    from mempo_trl.kit import cli as kit

    return train, eval, view, hotpotqa, compose, ask, distill, sft, retrieval, merge, kit


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mempo-trl", description="MemPO search-agent training on TRL.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in command_modules():
        module.add_cli(subparsers)
    return parser


def _dispatch(argv: list[str]) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    if not getattr(args, "func", None):
        parser.print_help()
        return USAGE_EXIT
    return int(args.func(args) or 0)


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; the output directories it claimed are released (and their run record written) at its end."""
    from mempo_trl.outputs import release_output_dirs

    quiet_upstream_noise()
    rc = None
    try:
        rc = run(_dispatch, sys.argv[1:] if argv is None else argv)
        return rc
    finally:
        release_output_dirs(ok=rc == 0)
