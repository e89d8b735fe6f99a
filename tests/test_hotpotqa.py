"""HotpotQA through the real CLI, on the 30-question fixture of `tests/data/hotpotqa` (CC BY-SA 4.0, see its README):
`mempo-trl hotpotqa` (rows, one deduplicated corpus with stable ids, split safety, one-line errors)."""

import doctest
import json
from pathlib import Path

import pytest
from helpers import one_error_line

import mempo_trl.hotpotqa as hotpotqa_module
from mempo_trl.cli import main
from mempo_trl.data import load_qa, read_jsonl
from mempo_trl.hotpotqa import LICENSE, passage_id
from mempo_trl.retrieval.corpus import parse_contents


FIXTURE = Path(__file__).parent / "data" / "hotpotqa"


@pytest.fixture(autouse=True)
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """The fixture converted by `mempo-trl hotpotqa` (both splits)."""
    out = tmp_path_factory.mktemp("hotpotqa") / "data"
    assert main(["hotpotqa", "--dataset_name", str(FIXTURE), "--output_dir", str(out)]) == 0
    return out


def raw(split: str) -> list[dict]:
    return read_jsonl(FIXTURE / f"{split}.jsonl")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def test_doctests():
    for module in (hotpotqa_module,):
        assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0


def test_conversion_writes_rows_with_their_hops_and_one_corpus(converted):
    corpus = {p["id"]: parse_contents(p["contents"]) for p in read_jsonl(converted / "corpus.jsonl")}
    paragraphs = {
        (title, "".join(sentences).strip())
        for split in ("train", "dev")
        for row in raw(split)
        for title, sentences in zip(row["context"]["title"], row["context"]["sentences"])
    }
    assert len(corpus) == len(read_jsonl(converted / "corpus.jsonl")) == len(paragraphs) == 294
    assert set(corpus.values()) == paragraphs
    for split in ("train", "dev"):
        rows = read_jsonl(converted / f"{split}.jsonl")
        sources = {row["id"]: row for row in raw(split)}
        assert [row["id"] for row in rows] == list(sources)
        assert [row["data_source"] for row in rows].count("hotpotqa_comparison") == 5
        for row in rows:
            source = sources[row["id"]]
            assert row["golden_answers"] == [source["answer"]] and row["type"] == source["type"]
            assert sorted(row["supporting_titles"]) == sorted(set(source["supporting_facts"]["title"]))
            context = dict(zip(source["context"]["title"], source["context"]["sentences"]))
            for title, pid, fact in zip(row["supporting_titles"], row["supporting_ids"], row["hop_facts"]):
                numbers = [n for t, n in zip(*source["supporting_facts"].values()) if t == title]
                assert corpus[pid][0] == title and fact == " ".join(context[title][n].strip() for n in numbers)
            if row["type"] == "bridge":
                assert row["hop_queries"] == [row["question"], row["supporting_titles"][1]]
            else:
                assert row["hop_queries"] == row["supporting_titles"]
        assert len(load_qa(converted, split=split)) == 15  # the rest of the project reads them
    first = read_jsonl(converted / "train.jsonl")[0]  # by hand: the Kerensky question's supporting_facts
    assert first["supporting_titles"] == ["Socialist Revolutionary Party", "Russian Civil War"]
    assert first["hop_facts"][0].startswith("The anti-Bolshevik faction of this party, known as the Right SRs")
    assert first["golden_answers"] == ["October 1922"] and first["data_source"] == "hotpotqa_bridge"
    report = json.loads((converted / "hotpotqa_report.json").read_text())
    assert report["splits"]["train"] == {"questions": 15, "bridge": 10, "comparison": 5}
    assert (report["passages"], report["paragraphs_read"], report["duplicates_dropped"]) == (294, 294, 0)
    assert report["license"] == LICENSE and "CC BY-SA 4.0" in LICENSE


def test_ids_are_stable_across_runs_and_subsets_and_paragraphs_are_pooled_once(converted, tmp_path):
    # A second run on 5 train questions and a "test" split that repeats 3 of them under new ids: the same
    # paragraphs get the same ids, and the repeated paragraphs are written once.
    repeated = [{**row, "id": f"copy{i}"} for i, row in enumerate(raw("train")[:3])]
    write_jsonl(tmp_path / "src" / "train.jsonl", raw("train")[:5])
    write_jsonl(tmp_path / "src" / "test.jsonl", repeated)
    out = tmp_path / "subset"
    assert main(["hotpotqa", "--dataset_name", str(tmp_path / "src"), "--output_dir", str(out)]) == 0
    full = {p["id"]: p["contents"] for p in read_jsonl(converted / "corpus.jsonl")}
    subset = read_jsonl(out / "corpus.jsonl")
    assert all(full[p["id"]] == p["contents"] for p in subset)
    assert len(subset) == 50 and json.loads((out / "hotpotqa_report.json").read_text())["duplicates_dropped"] == 30
    ids = {row["id"]: row["supporting_ids"] for row in read_jsonl(converted / "train.jsonl")}
    assert [row["supporting_ids"] for row in read_jsonl(out / "test.jsonl")] == [
        ids[r["id"]] for r in raw("train")[:3]
    ]
    title, text = parse_contents(subset[0]["contents"])
    assert subset[0]["id"] == passage_id(title, text)


def test_a_question_in_two_splits_is_refused_before_anything_is_written(tmp_path, capsys):
    write_jsonl(tmp_path / "src" / "train.jsonl", raw("train"))
    write_jsonl(tmp_path / "src" / "dev.jsonl", [*raw("dev")[:2], raw("train")[4]])
    out = tmp_path / "out"
    args = ["--dataset_name", str(tmp_path / "src"), "--dataset_split", "train", "dev", "--output_dir", str(out)]
    assert main(["hotpotqa", *args]) == 2
    line = one_error_line(capsys)
    assert f"{tmp_path / 'src' / 'train.jsonl'}, row 5 (split train)" in line
    assert line.startswith(f"error: {tmp_path / 'src' / 'dev.jsonl'}, row 3: field 'id'")
    assert "one split only" in line
    assert not list(out.glob("*.jsonl"))


def _broken(field: str) -> dict:
    row = json.loads(json.dumps(raw("dev")[1]))
    if field == "answer":
        del row["answer"]
    elif field == "supporting_facts.sent_id":
        row["supporting_facts"]["sent_id"] = [str(i) for i in row["supporting_facts"]["sent_id"]]
    else:
        row["supporting_facts"]["title"][1] = "Not A Title Of The Context"
    return row


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ("answer", "field 'answer' is missing"),
        ("supporting_facts.sent_id", "field 'supporting_facts.sent_id' must be a list of sentence numbers"),
        ("supporting_facts.title[1]", "field 'supporting_facts.title[1]' is 'Not A Title Of The Context', which is"),
    ],
)
def test_bad_rows_get_one_error_line_naming_file_row_and_field(field, message, tmp_path, capsys):
    source = write_jsonl(tmp_path / "dev.jsonl", [raw("dev")[0], _broken(field)])
    out = tmp_path / "out"
    assert main(["hotpotqa", "--dataset_name", str(source), "--output_dir", str(out)]) == 2
    assert one_error_line(capsys).startswith(f"error: {source}, row 2: {message}")
    assert not list(out.glob("*.jsonl"))
