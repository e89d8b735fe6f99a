"""Corpus parsing and validation: `parse_contents`, `load_corpus` on JSONL and datasets, every malformed case.

Run: pytest tests/test_retrieval_corpus.py
"""

import json

import pytest
from datasets import Dataset
from helpers import write_lines
from hypothesis import given
from hypothesis import strategies as st

from mempo_trl.retrieval import CorpusError, Passage, load_corpus, parse_contents


def test_parse_contents_wiki18_row():
    assert parse_contents('"Aaron"\nAaron is a prophet.\nSecond line.') == (
        "Aaron",
        "Aaron is a prophet.\nSecond line.",
    )


def test_parse_contents_unquoted_title_and_no_title():
    assert parse_contents("Aaron\nAaron is a prophet.") == ("Aaron", "Aaron is a prophet.")
    assert parse_contents("just text, no title line") == ("", "just text, no title line")
    assert parse_contents('""Weird" Al"\ntext') == ('"Weird" Al', "text")


@given(title=st.text().filter(lambda t: "\n" not in t), text=st.text())
def test_contents_round_trip(title, text):
    assert parse_contents(Passage(id="1", title=title, text=text).contents) == (title, text)


def test_load_jsonl(tmp_path):
    path = write_lines(
        tmp_path / "corpus.jsonl",
        [
            json.dumps({"id": "1", "contents": '"Hamlet"\nA tragedy.'}),
            "",
            json.dumps({"id": 2, "title": "Paris", "text": "Capital of France."}),
        ],
    )
    assert load_corpus(path) == [Passage("1", "Hamlet", "A tragedy."), Passage("2", "Paris", "Capital of France.")]
    assert load_corpus(str(path)) == load_corpus(path)


def test_load_dataset_contents_and_title_text_columns():
    contents = Dataset.from_dict({"id": ["a", "b"], "contents": ['"T1"\nx', '"T2"\ny']})
    assert load_corpus(contents) == [Passage("a", "T1", "x"), Passage("b", "T2", "y")]
    title_text = Dataset.from_dict({"id": [1, 2], "title": ["T1", "T2"], "text": ["x", "y"], "extra": [0, 0]})
    assert load_corpus(title_text) == [Passage("1", "T1", "x"), Passage("2", "T2", "y")]


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (['{"id": "1", "contents": "ok"}', '{"id": "2", "contents": '], ["line 2", "invalid JSON", "JSON object"]),
        (['["1", "text"]'], ["line 1", "expected a JSON object", "got list"]),
        (['{"contents": "x"}'], ["line 1", "missing field 'id'"]),
        (['{"id": null, "contents": "x"}'], ["line 1", "field 'id'", "None"]),
        (['{"id": true, "contents": "x"}'], ["line 1", "field 'id'"]),
        (['{"id": "", "contents": "x"}'], ["line 1", "field 'id'", "non-empty"]),
        (['{"id": "1", "text": "x"}'], ["line 1", "missing field 'contents'", "'title' and 'text'"]),
        (['{"id": "1", "contents": 5}'], ["line 1", "field 'contents' must be a string, got int"]),
        (['{"id": "1", "title": "T", "text": ["x"]}'], ["line 1", "field 'text' must be a string, got list"]),
        (
            ['{"id": "1", "contents": "a"}', '{"id": "2", "contents": "b"}', '{"id": "1", "contents": "c"}'],
            ["line 3", "duplicate id '1'", "first used on line 1", "unique"],
        ),
        ([], ["no passages"]),
        (["", "   "], ["no passages"]),
    ],
)
def test_malformed_jsonl_names_file_line_and_field(tmp_path, lines, expected):
    path = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(CorpusError) as info:
        load_corpus(path)
    assert str(path) in str(info.value)
    for fragment in expected:
        assert fragment in str(info.value)


def test_non_utf8_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"id": "1", "contents": "ok"}\n{"id": "2", "contents": "caf\xe9"}\n')
    with pytest.raises(CorpusError, match=r"line 2: not UTF-8.*Re-encode"):
        load_corpus(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl does not exist"):
        load_corpus(tmp_path / "nope.jsonl")


def test_malformed_datasets():
    with pytest.raises(CorpusError, match=r"columns \['id', 'passage'\].*rename_column"):
        load_corpus(Dataset.from_dict({"id": ["1"], "passage": ["x"]}))
    with pytest.raises(CorpusError, match="no rows"):
        load_corpus(Dataset.from_dict({"id": [], "contents": []}))
    with pytest.raises(CorpusError, match="dataset row 3: duplicate id 'a' \\(first used on row 1\\)"):
        load_corpus(Dataset.from_dict({"id": ["a", "b", "a"], "contents": ["x", "y", "z"]}))
    with pytest.raises(CorpusError, match="dataset row 2: field 'contents' must be a string, got NoneType"):
        load_corpus(Dataset.from_dict({"id": ["a", "b"], "contents": ["x", None]}))


def test_unsupported_source_type():
    with pytest.raises(TypeError, match="path to a JSONL file or a datasets.Dataset"):
        load_corpus([{"id": "1", "contents": "x"}])
