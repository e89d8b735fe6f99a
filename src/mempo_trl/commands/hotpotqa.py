"""`mempo-trl hotpotqa`: HotpotQA in, the project's QA rows and one paragraph corpus out (`mempo_trl.hotpotqa`).

    mempo-trl hotpotqa --dataset_name hotpotqa/hotpot_qa --dataset_config distractor --output_dir data/hotpotqa
    mempo-trl hotpotqa --dataset_name ../shared/data/hotpotqa_distractor --dataset_split train dev \\
        --output_dir data/hotpotqa

writes ``data/hotpotqa/{split}.jsonl`` per split (`mempo_trl.load_qa`-able: ``--dataset_name data/hotpotqa
--dataset_split dev``), ``data/hotpotqa/corpus.jsonl`` (one passage per Wikipedia paragraph of every question, each
once, ids derived from the text) and ``data/hotpotqa/hotpotqa_report.json`` (counts, duplicates dropped, license).
Every row of every split is checked before anything is written.
"""

import argparse
import json
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mempo_trl.commands import add_command, parse
from mempo_trl.commands.retrieval import IndexArguments


CORPUS_FILE = "corpus.jsonl"
REPORT_FILE = "hotpotqa_report.json"
RETRIEVAL_FILE = "retrieval.json"
_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass
class HotpotQAArguments:
    """The HotpotQA rows to convert (a Hub name, a file or a folder of split files), which splits, and where to."""

    output_dir: str = field(metadata={"help": "Directory for {split}.jsonl, corpus.jsonl and hotpotqa_report.json."})
    dataset_name: str = field(
        metadata={
            "help": "HotpotQA rows: the Hub name hotpotqa/hotpot_qa (with --dataset_config), a .jsonl/.json/"
            ".parquet file (one split, named by its stem or by --dataset_split) or a folder of {split}.jsonl "
            "(.json, .parquet) files."
        }
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "Hub config: distractor or fullwiki (same schema)."}
    )
    dataset_split: list[str] | None = field(
        default=None,
        metadata={
            "help": "Splits to convert, e.g. train dev (default: every split of the source). No question may be in "
            "two of them."
        },
    )
    measure_retrieval: list[str] | None = field(
        default=None,
        metadata={
            "help": "Retrievers to measure on the written corpus (bm25, dense): the share of questions whose gold "
            "paragraphs (at least one / all) are in the top k, the question as the query; printed and saved to "
            "retrieval.json.",
            "choices": ["bm25", "dense"],
        },
    )
    retrieval_k: list[int] = field(
        default_factory=lambda: [1, 3, 5, 10], metadata={"help": "The k of --measure_retrieval."}
    )
    retriever_model: str | None = field(
        default=None, metadata={"help": "Local sentence-transformers model directory (--measure_retrieval dense)."}
    )
    retriever_cache_dir: str | None = field(
        default=None, metadata={"help": "Where indexes are cached (default: $MEMPO_CACHE/<retriever type>)."}
    )

    def __post_init__(self):
        if min(self.retrieval_k, default=0) < 1:
            raise ValueError(f"retrieval_k must be whole numbers >= 1, got {self.retrieval_k}.")
        if "dense" in (self.measure_retrieval or []) and not self.retriever_model:
            raise ValueError("--measure_retrieval dense needs --retriever_model: a local sentence-transformers model.")


def _file_rows(path: Path) -> Iterator[tuple[str, object]]:
    """(where, row) of a .jsonl, .json or .parquet file of HotpotQA rows; ``where`` names the file and the row."""
    from mempo_trl.data import DataError, iter_jsonl
    from mempo_trl.hotpotqa import HUB_ROW

    if path.suffix == ".jsonl":
        for number, (line, row) in enumerate(iter_jsonl(path, expected=HUB_ROW), 1):
            yield f"{path}, row {number}" + (f" (line {line})" if line != number else ""), row
        return
    if path.suffix == ".parquet":
        import pyarrow.parquet

        rows = pyarrow.parquet.read_table(path).to_pylist()
    else:
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise DataError(f"{path}, line {err.lineno}: invalid JSON ({err.msg}). Fix the JSON syntax.") from None
        if not isinstance(rows, list):
            raise DataError(f"{path}: a .json file must hold a list of rows like {HUB_ROW}.")
    for number, row in enumerate(rows, 1):
        yield f"{path}, row {number}", row


def source_splits(name: str, config: str | None, splits: list[str] | None) -> dict[str, list[tuple[str, object]]]:
    """``{split: [(where, row), ...]}`` of a file, a folder of split files or a Hub dataset."""
    from mempo_trl.data import DataError

    path = Path(name)
    if path.is_file():
        if path.suffix not in _SUFFIXES:
            raise DataError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl, .json or .parquet.")
        if splits and len(splits) > 1:
            raise DataError(f"{path} is one split; name one --dataset_split for it (or none: {path.stem}).")
        return {(splits or [path.stem])[0]: list(_file_rows(path))}
    if path.is_dir():
        files = {p.stem: p for p in sorted(path.iterdir()) if p.suffix in _SUFFIXES and p.is_file()}
        for split in splits or []:
            if split not in files:
                raise DataError(
                    f"{path}: no {split}.jsonl (or .json, .parquet); its split files are {', '.join(files) or 'none'}."
                )
        if not files:
            raise DataError(f"{path}: no .jsonl, .json or .parquet split files.")
        return {split: list(_file_rows(files[split])) for split in splits or files}
    if path.suffix in _SUFFIXES or name.startswith((".", "/")):
        raise DataError(f"{path}: file or folder not found.")
    import datasets

    # Only the splits asked for are loaded (fullwiki's are large); datasets names a missing split and the ones there.
    loaded = (
        {s: datasets.load_dataset(name, config, split=s) for s in splits}
        if splits
        else datasets.load_dataset(name, config)
    )
    return {
        split: [(f"{name} [{split}], row {i}", row) for i, row in enumerate(loaded[split], 1)]
        for split in splits or loaded
    }


def measure_retrieval(
    args: HotpotQAArguments, index_args: IndexArguments, rows: dict[str, list[dict]], corpus: Path, command: str
) -> dict:
    """`gold_recall` of every split's questions (and all of them) for each retriever of ``--measure_retrieval``,
    with the seconds each took (index build included), the ``command`` line, the machine and the date."""
    import os
    import platform
    import time

    from mempo_trl.hotpotqa import gold_recall
    from mempo_trl.retrieval.settings import RetrieverArguments, build_retriever

    splits = {**rows, "all": [row for split_rows in rows.values() for row in split_rows]}
    measured = {}
    for kind in args.measure_retrieval:
        start = time.perf_counter()
        settings = RetrieverArguments(
            corpus=str(corpus),
            retriever_type=kind,
            retriever_model=args.retriever_model,
            retriever_cache_dir=args.retriever_cache_dir,
        )
        retriever = build_retriever(settings, **index_args.kwargs(kind))
        measured[kind] = {
            "retriever": kind if kind == "bm25" else f"dense ({args.retriever_model})",
            "index": index_args.kwargs(kind),
            "splits": {
                name: gold_recall(split_rows, retriever, args.retrieval_k) for name, split_rows in splits.items()
            },
            "seconds": round(time.perf_counter() - start, 2),
        }
    return {
        "command": command,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "query": "the question",
        "k": args.retrieval_k,
        "retrievers": measured,
    }


def recall_table(measured: dict) -> str:
    """The overall shares of a `measure_retrieval` result as a Markdown table: one row per retriever and k."""
    lines = ["| retriever | k | at least one gold paragraph | both |", "| --- | ---: | ---: | ---: |"]
    for kind, result in measured["retrievers"].items():
        overall = result["splits"]["all"]
        for k in measured["k"]:
            lines.append(f"| {kind} | {k} | {overall['one'][str(k)]:.1%} | {overall['all'][str(k)]:.1%} |")
    return "\n".join(lines)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """`mempo-trl hotpotqa`: read and check every split, convert, then write the rows, the corpus and the report."""
    from mempo_trl.hotpotqa import convert_hotpotqa

    args, index_args = parse("mempo-trl hotpotqa", [HotpotQAArguments, IndexArguments], argv)
    rows, corpus, report = convert_hotpotqa(source_splits(args.dataset_name, args.dataset_config, args.dataset_split))
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for split, split_rows in rows.items():
        _write_jsonl(out / f"{split}.jsonl", split_rows)
        print(f"wrote {out / f'{split}.jsonl'}: {len(split_rows)} questions")
    _write_jsonl(out / CORPUS_FILE, corpus)
    print(
        f"wrote {out / CORPUS_FILE}: {report['passages']} passages ({report['duplicates_dropped']} duplicate "
        "paragraphs dropped)"
    )
    source = {"dataset_name": args.dataset_name, "dataset_config": args.dataset_config, "splits": list(rows)}
    (out / REPORT_FILE).write_text(json.dumps({"source": source, **report}, indent=2) + "\n", encoding="utf-8")
    if args.measure_retrieval:
        command = shlex.join(["mempo-trl", "hotpotqa", *(sys.argv[2:] if argv is None else argv)])
        measured = measure_retrieval(args, index_args, rows, out / CORPUS_FILE, command)
        (out / RETRIEVAL_FILE).write_text(json.dumps(measured, indent=2) + "\n", encoding="utf-8")
        questions = sum(len(split_rows) for split_rows in rows.values())
        print(f"gold paragraphs in the top k, the question as the query ({questions} questions):")
        print(recall_table(measured))
        print(f"wrote {out / RETRIEVAL_FILE}")
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    add_command(subparsers, "hotpotqa", "convert HotpotQA rows to QA rows and one Wikipedia paragraph corpus", main)
