"""The `mempo-trl` subcommands and what they share: arguments parsed with TRL's `TrlParser`, one-line errors.

Every subcommand reads its arguments the same way (`--name value`, underscores as in TRL, `--config file.yaml`
for any of them) and uses the same name for the same setting. Errors a user can fix (bad arguments, YAML, paths,
data, outputs, retrievers) end every command the same way, in `run`: one `error: ...` line on stderr and exit code 2,
with no usage dump and no traceback (`MEMPO_DEBUG=1` shows the traceback). The command layer never imports the
offline kit (`mempo_trl.kit`), which registers its own `mempo-trl kit` command.
"""

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any


USAGE_EXIT = 2

MAX_ERROR_LINE = 2000
"""Characters of an `error:` line at most; a longer message (a huge value echoed back) is cut, saying how much."""


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
        mempo_trl.commands.CommandError: argument --max_steps: invalid int value: 'ten' (see `mempo-trl train --help`)
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
    line = f"error: {text}"
    if len(line) > MAX_ERROR_LINE:
        line = f"{line[:MAX_ERROR_LINE]}... ({len(line) - MAX_ERROR_LINE} more characters cut)"
    return line


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
    # Deprecations inside DeepSpeed (ZeRO collectives) and TRL (`is_gradient_checkpointing` and
    # `gradient_checkpointing_disable/enable` around its HF generation, `unwrap_model_for_generation`): nothing a user
    # can change. Our own calls use transformers 5's names (`grpo_mirror.activation_checkpointing_off`).
    (FutureWarning, "`torch.distributed.all_gather_into_tensor` is deprecated"),
    (FutureWarning, "`torch.distributed.reduce_scatter_tensor` is deprecated"),
    (FutureWarning, "`is_gradient_checkpointing` is deprecated"),
    (FutureWarning, "`gradient_checkpointing_disable` is deprecated"),
    (FutureWarning, "`gradient_checkpointing_enable` is deprecated"),
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


def refuse_yaml_aliases(argv: list[str]) -> None:
    """Raise `CommandError` when the `--config` recipe in `argv` uses a YAML alias (``*name``), naming its line.

    A recipe is a flat list of settings; aliases only add a way to blow a few bytes up into gigabytes (an "alias
    bomb": each level repeats the one before), so they are refused before the recipe is loaded. A file that cannot
    be read or parsed is left to the parser, which says why.
    """
    import yaml

    config = flag_value(argv, "config")
    if not config or not os.path.isfile(config):
        return
    with open(config, encoding="utf-8", errors="replace") as stream:
        for event in yaml.parse(stream, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent):
                raise CommandError(
                    f"{config}, line {event.start_mark.line + 1}: the YAML alias *{event.anchor} is not allowed in a "
                    "recipe; write the value out instead"
                )


def add_command(subparsers: argparse._SubParsersAction, name: str, help: str, main: Callable[[list[str]], int]):
    """Register `name` on the dispatcher; `main(argv)` parses its own arguments (with `parse`)."""
    parser = subparsers.add_parser(name, help=help, add_help=False)
    parser.set_defaults(func=lambda args: main(args.extra), accepts_extra=True)
    return parser


def parse(prog: str, dataclass_types: Sequence[type], argv: list[str] | None) -> tuple:
    """Parse `argv` (and `--config file.yaml`) into instances of `dataclass_types`, TRL-style.

    A bad argument raises `CommandError` (one `error:` line). A command with an `output_dir` also gets
    `--overwrite_output_dir` (`OutputArguments`), and its `output_dir` is checked and held (`claim_output_dir`,
    apart from the `INPUT_FIELDS` inputs and the recipe) here, before the command does any work, by the first process
    of a launched run; a ``resume_from_checkpoint``, or arguments whose ``resumes_output_dir`` is true
    (`mempo-trl distill`), continue the results there. With `--overwrite_output_dir` the previous run's outputs are
    set aside, deleted only once the command has results of its own and put back if it ends without
    (`mempo_trl.outputs.claim_output_dir`): no command deletes anything before its inputs are read and checked.

    Example:
        >>> from mempo_trl.commands.retrieval import IndexArguments
        >>> parse("mempo-trl build-index", [IndexArguments], ["--bm25_k1", "1.2"])[0].bm25_k1
        1.2
    """
    from trl import TrlParser

    from mempo_trl.outputs import OutputArguments, claim_output_dir, prepare_output_dir

    names = {f.name for t in dataclass_types for f in fields(t)}
    writes = "output_dir" in names and "overwrite_output_dir" not in names
    types = [*dataclass_types, OutputArguments] if writes else list(dataclass_types)
    parser = one_line_errors(TrlParser(types, prog=prog), prog)
    refuse_yaml_aliases(sys.argv[1:] if argv is None else argv)
    *parsed, unknown = parser.parse_args_and_config(args=argv, return_remaining_strings=True)
    if unknown:
        raise CommandError(f"unrecognized arguments: {' '.join(unknown)} (see `{prog} --help`)")
    if not writes:
        return tuple(parsed)
    *parsed, output = parsed
    inputs = {
        what: getattr(args, name) for args in parsed for name, what in INPUT_FIELDS.items() if hasattr(args, name)
    }
    inputs["recipe"] = flag_value(sys.argv[1:] if argv is None else argv, "config")
    for args in parsed:
        if not getattr(args, "output_dir", None):
            continue
        if int(os.environ.get("RANK", "0")) != 0:  # launched (`accelerate launch`): the first process holds it
            prepare_output_dir(args.output_dir, check_existing=False, inputs=inputs)
            continue
        resume = getattr(args, "resume_from_checkpoint", None) or (
            getattr(args, "resumes_output_dir", False) and not output.overwrite_output_dir
        )
        claim_output_dir(args.output_dir, overwrite=output.overwrite_output_dir, resume=resume, inputs=inputs)
    return tuple(parsed)


INPUT_FIELDS = {
    "model_name_or_path": "model",
    "base_model_name_or_path": "base model",
    "adapter_base_model": "adapter's base model",
    "dataset_name": "dataset",
    "corpus": "corpus",
}
"""The arguments naming the inputs a command reads (and what each is), which its `output_dir` must be apart from."""


def flag_value(argv: list[str], name: str) -> str | None:
    """The last value of `--name value` / `--name=value` in `argv` ("true" for a bare boolean flag).

    Example:
        >>> flag_value(["--config", "a.yaml", "--push_to_hub", "--config=b.yaml"], "config")
        'b.yaml'
    """
    value = None
    for i, arg in enumerate(argv):
        if arg == f"--{name}":
            following = argv[i + 1] if i + 1 < len(argv) else "--"
            value = "true" if following.startswith("--") else following
        elif arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
    return value
