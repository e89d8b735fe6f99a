"""`mempo-trl view SOURCE --output page.html`: one self-contained HTML page of a run's rollout logs or of an `eval`
output (`mempo_trl.viewer`, docs/viewer.md).

    mempo-trl view outputs/quickstart --output quickstart.html      # a run trained with --rollout_log_steps N
    mempo-trl view outputs/eval --output eval.html                   # an eval output (--context_mode both: side by side)

SOURCE is a run directory (its ``rollouts/``), one ``rollouts/step-NNNNNN.jsonl`` file, an ``eval`` output directory
or its ``trajectories.jsonl``. The page needs no server and no network: open it from a file.
"""

import argparse
import sys
from dataclasses import dataclass, field

from mempo_trl.commands import CommandError, add_command, parse


@dataclass
class ViewArguments:
    """Where the page goes."""

    output: str = field(
        default="view.html",
        metadata={
            "help": "The HTML file to write (one file, no other) of SOURCE: a run directory (its rollouts/), a "
            "rollouts/step-NNNNNN.jsonl file, an eval output directory or its trajectories.jsonl."
        },
    )


def main(argv: list[str] | None = None) -> int:
    from mempo_trl.viewer import build_page

    argv = list(sys.argv[1:] if argv is None else argv)
    source = argv.pop(0) if argv and not argv[0].startswith("-") else None
    (args,) = parse("mempo-trl view SOURCE", [ViewArguments], argv)
    if source is None:
        raise CommandError(
            "no source: mempo-trl view RUN_DIR_OR_ROLLOUT_LOG_OR_EVAL_OUTPUT --output page.html (see `mempo-trl view "
            "--help`)"
        )
    path, episodes = build_page(source, args.output)
    size = path.stat().st_size
    print(f"wrote {path} ({episodes} episodes, {size / 1024:.0f} KiB): open it in a browser")
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    add_command(subparsers, "view", "an HTML page of a run's rollout logs or an eval output, rounds and credit", main)
