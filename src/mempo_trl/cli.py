"""`mempo-trl` command line: one subcommand per concern, each registered by its own module.

Every module listed in `COMMAND_MODULES` exposes `add_cli(subparsers)`, which adds its subcommand(s) and sets
`func(args) -> int` on them; a subcommand that parses its own arguments (`train`, TRL-style) also sets
`accepts_extra=True` and reads them from `args.extra`. Heavy imports (torch, transformers, fastapi) stay inside those
`func`s so that `mempo-trl --help` is instant.

Errors a user can fix (bad arguments, YAML, paths, data, outputs, retrievers) end every command the same way, in
`run`: one `error: ...` line on stderr and exit code 2, with no usage dump and no traceback (`MEMPO_DEBUG=1` shows
the traceback).
"""

import argparse
import importlib
import os
import re
import sys
from collections.abc import Callable
from typing import Any


COMMAND_MODULES = (
    "mempo_trl.commands.train",
    "mempo_trl.commands.eval",
    "mempo_trl.commands.ask",
    "mempo_trl.commands.retrieval",
    "mempo_trl.commands.merge",
    "mempo_trl.commands.kit",
)
USAGE_EXIT = 2


class CommandError(Exception):
    """A bad command line (unknown flag, wrong value type, ...); printed as one `error:` line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise CommandError(f"{message} (see `{self.prog} --help`)")


def one_line_errors(parser: argparse.ArgumentParser, prog: str) -> argparse.ArgumentParser:
    """Make `parser` (e.g. a `TrlParser`) raise `CommandError` instead of printing its usage and exiting.

    Example:
        >>> parser = one_line_errors(argparse.ArgumentParser(), "mempo-trl train")
        >>> parser.add_argument("--max_steps", type=int) and parser.parse_args(["--max_steps", "ten"])
        Traceback (most recent call last):
        mempo_trl.cli.CommandError: argument --max_steps: invalid int value: 'ten' (see `mempo-trl train --help`)
    """

    def error(message: str):
        raise CommandError(f"{message} (see `{prog} --help`)")

    parser.error = error
    return parser


def error_message(err: BaseException) -> str | None:
    """The one-line message for an error a user can fix, or None for anything else (a bug: keep the traceback).

    Our own exceptions (`DataError`, `OutputError`, `RetrievalError`, ...) and bad values, paths, missing
    packages and YAML syntax count as fixable.
    """
    import yaml

    fixable = (CommandError, ValueError, OSError, ImportError, yaml.YAMLError)
    if not isinstance(err, fixable) and not type(err).__module__.startswith("mempo_trl."):
        return None
    text = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, yaml.YAMLError):
        text = f"invalid YAML: {text}"
    return f"error: {text}"


def run(func: Callable[..., int | None], *args: Any) -> int:
    """Call a command; a fixable error becomes one `error:` line on stderr and exit code 2.

    Example:
        >>> run(lambda: open("/no/such/recipe.yaml"))
        error: [Errno 2] No such file or directory: '/no/such/recipe.yaml'
        2
    """
    try:
        return int(func(*args) or 0)
    except Exception as err:
        message = error_message(err)
        if message is None or os.environ.get("MEMPO_DEBUG"):
            raise
        # One write of the whole line: under `accelerate launch` every rank shares the pipe, and `print` writes the
        # text and the newline separately, so two ranks' lines could interleave.
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        return USAGE_EXIT


UPSTREAM_NOISE = (
    # DeepSpeed's CPU fallback, logged by every process that imports it on a machine without GPUs.
    ("DeepSpeed", "Setting accelerator to CPU"),
    # Deprecations inside DeepSpeed (ZeRO collectives) and TRL (`is_gradient_checkpointing`): nothing a user can change.
    (FutureWarning, "`torch.distributed.all_gather_into_tensor` is deprecated"),
    (FutureWarning, "`torch.distributed.reduce_scatter_tensor` is deprecated"),
    (FutureWarning, "`is_gradient_checkpointing` is deprecated"),
)
"""(logger name or warning category, message start) of upstream messages no setting of ours can avoid."""


def quiet_upstream_noise() -> None:
    """Silence `UPSTREAM_NOISE`: a logging filter per logger and a `warnings` filter per warning (nothing else)."""
    import logging
    import warnings

    for source, message in UPSTREAM_NOISE:
        if isinstance(source, str):
            logging.getLogger(source).addFilter(lambda record, m=message: not record.getMessage().startswith(m))
        else:
            warnings.filterwarnings("ignore", message=re.escape(message), category=source)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mempo-trl", description="MemPO search-agent training on TRL.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_cli(subparsers)
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
    quiet_upstream_noise()
    return run(_dispatch, sys.argv[1:] if argv is None else argv)
