"""Corpus loading: wiki-18 style JSONL (`{"id", "contents"}`) or a `datasets.Dataset`, validated up front.

Search-R1 and FlashRAG ship wiki-18 as one JSON object per line, `{"id": "1", "contents": "\\"Title\\"\\ntext"}`.
Every malformed row fails at load time with a `CorpusError` naming the file, the 1-based line and the field.
"""

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mempo_trl.data import DataError, iter_jsonl
from mempo_trl.retrieval.base import Passage


EXPECTED_ROW = '{"id": "1", "contents": "\\"Title\\"\\nPassage text."}'


class CorpusError(DataError):
    """A corpus file or dataset is malformed; the message names the place and the fix."""


def parse_contents(contents: str) -> tuple[str, str]:
    """Split wiki-18 `contents` into `(title, text)`: the first line, minus one pair of quotes, is the title.

    Contents without a newline have no title.

    Example:
        >>> parse_contents('"Ada Lovelace"\\nAda wrote the first program.')
        ('Ada Lovelace', 'Ada wrote the first program.')
        >>> parse_contents("no title line")
        ('', 'no title line')
    """
    first, newline, rest = contents.partition("\n")
    if not newline:
        return "", contents
    if len(first) >= 2 and first[0] == first[-1] == '"':
        first = first[1:-1]
    return first, rest


def load_corpus(source: str | os.PathLike | Any) -> list[Passage]:
    """Load passages from a JSONL file or a `datasets.Dataset`, failing fast with `CorpusError` on bad rows.

    Rows need `id` (string or integer) and either `contents` (wiki-18) or `title` + `text`. Blank lines are
    skipped; ids must be unique.

    Example:
        >>> passages = load_corpus("wiki-18.jsonl")
        >>> passages[0].title, passages[0].text[:20]
        ('Aaron', 'Aaron is a prophet, ')
    """
    if isinstance(source, str | os.PathLike):
        return _load_jsonl(Path(source))
    if hasattr(source, "column_names") and hasattr(source, "iter"):
        return _load_dataset(source)
    raise TypeError(f"load_corpus expects a path to a JSONL file or a datasets.Dataset, got {type(source).__name__}.")


def fingerprint(passages: Iterable[Passage], params: dict[str, Any]) -> str:
    """sha256 over every passage's id, title and text plus `params`: the key of an on-disk index cache.

    Example:
        >>> fingerprint([Passage("1", "T", "x")], {"k1": 1.5})[:12]
        '4455a212c77c'
    """
    digest = hashlib.sha256()
    for passage in passages:
        fields = (passage.id, passage.title, passage.text)
        digest.update("".join(f"{len(field)}:{field}" for field in fields).encode("utf-8", "surrogatepass"))
    digest.update(json.dumps(params, sort_keys=True).encode())
    return digest.hexdigest()


def _load_jsonl(path: Path) -> list[Passage]:
    if not path.is_file():
        raise FileNotFoundError(
            f"Corpus file {path} does not exist. Pass a JSONL file with one {EXPECTED_ROW} per line."
        )
    passages: list[Passage] = []
    first_line: dict[str, int] = {}
    for lineno, row in iter_jsonl(path, EXPECTED_ROW, CorpusError):
        where = f"{path}, line {lineno}"
        passage = _passage_from_row(row, where)
        _check_unique(passage.id, lineno, first_line, where, "line")
        passages.append(passage)
    if not passages:
        raise CorpusError(f"{path}: no passages (the file is empty or blank). Add one {EXPECTED_ROW} per line.")
    return passages


def _load_dataset(dataset: Any) -> list[Passage]:
    columns = set(dataset.column_names)
    if "id" not in columns or not ("contents" in columns or {"title", "text"} <= columns):
        raise CorpusError(
            f"dataset has columns {sorted(columns)}; a corpus needs 'id' and 'contents' (or 'title' and 'text'). "
            "Rename the columns with dataset.rename_column(old, new)."
        )
    passages: list[Passage] = []
    first_row: dict[str, int] = {}
    for batch in dataset.iter(batch_size=1024):
        names = list(batch)
        for values in zip(*(batch[name] for name in names)):
            rownum = len(passages) + 1
            where = f"dataset row {rownum}"
            passage = _passage_from_row(dict(zip(names, values)), where)
            _check_unique(passage.id, rownum, first_row, where, "row")
            passages.append(passage)
    if not passages:
        raise CorpusError("dataset has no rows; a corpus needs at least one passage.")
    return passages


def _passage_from_row(row: Any, where: str) -> Passage:
    if not isinstance(row, dict):
        raise CorpusError(f"{where}: expected a JSON object like {EXPECTED_ROW}, got {type(row).__name__}.")
    if "id" not in row:
        raise CorpusError(f"{where}: missing field 'id'. Each passage needs a unique id, e.g. {EXPECTED_ROW}.")
    pid = row["id"]
    if isinstance(pid, bool) or not isinstance(pid, str | int) or pid == "":
        raise CorpusError(f"{where}: field 'id' must be a non-empty string or an integer, got {pid!r}.")
    if "contents" in row:
        contents = row["contents"]
        if not isinstance(contents, str):
            raise CorpusError(
                f"{where}: field 'contents' must be a string, got {type(contents).__name__}. "
                f"Write it as in {EXPECTED_ROW}."
            )
        title, text = parse_contents(contents)
    elif "title" in row and "text" in row:
        title, text = row["title"], row["text"]
        for name, value in (("title", title), ("text", text)):
            if not isinstance(value, str):
                raise CorpusError(f"{where}: field '{name}' must be a string, got {type(value).__name__}.")
    else:
        raise CorpusError(
            f"{where}: missing field 'contents' (or the pair 'title' and 'text'). Write rows like {EXPECTED_ROW}."
        )
    texts = {"contents": row["contents"]} if "contents" in row else {"title": title, "text": text}
    for name, value in {"id": str(pid), **texts}.items():
        _check_unicode(value, where, name)
    return Passage(id=str(pid), title=title, text=text)


def _check_unicode(value: str, where: str, name: str) -> None:
    """Refuse text that is not proper Unicode (a lone surrogate such as a JSON `"\\ud800"`): it cannot be encoded to
    UTF-8, so every answer holding it would fail."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise CorpusError(
            f"{where}: field {name!r} holds {value[err.start]!r} at character {err.start}, a lone surrogate that is "
            "not valid Unicode. Fix the escape in the file (a surrogate pair must be complete) or drop the row."
        ) from None


def _check_unique(pid: str, number: int, first_seen: dict[str, int], where: str, unit: str) -> None:
    if pid in first_seen:
        raise CorpusError(
            f"{where}: duplicate id {pid!r} (first used on {unit} {first_seen[pid]}). Ids must be unique; "
            "drop or renumber the duplicate."
        )
    first_seen[pid] = number
