"""`mempo-trl compose`: K-objective QA rows from any QA source, one FlashRAG-style directory per K.

    mempo-trl compose --dataset_name nq_search/ --dataset_split train test --objectives 2 4 8 --output_dir nq_multi

writes ``nq_multi/k2/train.jsonl``, ``nq_multi/k2/test.jsonl``, ... (each `mempo_trl.load_qa`-able: ``--dataset_name
nq_multi/k4`` trains or evaluates on the 4-objective rows) and ``nq_multi/compose.json`` (what was composed from what).
Every source and split is checked before anything is written (`mempo_trl.compose.check_source_rows`).
"""

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from mempo_trl.commands import add_command, parse


REPORT_FILE = "compose.json"


def objectives_dir(output_dir: str | Path, num_objectives: int) -> Path:
    """The directory of the K-objective rows of a composed directory (``k{K}``)."""
    return Path(output_dir) / f"k{num_objectives}"


@dataclass
class ComposeArguments:
    """The QA sources to compose from, how many questions a row asks, and where the rows go."""

    output_dir: str = field(metadata={"help": "Directory for k{K}/{split}.jsonl and compose.json."})
    dataset_name: list[str] = field(
        metadata={
            "help": "QA .jsonl/.json/.parquet files, FlashRAG-style directories or `datasets` names; their "
            "rows are pooled (a row's parts may come from different sources; data_source records each)."
        },
    )
    objectives: list[int] = field(metadata={"help": "Questions per row, e.g. 2 4 8: one k{K} directory each."})
    dataset_split: list[str] = field(
        default_factory=lambda: ["train"],
        metadata={"help": "Splits to compose, each on its own (a row never mixes splits), e.g. train test."},
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "`datasets` config name, e.g. nq for FlashRAG_datasets."}
    )
    seed: int = field(default=0, metadata={"help": "Seed of the shuffle that deals the questions into rows."})
    max_rows: int | None = field(default=None, metadata={"help": "At most N rows per K and split (default: all)."})

    def __post_init__(self):
        if not self.objectives or min(self.objectives) < 1 or len(set(self.objectives)) < len(self.objectives):
            raise ValueError(
                f"objectives must be distinct whole numbers >= 1 (e.g. --objectives 2 4 8), got {self.objectives}."
            )
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {self.max_rows}.")


def load_pool(sources: list[str], split: str, config: str | None) -> list[dict]:
    """The validated QA rows of every source's ``split``, pooled; a row without ``data_source`` gets its source's
    name (the file's stem, or the `datasets` config)."""
    from mempo_trl.data import load_qa

    rows = []
    for source in sources:
        name = Path(source).stem if Path(source).exists() else config or source
        for row in load_qa(source, split=split, config=config):
            rows.append({**row, "data_source": name if row["data_source"] == "unknown" else row["data_source"]})
    return rows


def check_splits(sources: list[str], splits: list[str], pools: dict[str, list[dict]]) -> None:
    """`DataError` when several ``splits`` are asked of a source without splits (one file), or two of them resolve to
    the same rows (``pools``: the rows of each split): a composed test set would hold the training questions."""
    from mempo_trl.data import DataError

    if len(set(splits)) < len(splits):
        raise DataError(f"--dataset_split {' '.join(splits)} names a split twice: name each once.")
    if len(splits) > 1:
        for source in sources:
            if Path(source).is_file():
                raise DataError(
                    f"{source} is one file, which has no splits: --dataset_split {' '.join(splits)} would compose "
                    f"its rows {len(splits)} times. Pass a directory holding {splits[0]}.jsonl and {splits[1]}.jsonl "
                    "(FlashRAG-style), or compose each split from a file of its own."
                )
    seen: dict[tuple, str] = {}
    for split, pool in pools.items():
        rows = tuple((row["id"], row["question"]) for row in pool)
        if rows in seen:
            raise DataError(
                f"{', '.join(sources)}: splits {seen[rows]} and {split} hold the same {len(pool)} rows, so one would "
                "test on the other's questions. Pass sources whose splits differ."
            )
        seen[rows] = split


def main(argv: list[str] | None = None) -> int:
    """`mempo-trl compose`: load and check every split, compose every K, write the rows and the report."""
    from mempo_trl.compose import compose_objectives, composition_report

    (args,) = parse("mempo-trl compose", [ComposeArguments], argv)
    composed: dict[tuple[int, str], list[dict]] = {}
    report: dict = {"settings": {k: v for k, v in vars(args).items() if k != "output_dir"}, "objectives": {}}
    check_splits(args.dataset_name, args.dataset_split, {})
    pools = {split: load_pool(args.dataset_name, split, args.dataset_config) for split in args.dataset_split}
    check_splits(args.dataset_name, args.dataset_split, pools)
    for split, pool in pools.items():  # everything is composed (and every error raised) before anything is written
        where = f"{', '.join(args.dataset_name)} [{split}]"
        for k in args.objectives:
            rows = compose_objectives(pool, k, seed=args.seed, max_rows=args.max_rows, source_name=where)
            composed[k, split] = rows
            report["objectives"].setdefault(str(k), {})[split] = composition_report(pool, rows)
    for (k, split), rows in composed.items():
        path = objectives_dir(args.output_dir, k) / f"{split}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
        print(f"wrote {path}: {len(rows)} rows of {k} question(s)")
    first = report["objectives"][str(args.objectives[0])]
    left_out = sum(first[split]["multi_objective_rows_left_out"] for split in args.dataset_split)
    if left_out:
        print(f"left out {left_out} row(s) that are already multi-objective (sub_answers)")
    (Path(args.output_dir) / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    add_command(
        subparsers, "compose", "compose multi-objective QA rows (K questions in one prompt) from QA data", main
    )
