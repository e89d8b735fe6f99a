"""QA data: load Search-R1/FlashRAG rows from a file, a local dataset or the Hub, and check them early.

A row needs `question` (a string) and `golden_answers` (a non-empty list of accepted answer strings).
Optional columns get defaults when missing: `id` (the row index), `data_source` ("unknown"),
`sub_questions` and `sub_answers` (empty lists; filled for multi-objective rows, one alias list per
sub-question). Other columns are kept. Problems raise `DataError` naming the file, the line and the field,
before any training starts.

verl-style rows (Search-R1's processed parquet: `prompt`, `reward_model`, `extra_info`) are read too: a missing
`golden_answers` comes from `reward_model.ground_truth.target`, a missing `question` from `extra_info.question` or
from the last user message of `prompt` (the text after its last `Question:`).
"""

import json
import os
import unicodedata
from collections.abc import Iterator, Sequence
from pathlib import Path

import datasets
import pyarrow

from mempo_trl.rewards import normalize_answer


_DEFAULTS = {"data_source": "unknown", "sub_questions": [], "sub_answers": []}
_FEATURES = {
    "id": datasets.Value("string"),
    "question": datasets.Value("string"),
    "golden_answers": datasets.List(datasets.Value("string")),
    "data_source": datasets.Value("string"),
    "sub_questions": datasets.List(datasets.Value("string")),
    "sub_answers": datasets.List(datasets.List(datasets.Value("string"))),
}
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


_QA_ROW = '{"question": ..., "golden_answers": [...]}'


class DataError(ValueError):
    """A QA or corpus file that cannot be used; the message names the file, the line, the field and a fix."""


def read_jsonl(path: str | Path) -> list[dict]:
    """Read a JSON Lines file of objects (`iter_jsonl`); blank lines are skipped.

    Example:
        >>> from mempo_trl.kit.demo_world import demo_paths
        >>> read_jsonl(demo_paths().corpus)[0].keys()
        dict_keys(['id', 'contents'])
    """
    return [row for _, row in iter_jsonl(path)]


def append_lines(path: str | Path, entries: Sequence[dict]) -> None:
    """Append ``entries`` to the JSONL file ``path`` (after a line a kill cut, on a line of their own) and sync it to
    disk."""
    path = Path(path)
    cut = False
    if path.is_file() and path.stat().st_size:
        with path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            cut = f.read(1) != b"\n"
    with path.open("a", encoding="utf-8") as f:
        f.write("\n" if cut else "")
        for entry in entries:
            f.write(json.dumps(entry, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def iter_jsonl(
    path: str | Path, expected: str = _QA_ROW, error: type[DataError] = DataError
) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line of a JSON Lines file, read lazily.

    A line that is not UTF-8, not JSON or not a JSON object raises `error` naming the file and the line;
    `expected` is the example row the message shows (QA rows and corpus passages share this reader).
    """
    path = Path(path)
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{path}, line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise error(
                    f"{where}: not UTF-8 ({err.reason} at byte {err.start}). Re-encode the file as UTF-8."
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise error(
                    f"{where}: invalid JSON ({err.msg} at column {err.colno}). Every line must be one JSON object "
                    f"like {expected}; fix or delete this line."
                ) from None
            if not isinstance(row, dict):
                raise error(
                    f"{where}: expected a JSON object, got {type(row).__name__}. Write one {expected} per line."
                )
            yield number, row


def _fail(source_name: str, line: int, field: str, problem: str, fix: str) -> DataError:
    return DataError(f"{source_name}, line {line}: field '{field}' {problem}. {fix}")


def _check_strings(value, source_name: str, line: int, field: str, what: str) -> None:
    """`value` must be a non-empty list of non-empty strings."""
    if not isinstance(value, list):
        raise _fail(
            source_name,
            line,
            field,
            f"must be a list of {what}, got {type(value).__name__} {value!r}",
            f'Wrap it in a list, e.g. ["{value}"].' if isinstance(value, str) else f"Write a list of {what}.",
        )
    if not value:
        raise _fail(source_name, line, field, "is an empty list", f"Give at least one of the {what}.")
    for k, alias in enumerate(value):
        if not isinstance(alias, str) or not alias.strip():
            raise _fail(
                source_name,
                line,
                f"{field}[{k}]",
                f"must be a non-empty string, got {alias!r}",
                "Remove the empty entry or write the answer text.",
            )
        if not has_answer_text(alias):
            raise _fail(
                source_name,
                line,
                f"{field}[{k}]",
                f"is {alias!r}, which normalises to an empty answer (only articles, punctuation, spaces or invisible "
                "characters), so any answer made of punctuation would score as correct",
                "Write the answer text, or remove the entry.",
            )


def has_answer_text(alias: str) -> bool:
    """Whether `alias` keeps a character after `normalize_answer` that is not punctuation, space or invisible (any
    script: "。", "—" and zero-width spaces are not answers).

    Example:
        >>> [has_answer_text(a) for a in ("Ulm", "the", "。", "—", "\u200b", "1874")]
        [True, False, False, False, False, True]
    """
    return any(unicodedata.category(ch)[0] not in "PZC" for ch in normalize_answer(alias))


def has_visible_text(text: str) -> bool:
    """Whether `text` has a character that is not a space, a control or an invisible format character (any script:
    U+3000 and zero-width spaces are not text).

    Example:
        >>> [has_visible_text(t) for t in ("Who?", "\u3000", "\u200b\u200b", "?")]
        [True, False, False, True]
    """
    return any(unicodedata.category(ch)[0] not in "ZC" for ch in text)


def _json_kind(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "list", dict: "object"}.get(type(value), type(value).__name__)


def _check_column_kinds(rows: list[dict], source_name: str, lines) -> None:
    """Each column holds one JSON kind (string, number, ...) on every row, or null: Arrow stores one type per column.
    `id` is exempt (ids become strings)."""
    first: dict[str, tuple[str, int]] = {}
    for line, row in zip(lines, rows):
        for name, value in row.items():
            if value is None or name == "id":
                continue
            kind = _json_kind(value)
            seen = first.setdefault(name, (kind, line))
            if seen[0] != kind:
                raise _fail(
                    source_name,
                    line,
                    name,
                    f"is a {kind} ({value!r:.80}) but a {seen[0]} on line {seen[1]}",
                    "A column must hold one type on every row: convert the values (e.g. all strings).",
                )


def _check_row(row: dict, source_name: str, line: int) -> None:
    question = row.get("question")
    if not isinstance(question, str) or not has_visible_text(question):
        problem = "is missing" if question is None else f"must be a string with visible text, got {question!r:.80}"
        raise _fail(source_name, line, "question", problem, "Every row needs the question text in 'question'.")
    if row.get("golden_answers") is None:
        raise _fail(
            source_name,
            line,
            "golden_answers",
            "is missing",
            'Add the accepted answers as a list of strings, e.g. "golden_answers": ["1874"] (rename an '
            "'answer' or 'answers' column; verl-style rows may give them in reward_model.ground_truth.target).",
        )
    _check_strings(row["golden_answers"], source_name, line, "golden_answers", "accepted answer strings")
    sub_questions, sub_answers = row.get("sub_questions") or [], row.get("sub_answers") or []
    if not isinstance(sub_questions, list) or not all(
        isinstance(q, str) and has_visible_text(q) for q in sub_questions
    ):
        raise _fail(
            source_name,
            line,
            "sub_questions",
            f"must be a list of non-empty strings, got {sub_questions!r}",
            "List the individual questions of a multi-objective row, or leave it empty.",
        )
    if not isinstance(sub_answers, list) or len(sub_answers) != len(sub_questions):
        size = len(sub_answers) if isinstance(sub_answers, list) else type(sub_answers).__name__
        raise _fail(
            source_name,
            line,
            "sub_answers",
            f"has {size} entries but 'sub_questions' has {len(sub_questions)}",
            "Give one list of accepted answers per sub-question.",
        )
    for k, aliases in enumerate(sub_answers):
        _check_strings(aliases, source_name, line, f"sub_answers[{k}]", "accepted answer strings")
    data_source = row.get("data_source")
    if data_source is not None and not isinstance(data_source, str):
        raise _fail(
            source_name,
            line,
            "data_source",
            f"must be a string, got {data_source!r}",
            'Name the data set the row comes from, e.g. "nq".',
        )


def _prompt_question(prompt) -> str | None:
    """The question in a chat `prompt` (the text after the last `Question:` of its last user message)."""
    if not isinstance(prompt, list):
        return None
    users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    if not users or not isinstance(users[-1], str):
        return None
    return users[-1].rsplit("Question:", 1)[-1].strip() or None


def verl_fields(row: dict) -> dict:
    """`question` and `golden_answers` of a verl-style row that lacks them (empty dict when it has them).

    Example:
        >>> verl_fields({"prompt": [{"role": "user", "content": "Answer it. Question: who wrote hamlet?"}],
        ...              "reward_model": {"ground_truth": {"target": ["Shakespeare"]}, "style": "rule"}})
        {'golden_answers': ['Shakespeare'], 'question': 'who wrote hamlet?'}
    """
    filled = {}
    if row.get("golden_answers") is None:
        ground_truth = (row.get("reward_model") or {}).get("ground_truth")
        target = ground_truth.get("target") if isinstance(ground_truth, dict) else None
        if target is not None:
            filled["golden_answers"] = [target] if isinstance(target, str) else list(target)
    if row.get("question") is None:
        extra = row.get("extra_info")
        question = (extra.get("question") if isinstance(extra, dict) else None) or _prompt_question(row.get("prompt"))
        if question:
            filled["question"] = question
    return filled


def _with_verl_fields(rows: datasets.Dataset | list[dict]) -> datasets.Dataset | list[dict]:
    """Rows with `verl_fields` filled in, when they are verl-style (have `reward_model`)."""
    if isinstance(rows, datasets.Dataset):
        names = rows.column_names
        if "reward_model" in names and not {"question", "golden_answers"} <= set(names):
            keys = ("question", "golden_answers")  # the same columns on every row, None where nothing was found
            return rows.map(lambda row: {**{key: row.get(key) for key in keys}, **verl_fields(row)})
        return rows
    return [{**row, **verl_fields(row)} if "reward_model" in row else row for row in rows]


def _iter_rows(rows: datasets.Dataset | list[dict]):
    """Rows as dicts; a `Dataset` is read in batches (much faster than row by row)."""
    if not isinstance(rows, datasets.Dataset):
        yield from rows
        return
    for batch in rows.iter(batch_size=1024):
        names = list(batch)
        for values in zip(*batch.values()):
            yield dict(zip(names, values))


def _fill_defaults(row: dict, index: int) -> dict:
    """The optional columns of `row`, with defaults where they are missing or null; ids become strings."""
    filled = {"id": str(index) if row.get("id") is None else str(row["id"])}
    filled.update({name: default if row.get(name) is None else row[name] for name, default in _DEFAULTS.items()})
    return filled


def validate_qa_rows(
    dataset_or_rows: datasets.Dataset | list[dict], source_name: str, line_numbers: list[int] | None = None
) -> datasets.Dataset:
    """Check QA rows and return them as a `Dataset` with the optional columns filled in.

    Raises `DataError` naming `source_name`, the line (1-based row number, or `line_numbers[i]` when given)
    and the field. The known columns get one schema (`golden_answers`: list of strings, `id`: string, ...).

    Example:
        >>> ds = validate_qa_rows([{"question": "Who?", "golden_answers": ["Ada"]}], "inline")
        >>> ds[0]["id"], ds[0]["data_source"], ds[0]["sub_answers"]
        ('0', 'unknown', [])
    """
    rows = _with_verl_fields(dataset_or_rows)
    if not len(rows):
        raise DataError(f"{source_name}: no rows. Give at least one question.")
    lines = line_numbers or range(1, len(rows) + 1)
    for line, row in zip(lines, _iter_rows(rows)):
        _check_row(row, source_name, line)
    if isinstance(rows, datasets.Dataset):
        names = rows.column_names
        incomplete = any(name not in names or None in rows[name] for name in ("id", *_DEFAULTS))
        dataset = rows.map(_fill_defaults, with_indices=True) if incomplete else rows
    else:
        _check_column_kinds(rows, source_name, lines)
        columns = list(dict.fromkeys(["id", "question", "golden_answers", *_DEFAULTS, *(k for r in rows for k in r)]))
        filled = [
            {**{name: row.get(name) for name in columns}, **_fill_defaults(row, i)} for i, row in enumerate(rows)
        ]
        try:
            dataset = datasets.Dataset.from_list(filled)
        except (pyarrow.ArrowInvalid, pyarrow.ArrowTypeError) as err:  # nested values of mixed types
            raise DataError(
                f"{source_name}: the rows' columns do not have one type each ({err}). Make every value of a column "
                "the same type (e.g. lists of strings on every row)."
            ) from None
    features = dataset.features.copy()
    features.update({name: feature for name, feature in _FEATURES.items() if name in features})
    return dataset.cast(features) if features != dataset.features else dataset


def _read_file(path: Path) -> tuple[datasets.Dataset | list[dict], list[int] | None]:
    """Rows of a .jsonl/.json/.parquet file, with line numbers where the file has lines."""
    if path.suffix == ".parquet":
        import pyarrow.parquet

        try:
            rows = pyarrow.parquet.read_metadata(path).num_rows
        except pyarrow.ArrowException as err:
            raise DataError(f"{path}: not a readable Parquet file ({err}). Write it again, or use .jsonl.") from None
        if not rows:
            raise DataError(f"{path}: no rows. Give at least one question.")
        return datasets.Dataset.from_parquet(str(path)), None
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            if err.msg != "Extra data":  # "Extra data": the .json file is JSON Lines
                raise DataError(
                    f"{path}, line {err.lineno}: invalid JSON ({err.msg} at column {err.colno}). Fix the JSON syntax."
                ) from None
        else:
            if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
                raise DataError(f"{path}: a .json file must hold a list of row objects (or one object per line).")
            return data, None
    numbered = list(iter_jsonl(path))
    return [row for _, row in numbered], [line for line, _ in numbered]


def load_qa(source: str | Path, split: str = "train", config: str | None = None) -> datasets.Dataset:
    """Load and validate QA rows from a file, a local dataset directory or a `datasets` Hub name.

    `source` may be a `.jsonl`/`.json`/`.parquet` file; a directory holding `{split}.jsonl` (or `.json`,
    `.parquet`) as FlashRAG data sets do, or a `Dataset.save_to_disk` directory; or a Hub name such as
    `"RUC-NLPIR/FlashRAG_datasets"` with `config="nq"` (cached copies only when `HF_HUB_OFFLINE=1`).

    Example:
        >>> from mempo_trl.kit.demo_world import demo_paths
        >>> load_qa(demo_paths().train).column_names[:4]
        ['id', 'question', 'golden_answers', 'data_source']
    """
    path = Path(source)
    if path.is_dir():
        files = [path / f"{split}{suffix}" for suffix in _FILE_SUFFIXES if (path / f"{split}{suffix}").is_file()]
        if files:
            path = files[0]
        elif (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict) and split not in loaded:
                raise DataError(f"{path}: no split {split!r}; the saved splits are {sorted(loaded)}.")
            rows = loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
            return validate_qa_rows(rows, f"{path} [{split}]")
        else:
            splits = sorted(p.stem for p in path.iterdir() if p.is_file() and p.suffix in _FILE_SUFFIXES)
            if splits:
                raise DataError(
                    f"{path}: no {split}.jsonl (or .json, .parquet); its split files are {', '.join(splits)}. Pass "
                    f"--dataset_split {splits[0]}, or name the file itself."
                )
            return validate_qa_rows(datasets.load_dataset(str(path), config, split=split), f"{path} [{split}]")
    if path.is_file():
        if path.suffix not in _FILE_SUFFIXES:
            raise DataError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl, .json or .parquet.")
        rows, lines = _read_file(path)
        return validate_qa_rows(rows, str(path), lines)
    if path.suffix in _FILE_SUFFIXES:
        raise DataError(f"{path}: file not found.")
    return validate_qa_rows(datasets.load_dataset(str(source), config, split=split), f"{source} [{split}]")


def named_datasets(train_dataset, eval_dataset) -> dict[str, object]:
    """The trainer's datasets by the names its messages use: ``train_dataset``, ``eval_dataset`` or
    ``eval_dataset[name]`` for each of a dict of them; None where one is not given.

    Example:
        >>> list(named_datasets([], {"a": [], "b": []}))
        ['train_dataset', 'eval_dataset[a]', 'eval_dataset[b]']
    """
    named = {"train_dataset": train_dataset}
    if isinstance(eval_dataset, dict):
        named.update({f"eval_dataset[{name}]": dataset for name, dataset in eval_dataset.items()})
    else:
        named["eval_dataset"] = eval_dataset
    return named


def check_map_style(train_dataset, eval_dataset) -> None:
    """Refuse streaming (`datasets.IterableDataset`) train or eval data, with the reason and what to do instead."""
    for name, dataset in named_datasets(train_dataset, eval_dataset).items():
        if isinstance(dataset, datasets.IterableDataset | datasets.IterableDatasetDict):
            raise ValueError(
                f"{name} is an IterableDataset (streaming): MemPOTrainer needs a map-style Dataset, because it checks "
                "every row before training (its fields, and that its first context fits) and dynamic_sampling="
                "'refill' draws rows at random; a stream would be read whole at init, an unbounded one forever. Take "
                "the rows you train on first: `Dataset.from_list(list(stream.take(n)))`."
            )


def validate_datasets(train_dataset, eval_dataset):
    """``train_dataset`` and ``eval_dataset`` (one, or a dict of them) through `validate_qa_rows`, None left as is."""
    named = {
        name: validate_qa_rows(rows, name)
        for name, rows in named_datasets(train_dataset, eval_dataset).items()
        if rows is not None
    }
    train = named.pop("train_dataset", None)
    if isinstance(eval_dataset, dict):
        return train, {name: named[f"eval_dataset[{name}]"] for name in eval_dataset}
    return train, named.get("eval_dataset")
