"""Fictional demo world: determinism, row schema, answerable supports, BM25 retrievability, shipped files.

Run: `pytest tests/test_demo_world.py`
"""

import doctest
import json
import re

import bm25s
import pytest

import mempo_trl.kit.demo_world as demo_world
from mempo_trl.cli import main
from mempo_trl.kit.demo_world import KINDS, generate_world, write_world


ROW_KEYS = [
    "id",
    "question",
    "golden_answers",
    "data_source",
    "supporting_ids",
    "hop_queries",
    "sub_questions",
    "sub_answers",
]


@pytest.fixture(scope="module")
def world():
    return generate_world(seed=0)


def test_doctests():
    assert doctest.testmod(demo_world).failed == 0


def test_same_seed_writes_identical_files(tmp_path):
    first = write_world(generate_world(seed=7), tmp_path / "a")
    second = write_world(generate_world(seed=7), tmp_path / "b")
    for a, b in zip(first, second):
        assert a.read_bytes() == b.read_bytes()


def test_different_seeds_differ():
    a, b = generate_world(seed=1), generate_world(seed=2)
    assert a.passages != b.passages
    assert [row["question"] for row in a.questions] != [row["question"] for row in b.questions]


def test_shipped_files_equal_a_fresh_generation(tmp_path, demo_paths):
    """If this fails, regenerate: `mempo-trl kit build-demo --output_dir src/mempo_trl/kit/demo`."""
    fresh = write_world(generate_world(), tmp_path)
    for shipped, new in zip(demo_paths, fresh):
        assert shipped.read_bytes() == new.read_bytes(), shipped.name


def test_shipped_sizes(demo_paths):
    counts = [sum(1 for _ in path.open(encoding="utf-8")) for path in demo_paths]
    assert 200 <= counts[0] <= 500  # corpus passages
    assert counts[1:] == [200, 50]  # train, test


def test_rows_have_one_schema_and_all_kinds(world):
    assert {row["data_source"] for row in world.questions} == set(KINDS)
    assert len({row["question"] for row in world.questions}) == len(world.questions)
    assert len({row["id"] for row in world.questions}) == len(world.questions)
    for row in world.questions:
        assert list(row) == ROW_KEYS
        assert len(row["supporting_ids"]) == len(row["hop_queries"]) >= 1
        assert row["golden_answers"] and all(row["golden_answers"])
        multi = row["data_source"] == "demo_multi"
        assert len(row["sub_questions"]) == len(row["sub_answers"]) == (len(row["supporting_ids"]) if multi else 0)
        if row["data_source"] in ("demo_2hop", "demo_compare"):
            assert len(row["supporting_ids"]) == 2


def test_multi_rows(world):
    rows = [row for row in world.questions if row["data_source"] == "demo_multi"]
    for row in rows:
        assert row["question"].split("\n") == [f"{n}. {q}" for n, q in enumerate(row["sub_questions"], 1)]
        assert row["golden_answers"] == ["; ".join(aliases[0] for aliases in row["sub_answers"])]


def test_person_answers_have_surname_alias(world):
    row = next(row for row in world.questions if row["question"].startswith("Who was born earlier"))
    full, surname = row["golden_answers"]
    assert full.endswith(" " + surname)


def test_born_earlier_answers_are_right(world):
    contents = {p["id"]: p["contents"] for p in world.passages}
    rows = [row for row in world.questions if row["question"].startswith("Who was born earlier")]
    assert rows
    for row in rows:
        passages = [contents[pid] for pid in row["supporting_ids"]]
        years = [int(re.search(r"born in (\d{4})", text).group(1)) for text in passages]
        earlier = passages[years.index(min(years))]
        assert earlier.startswith(f'"{row["golden_answers"][0]}"')


def test_supporting_passages_exist_and_hold_the_answers(world):
    contents = {p["id"]: p["contents"] for p in world.passages}
    assert len(contents) == len(world.passages)
    for p in world.passages:
        title, text = p["contents"].split("\n", 1)
        assert title.startswith('"') and title.endswith('"') and text
    for row in world.questions:
        assert all(pid in contents for pid in row["supporting_ids"])
        answers = row["sub_answers"] or [row["golden_answers"]]
        last_hops = row["supporting_ids"] if row["sub_answers"] else row["supporting_ids"][-1:]
        if row["data_source"] == "demo_compare":
            last_hops = row["supporting_ids"]  # the winner is named in one of the two passages
        for aliases in answers:
            assert any(alias in contents[pid] for alias in aliases for pid in last_hops), row


def test_bridge_queries_name_the_bridge_entity(world):
    contents = {p["id"]: p["contents"] for p in world.passages}
    for row in world.questions:
        if row["data_source"] == "demo_2hop":
            second_title = contents[row["supporting_ids"][1]].split("\n")[0].strip('"')
            assert second_title in row["hop_queries"][1]
            assert second_title in contents[row["supporting_ids"][0]]  # hop 1 reveals the bridge
            assert second_title not in row["question"]


def test_distractors_share_names_with_real_passages(world):
    titles = [p["contents"].split("\n")[0].strip('"') for p in world.passages]
    names = {e.name for e in world.entities}
    distractors = [t for t in titles if t not in names]
    assert len(distractors) >= 0.3 * len(world.entities)
    words = {word for name in names for word in name.split()}
    assert sum(any(w in words for w in t.split()) for t in distractors) >= 0.9 * len(distractors)


@pytest.fixture(scope="module")
def bm25(world):
    """Top-3 passage ids for a list of queries, with bm25s over the world's corpus."""
    ids = [p["id"] for p in world.passages]
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize([p["contents"] for p in world.passages], stopwords="en", show_progress=False))

    def top3(queries):
        tokens = bm25s.tokenize(queries, stopwords="en", show_progress=False)
        results, _ = retriever.retrieve(tokens, k=3, show_progress=False)
        return [{ids[j] for j in row} for row in results]

    return top3


def test_each_hop_is_retrievable_with_bm25_top3(world, bm25):
    """Each hop's gold passage is in BM25's top 3 for that hop's query (measured: 442 of 442 hops)."""
    queries = [q for row in world.questions for q in row["hop_queries"]]
    gold = [pid for row in world.questions for pid in row["supporting_ids"]]
    hits = [pid in top for pid, top in zip(gold, bm25(queries))]
    assert sum(hits) / len(hits) >= 0.95


def test_bridge_questions_need_two_searches(world, bm25):
    """A 2-hop question finds its first hop, rarely its second (measured: 100% and 4%)."""
    rows = [row for row in world.questions if row["data_source"] == "demo_2hop"]
    tops = bm25([row["question"] for row in rows])
    assert sum(row["supporting_ids"][0] in top for row, top in zip(rows, tops)) / len(rows) >= 0.95
    assert sum(row["supporting_ids"][1] in top for row, top in zip(rows, tops)) / len(rows) <= 0.2


def test_split_is_stratified(tmp_path, world):
    paths = write_world(world, tmp_path, test_fraction=0.2)
    train = [json.loads(line) for line in paths.train.open()]
    test = [json.loads(line) for line in paths.test.open()]
    assert len(train) + len(test) == len(world.questions)
    assert not {row["id"] for row in train} & {row["id"] for row in test}
    assert {row["data_source"] for row in test} == set(KINDS)


def test_rejects_tiny_worlds_and_bad_fractions(tmp_path):
    with pytest.raises(ValueError, match="num_entities"):
        generate_world(num_entities=10)
    with pytest.raises(ValueError, match="test_fraction"):
        write_world(generate_world(num_entities=30, num_questions=10), tmp_path, test_fraction=1.0)


def test_cli_build_demo(tmp_path, capsys):
    assert (
        main(
            [
                "kit",
                "build-demo",
                "--output_dir",
                str(tmp_path),
                "--seed",
                "3",
                "--num_entities",
                "40",
                "--num_questions",
                "30",
            ]
        )
        == 0
    )
    assert "train" in capsys.readouterr().out
    expected = write_world(generate_world(seed=3, num_entities=40, num_questions=30), tmp_path / "api")
    for name in ("corpus.jsonl", "train.jsonl", "test.jsonl"):
        assert (tmp_path / name).read_bytes() == (expected.corpus.parent / name).read_bytes()
