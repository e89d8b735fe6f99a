"""QA loading and validation: formats, defaults, and errors that name the file, the line and the field.

Run: `pytest tests/test_data.py`
"""

import doctest
import json

import datasets
import pytest
from helpers import write_lines

import mempo_trl.data as data
from mempo_trl.data import DataError, load_qa, read_jsonl, validate_qa_rows


GOOD = {"id": "q1", "question": "Who founded Pansik Textiles?", "golden_answers": ["Ada Lark", "Lark"]}


def test_doctests():
    assert doctest.testmod(data).failed == 0


def test_load_shipped_demo_splits(demo_paths):
    train, test = load_qa(demo_paths.train), load_qa(demo_paths.test)
    assert (len(train), len(test)) == (200, 50)
    assert train.features == test.features
    assert train.features["sub_answers"] == datasets.List(datasets.List(datasets.Value("string")))
    multi = next(row for row in train if row["data_source"] == "demo_multi")
    assert len(multi["sub_questions"]) == len(multi["sub_answers"]) >= 2
    single = next(row for row in train if row["data_source"] == "demo_1hop")
    assert single["sub_questions"] == [] and single["sub_answers"] == []


def test_defaults_fill_missing_optional_columns(tmp_path):
    path = write_lines(
        tmp_path / "qa.jsonl",
        [
            json.dumps({"question": "A?", "golden_answers": ["x"], "extra": 1}),
            json.dumps({"question": "B?", "golden_answers": ["b"], "data_source": "nq", "id": 7}),
        ],
    )
    ds = load_qa(path)
    assert ds.column_names[:6] == ["id", "question", "golden_answers", "data_source", "sub_questions", "sub_answers"]
    assert ds["id"] == ["0", "7"]
    assert ds["data_source"] == ["unknown", "nq"]
    assert ds["sub_questions"] == [[], []] and ds["sub_answers"] == [[], []]
    assert ds["extra"] == [1, None]


@pytest.mark.parametrize(
    ("row", "field", "hint"),
    [
        ({"golden_answers": ["x"]}, "question", "is missing"),
        ({"question": "  ", "golden_answers": ["x"]}, "question", "with visible text"),
        ({"question": "A?"}, "golden_answers", "is missing"),
        ({"question": "A?", "golden_answers": "a"}, "golden_answers", 'Wrap it in a list, e.g. ["a"]'),
        ({"question": "A?", "golden_answers": []}, "golden_answers", "empty list"),
        ({"question": "A?", "golden_answers": ["x", ""]}, "golden_answers[1]", "non-empty string"),
        ({"question": "A?", "golden_answers": ["x", None]}, "golden_answers[1]", "non-empty string"),
        (
            {
                "question": "1. A? 2. B?",
                "golden_answers": ["a; b"],
                "sub_questions": ["A?", "B?"],
                "sub_answers": [["a"]],
            },
            "sub_answers",
            "has 1 entries but 'sub_questions' has 2",
        ),
        (
            {"question": "1. A?", "golden_answers": ["x"], "sub_questions": ["A?"], "sub_answers": [[" "]]},
            "sub_answers[0][0]",
            "non-empty string",
        ),
        ({"question": "A?", "golden_answers": ["x"], "data_source": 3}, "data_source", "must be a string"),
    ],
)
def test_bad_rows_name_file_line_and_field(tmp_path, row, field, hint):
    path = write_lines(tmp_path / "qa.jsonl", [json.dumps(GOOD), "", json.dumps(row)])
    with pytest.raises(DataError) as err:
        load_qa(path)
    message = str(err.value)
    assert message.startswith(f"{path}, line 3: field '{field}' ")
    assert hint in message


def test_bad_json_line_names_file_and_line(tmp_path):
    path = write_lines(tmp_path / "qa.jsonl", [json.dumps(GOOD), json.dumps(GOOD), '{"question": "A?", "golden_'])
    with pytest.raises(DataError, match=r"qa\.jsonl, line 3: invalid JSON"):
        load_qa(path)
    with pytest.raises(DataError, match=r"qa\.jsonl, line 3: invalid JSON"):
        read_jsonl(path)


def test_non_object_line(tmp_path):
    path = write_lines(tmp_path / "qa.jsonl", [json.dumps(GOOD), '["A?", ["a"]]'])
    with pytest.raises(DataError, match=r"line 2: expected a JSON object, got list"):
        read_jsonl(path)


def test_read_jsonl_skips_blank_lines(tmp_path):
    path = write_lines(tmp_path / "c.jsonl", ['{"id": "0"}', "", "  ", '{"id": "1"}'])
    assert read_jsonl(path) == [{"id": "0"}, {"id": "1"}]


def test_json_parquet_and_directory_sources(tmp_path):
    rows = [GOOD, {"question": "B?", "golden_answers": ["b"]}]
    (tmp_path / "list.json").write_text(json.dumps(rows), encoding="utf-8")
    write_lines(tmp_path / "lines.json", [json.dumps(row) for row in rows])
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    flashrag = tmp_path / "nq"
    flashrag.mkdir()
    write_lines(flashrag / "test.jsonl", [json.dumps(row) for row in rows])
    datasets.DatasetDict({"dev": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    builder_dir = tmp_path / "builder" / "data"
    builder_dir.mkdir(parents=True)
    write_lines(builder_dir / "train.jsonl", [json.dumps(row) for row in rows])
    for source, split in [
        (tmp_path / "list.json", "train"),
        (tmp_path / "lines.json", "train"),
        (tmp_path / "rows.parquet", "train"),
        (flashrag, "test"),
        (tmp_path / "saved", "dev"),
        (tmp_path / "builder", "train"),
    ]:
        ds = load_qa(source, split=split)
        assert ds["question"] == ["Who founded Pansik Textiles?", "B?"], source
        assert ds["id"] == ["q1", "1"], source


def test_parquet_rows_are_validated_with_row_numbers(tmp_path):
    path = tmp_path / "bad.parquet"
    datasets.Dataset.from_list([GOOD, {"id": "q2", "question": "B?", "golden_answers": []}]).to_parquet(str(path))
    with pytest.raises(DataError, match=rf"{path}, line 2: field 'golden_answers' is an empty list"):
        load_qa(path)


def test_bad_json_file_and_unknown_sources(tmp_path):
    (tmp_path / "bad.json").write_text('[{"question": "A?",\n "golden_answers": ["x"],,}]', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.json, line 2: invalid JSON"):
        load_qa(tmp_path / "bad.json")
    (tmp_path / "obj.json").write_text('{"question": "A?"}', encoding="utf-8")
    with pytest.raises(DataError, match="must hold a list of row objects"):
        load_qa(tmp_path / "obj.json")
    (tmp_path / "rows.csv").write_text("question\nA?\n", encoding="utf-8")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        load_qa(tmp_path / "rows.csv")
    datasets.DatasetDict({"dev": datasets.Dataset.from_list([GOOD])}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError, match=r"no split 'train'; the saved splits are \['dev'\]"):
        load_qa(tmp_path / "saved")
    (tmp_path / "flashrag").mkdir()
    (tmp_path / "flashrag" / "train.jsonl").write_text(json.dumps(GOOD) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"no test\.jsonl .*split files are train\. Pass --dataset_split train"):
        load_qa(tmp_path / "flashrag", split="test")
    with pytest.raises(DataError, match="file not found"):
        load_qa(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n", encoding="utf-8")
    with pytest.raises(DataError, match="no rows"):
        load_qa(tmp_path / "empty.jsonl")


def test_validate_dataset_fills_defaults_and_casts_ids():
    ds = datasets.Dataset.from_dict({"question": ["A?", "B?"], "golden_answers": [["x"], ["b"]], "id": [10, 11]})
    out = validate_qa_rows(ds, "in-memory")
    assert out["id"] == ["10", "11"]
    assert out["data_source"] == ["unknown", "unknown"]
    assert out.features["sub_questions"] == datasets.List(datasets.Value("string"))
    with pytest.raises(DataError, match=r"^in-memory, line 2: field 'question' is missing"):
        validate_qa_rows([GOOD, {"golden_answers": ["b"]}], "in-memory")


# ------------------------------------------------------------------------ verl-style rows (Search-R1's parquet)

SEARCH_R1_PROMPT = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. ... Question: who wrote the opera carmen?\n"
)


def verl_row(target, **extra) -> dict:
    """A row as Search-R1's `data_process/nq_search.py` writes it, without the original columns."""
    return {
        "data_source": "nq",
        "prompt": [{"role": "user", "content": SEARCH_R1_PROMPT}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": target}},
        "extra_info": {"split": "train", "index": 0},
        **extra,
    }


def test_verl_parquet_answers_from_reward_model(tmp_path):
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list([verl_row(["Georges Bizet", "Bizet"]), verl_row(["Paris"])]).to_parquet(str(path))
    ds = load_qa(path)
    assert ds[0]["question"] == "who wrote the opera carmen?"
    assert ds[0]["golden_answers"] == ["Georges Bizet", "Bizet"] and ds[1]["golden_answers"] == ["Paris"]
    assert ds[0]["data_source"] == "nq" and ds[0]["id"] == "0" and "reward_model" in ds.column_names
    assert load_qa(tmp_path, split="train")["golden_answers"] == ds["golden_answers"]  # a directory of splits


def test_verl_rows_keep_their_own_question_and_answers(tmp_path):
    rows = [
        verl_row(["ignored"], question="Who composed Carmen?", golden_answers=["Bizet"]),
        verl_row(["Ulm"], extra_info={"split": "train", "index": 1, "question": "Where was Einstein born?"}),
    ]
    ds = validate_qa_rows(rows, "inline")
    assert (ds[0]["question"], ds[0]["golden_answers"]) == ("Who composed Carmen?", ["Bizet"])
    assert (ds[1]["question"], ds[1]["golden_answers"]) == ("Where was Einstein born?", ["Ulm"])
    assert data.verl_fields(verl_row("Ulm"))["golden_answers"] == ["Ulm"]  # a single target string


def test_verl_row_without_answers_names_the_field(tmp_path):
    path = write_lines(tmp_path / "verl.jsonl", [json.dumps(verl_row(["x"])), json.dumps(verl_row(None))])
    with pytest.raises(DataError, match=r"verl\.jsonl, line 2: field 'golden_answers' is missing.*ground_truth"):
        load_qa(path)
    parquet = tmp_path / "verl.parquet"
    datasets.Dataset.from_list([verl_row(["x"]), verl_row(None)]).to_parquet(str(parquet))
    with pytest.raises(DataError, match=r"line 2: field 'golden_answers' is missing"):
        load_qa(parquet)
