"""Multi-objective rows (`mempo_trl.compose`, `mempo-trl compose`) and the objectives sweep (`mempo-trl eval
--objectives`): composed rows load back, score part by part, and the sweep's table is the evaluation's accounting."""

import doctest
import json
import re

import datasets
import pytest
from helpers import one_error_line

from mempo_trl import compose as compose_module
from mempo_trl import sweep as sweep_module
from mempo_trl.cli import main
from mempo_trl.compose import compose_objectives, composition_report
from mempo_trl.data import DataError, load_qa
from mempo_trl.rewards import mempo_all_parts_reward, mempo_outcome_reward


def qa_rows(n: int, prefix: str = "q", **extra) -> list[dict]:
    return [
        {
            "id": f"{prefix}{i}",
            "question": f"Question {prefix}{i}?",
            "golden_answers": [f"A{i}", f"alias {i}"],
            **extra,
        }
        for i in range(n)
    ]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def done(answer: str) -> str:
    return f"<mem> notes </mem>\n<think> done </think>\n<answer> {answer} </answer>"


def test_doctests():
    assert doctest.testmod(compose_module).failed == 0
    assert doctest.testmod(sweep_module).failed == 0


# ---------------------------------------------------------------- compose_objectives


def test_a_row_numbers_its_questions_and_joins_the_first_aliases():
    rows = [
        {
            "id": "7",
            "question": " Where was Ada born? ",
            "golden_answers": ["Ulm", "Ulm, Germany"],
            "data_source": "nq",
        },
        {"id": "9", "question": "Who is Ada's brother?", "golden_answers": ["Max"], "data_source": "hotpotqa"},
    ]
    (row,) = compose_objectives(rows, 2, seed=0)
    first, second = (0, 1) if row["sub_ids"] == ["7", "9"] else (1, 0)
    questions = ["Where was Ada born?", "Who is Ada's brother?"]
    aliases = [["Ulm", "Ulm, Germany"], ["Max"]]
    assert row["question"] == f"1. {questions[first]}\n2. {questions[second]}"
    assert row["sub_questions"] == [questions[first], questions[second]]
    assert row["sub_answers"] == [aliases[first], aliases[second]]
    assert row["golden_answers"] == [f"{aliases[first][0]}; {aliases[second][0]}"]
    assert row["sub_data_sources"] == [["nq", "hotpotqa"][first], ["nq", "hotpotqa"][second]]
    assert row["data_source"] == "hotpotqa+nq" and row["num_objectives"] == 2


def test_one_objective_keeps_the_question_as_it_is():
    (row,) = compose_objectives(qa_rows(1), 1)
    assert row["question"] == "Question q0?" and row["golden_answers"] == ["A0", "alias 0"]
    assert row["sub_questions"] == [] and row["sub_answers"] == [] and row["sub_ids"] == ["q0"]


def test_rows_are_seeded_and_use_each_question_once():
    rows = qa_rows(10)
    first = compose_objectives(rows, 3, seed=1)
    assert first == compose_objectives(rows, 3, seed=1)
    assert [r["sub_ids"] for r in first] != [r["sub_ids"] for r in compose_objectives(rows, 3, seed=2)]
    used = [i for r in first for i in r["sub_ids"]]
    assert len(first) == 3 and len(used) == len(set(used)) == 9
    assert len(compose_objectives(rows, 3, seed=1, max_rows=2)) == 2


def test_no_row_mixes_splits():
    rows = qa_rows(5, "t", extra_info={"split": "train"}) + qa_rows(5, "v", extra_info={"split": "test"})
    for seed in range(5):
        composed = compose_objectives(rows, 2, seed=seed)
        assert len(composed) == 4  # two per split: one question of each is left over
        for row in composed:
            assert len({part_id[0] for part_id in row["sub_ids"]}) == 1, row["sub_ids"]


def test_aliases_holding_the_separator_are_dropped():
    rows = [
        {"id": "a", "question": "Which pair?", "golden_answers": ["x; y", "x and y"]},
        {"id": "b", "question": "Only a pair?", "golden_answers": ["p; q"]},
        {"id": "c", "question": "Which one?", "golden_answers": ["z"]},
    ]
    (row,) = compose_objectives(rows, 2, seed=0)
    assert sorted(row["sub_ids"]) == ["a", "c"]  # b has no alias a ';'-separated answer can match
    assert ["x and y"] in row["sub_answers"]


@pytest.mark.parametrize(
    ("problem", "expected"),
    [
        ("too_many_objectives", ["4 objectives", "3 usable question", "fewer objectives"]),
        ("empty_golds", ["row 2", "golden_answers"]),
        ("duplicate_id", ["row 3", "'id'", "'q0'", "row 1"]),
    ],
)
def test_bad_sources_are_refused(problem, expected):
    rows = qa_rows(3)
    num_objectives = 2
    if problem == "too_many_objectives":
        num_objectives = 4
    elif problem == "empty_golds":
        rows[1]["golden_answers"] = []
    else:
        rows[2]["id"] = "q0"
    with pytest.raises(DataError) as err:
        compose_objectives(rows, num_objectives, source_name="qa.jsonl")
    assert all(part in str(err.value) for part in expected), str(err.value)


# ---------------------------------------------------------------- mempo-trl compose


def test_compose_cli_rows_load_back_and_score_part_by_part(tmp_path, capsys):
    """A FlashRAG directory (train + test jsonl) and a Search-R1 verl-style parquet, pooled: every split composed on
    its own, the rows `load_qa`-able, and the share-of-parts / all-parts rewards score a scripted answer."""
    flashrag = tmp_path / "nq"
    flashrag.mkdir()
    write_jsonl(flashrag / "train.jsonl", qa_rows(6, "n"))
    write_jsonl(flashrag / "test.jsonl", qa_rows(5, "m"))
    verl = [
        {
            "id": f"h{i}",
            "data_source": "hotpotqa",
            "prompt": [{"role": "user", "content": f"Answer it. Question: hotpot question {i}?"}],
            "reward_model": {"ground_truth": {"target": [f"H{i}"]}, "style": "rule"},
        }
        for i in range(3)
    ]
    parquet_dir = tmp_path / "search_r1"
    parquet_dir.mkdir()
    for split in ("train", "test"):
        datasets.Dataset.from_list(verl).to_parquet(str(parquet_dir / f"{split}.parquet"))
    out = tmp_path / "multi"
    argv = ["compose", "--dataset_name", str(flashrag), str(parquet_dir), "--dataset_split", "train", "test"]
    assert main([*argv, "--objectives", "2", "4", "--output_dir", str(out), "--seed", "3"]) == 0

    report = json.loads((out / "compose.json").read_text())
    assert report["objectives"]["2"]["train"]["num_rows"] == 4 and report["objectives"]["4"]["test"]["num_rows"] == 2
    assert report["objectives"]["4"]["train"]["questions_unused"] == 1
    for k in (2, 4):
        for split, prefix in (("train", "n"), ("test", "m")):
            rows = list(load_qa(out / f"k{k}", split=split))
            assert all(len(r["sub_questions"]) == len(r["sub_answers"]) == k for r in rows)
            ids = [i for r in rows for i in r["sub_ids"]]
            assert len(ids) == len(set(ids)) and all(i[0] in (prefix, "h") for i in ids)
            assert sum(r["sub_data_sources"].count("hotpotqa") for r in rows) <= 3

    rows = list(load_qa(out / "k2", split="test"))
    row = next(r for r in rows if "hotpotqa" in r["sub_data_sources"])
    right = [aliases[-1] for aliases in row["sub_answers"]]  # any alias of each part counts
    half = [right[0], "wrong"]
    completions = [done("; ".join(right)), done("; ".join(half)), done(right[0])]
    columns = {"golden_answers": [row["golden_answers"]] * 3, "sub_answers": [row["sub_answers"]] * 3}
    assert mempo_outcome_reward(["p"] * 3, completions, **columns) == [1.0, 0.5, 0.5]
    assert mempo_all_parts_reward(["p"] * 3, completions, **columns) == [1.0, 0.0, 0.0]
    assert "hotpot question" in row["question"] and row["question"].startswith("1. ")


@pytest.mark.parametrize("problem", ["too_many_objectives", "duplicate_id", "repeated_objectives"])
def test_compose_cli_bad_input_is_one_line_and_writes_nothing(problem, tmp_path, capsys):
    rows = qa_rows(3)
    objectives, expected = ["2"], []
    if problem == "too_many_objectives":
        objectives, expected = ["2", "5"], ["5 objectives", "3 usable", "qa.jsonl [train]"]
    elif problem == "duplicate_id":
        rows[1]["id"] = "q0"
        expected = ["row 2", "'id'", "'q0'"]
    else:
        objectives, expected = ["2", "2"], ["distinct", "[2, 2]"]
    source = write_jsonl(tmp_path / "qa.jsonl", rows)
    out = tmp_path / "out"
    code = main(["compose", "--dataset_name", source, "--objectives", *objectives, "--output_dir", str(out)])
    line = one_error_line(capsys)
    assert code == 2 and all(part in line for part in expected), line
    assert not list(out.glob("k*")) and not (out / "compose.json").exists()


# ---------------------------------------------------------------- the sweep (mempo-trl eval --objectives)


class PartlyRight:
    """`GenerateFn`: rounds 1 and 2 search (``facts 1``, ``facts 2``); round 3 answers ``answers[question]`` (the
    question found in the prompt)."""

    def __init__(self, tokenizer, answers: dict[str, str]):
        self.tokenizer, self.answers = tokenizer, answers

    def __call__(self, prompts):
        out = []
        for ids in prompts:
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            question = re.search(r"Question: (.*?)<\|im_end\|>", text, re.DOTALL).group(1)
            if "facts 2" in text:
                action = ("answer", self.answers[question])
            else:
                action = ("search", "facts 2" if "facts 1" in text else "facts 1")
            turn = f"<mem> notes </mem>\n<think> thinking </think>\n<{action[0]}> {action[1]} </{action[0]}>"
            out.append(self.tokenizer(turn, add_special_tokens=False).input_ids)
        return out, None


def test_sweep_table_on_a_scripted_agent(tiny_model_dir):
    """Every K=1 row answered right; every K=2 row with its first part right and its second wrong: share of parts
    0.5, all parts 0, in both context modes, with two searches and three turns per question; the full history's
    third context holds both searches, the memory's only the last."""
    from helpers import EchoRetriever

    from mempo_trl.agent import MemPOAgent
    from mempo_trl.loading import load_tokenizer
    from mempo_trl.protocol import TurnProtocol
    from mempo_trl.sweep import evaluate_objectives, objectives_table

    tokenizer = load_tokenizer(tiny_model_dir)
    pool = qa_rows(6)
    rows = {1: compose_objectives(pool, 1, max_rows=2), 2: compose_objectives(pool, 2, max_rows=2)}
    answers = {r["question"]: r["golden_answers"][0] for r in rows[1]}
    answers.update({r["question"]: f"{r['sub_answers'][0][1]}; nope" for r in rows[2]})
    agent = MemPOAgent(tokenizer, EchoRetriever(), PartlyRight(tokenizer, answers), TurnProtocol(max_turns=3))
    table = objectives_table(evaluate_objectives(agent, rows, progress=False))
    scores = [
        (r["objectives"], r["context_mode"], r["em"], r["f1"], r["em_all_parts"], r["f1_all_parts"]) for r in table
    ]
    assert scores == [
        (1, "memory", 1.0, 1.0, 1.0, 1.0),
        (1, "full_history", 1.0, 1.0, 1.0, 1.0),
        (2, "memory", 0.5, 0.5, 0.0, 0.0),
        (2, "full_history", 0.5, 0.5, 0.0, 0.0),
    ]
    assert all(r["num_questions"] == 2 and r["format_valid"] == 1.0 for r in table)
    assert all(r["turns_per_question"] == 3.0 and r["searches_per_question"] == 2.0 for r in table)
    for memory, full in (table[0:2], table[2:4]):
        assert memory["peak_context_tokens"] < full["peak_context_tokens"]
        assert memory["total_tokens_per_question"] < full["total_tokens_per_question"]


@pytest.fixture(scope="module")
def learner_world(tmp_path_factory):
    """The shipped learner and the single-question rows of its world's test split."""
    from mempo_trl.kit.learner import shipped_learner, write_learner_world

    world = write_learner_world(tmp_path_factory.mktemp("learner_world"))
    single = [row for row in map(json.loads, world.test.read_text().splitlines()) if not row["sub_answers"]]
    source = world.test.parent / "single.jsonl"
    write_jsonl(source, single[:12])
    return shipped_learner(), source, world.corpus


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMPO_CACHE", str(tmp_path / "cache"))


def test_eval_objectives_sweep_end_to_end(learner_world, tmp_path, cache, capsys):
    """Composed per K from the source (seeded as `compose_objectives`), played in both modes; the table is the
    evaluation's per-question accounting, the figure is drawn."""
    import matplotlib.image

    model, source, corpus = learner_world
    out = tmp_path / "sweep"
    argv = ["eval", "--model_name_or_path", str(model), "--dataset_name", str(source), "--corpus", str(corpus)]
    argv += ["--objectives", "1", "2", "--max_eval_samples", "3", "--context_mode", "both", "--max_turns", "3"]
    assert main([*argv, "--output_dir", str(out), "--disable_tqdm", "true", "--seed", "5"]) == 0
    printed = capsys.readouterr().out
    assert "EM(all)" in printed and "objectives.png" in printed

    report = json.loads((out / "objectives.json").read_text())
    assert report["settings"]["objectives"] == [1, 2]
    assert [(r["objectives"], r["context_mode"]) for r in report["table"]] == [
        (1, "memory"),
        (1, "full_history"),
        (2, "memory"),
        (2, "full_history"),
    ]
    assert set(report["comparison"]) == {"1", "2"}
    lines = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    pool = list(load_qa(source))
    for entry in report["table"]:
        k, mode = entry["objectives"], entry["context_mode"]
        records = [r for r in lines if r["objectives"] == k and r["context_mode"] == mode]
        expected = [r["question"] for r in compose_objectives(pool, k, seed=5, max_rows=3)]
        assert [r["question"] for r in records] == expected and entry["num_questions"] == 3
        for key in ("em", "f1", "em_all_parts", "f1_all_parts", "total_tokens", "peak_context_tokens"):
            column = "total_tokens_per_question" if key == "total_tokens" else key
            assert entry[column] == pytest.approx(sum(r[key] for r in records) / 3), key
        assert entry["turns_per_question"] == pytest.approx(sum(r["num_turns"] for r in records) / 3)
        assert entry["searches_per_question"] == pytest.approx(sum(r["num_searches"] for r in records) / 3)
        for r in records:
            assert r["em_all_parts"] == float(r["em"] == 1.0) and r["f1_all_parts"] <= r["f1"]
            assert len(r["sub_answers"]) == (0 if k == 1 else k)
    image = matplotlib.image.imread(out / "objectives.png")
    assert image.ndim == 3 and image.shape[1] > 800


def test_eval_objectives_reads_a_composed_directory(learner_world, tmp_path, cache, capsys):
    model, source, corpus = learner_world
    composed = tmp_path / "composed"
    argv = ["compose", "--dataset_name", str(source), "--dataset_split", "test", "--objectives", "2", "3"]
    assert main([*argv, "--output_dir", str(composed)]) == 0
    out = tmp_path / "sweep"
    argv = ["eval", "--model_name_or_path", str(model), "--dataset_name", str(composed), "--corpus", str(corpus)]
    argv += ["--objectives", "3", "--max_eval_samples", "2", "--max_turns", "2", "--disable_tqdm", "true"]
    assert main([*argv, "--output_dir", str(out)]) == 0
    played = [json.loads(line)["question"] for line in (out / "trajectories.jsonl").read_text().splitlines()]
    written = [json.loads(line)["question"] for line in (composed / "k3" / "test.jsonl").read_text().splitlines()]
    assert played == written[:2]

    capsys.readouterr()
    code = main([*argv, "--objectives", "4", "--output_dir", str(tmp_path / "missing")])
    line = one_error_line(capsys)
    assert code == 2 and str(composed / "k4" / "test.jsonl") in line and "--objectives 4" in line, line


def test_compose_reads_a_saved_datasets_split(tmp_path, capsys):
    """A `datasets` source (here a `save_to_disk` DatasetDict, read offline): only the asked split is composed."""
    splits = {"train": qa_rows(4, "t"), "test": qa_rows(4, "v")}
    datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}).save_to_disk(
        str(tmp_path / "saved")
    )
    out = tmp_path / "out"
    argv = ["compose", "--dataset_name", str(tmp_path / "saved"), "--dataset_split", "test", "--objectives", "2"]
    assert main([*argv, "--output_dir", str(out)]) == 0
    rows = list(load_qa(out / "k2", split="test"))
    assert len(rows) == 2 and sorted(i for r in rows for i in r["sub_ids"]) == ["v0", "v1", "v2", "v3"]
    assert not (out / "k2" / "train.jsonl").exists()


def test_rows_that_are_already_multi_objective_are_left_out_and_counted():
    rows = qa_rows(5)
    rows[0].update(sub_questions=["a?", "b?"], sub_answers=[["a"], ["b"]])
    composed = compose_objectives(rows, 2, seed=0)
    assert len(composed) == 2 and all("q0" not in row["sub_ids"] for row in composed)
    report = composition_report(rows, composed)
    assert report["multi_objective_rows_left_out"] == 1 and report["questions_unused"] == 1


def test_too_few_questions_says_which_rows_were_left_out_and_why():
    """Round-6 probe R-e: a row whose only gold holds ';' cannot be a part (';' joins the parts): the refusal says so."""
    rows = [
        {"id": "a", "question": "Population of Sedo?", "golden_answers": ["634,400; 7"]},
        {"id": "b", "question": "Capital of Niham?", "golden_answers": ["Mithbopath"]},
    ]
    with pytest.raises(DataError) as raised:
        compose_objectives(rows, 2, source_name="comma.jsonl")
    message = str(raised.value)
    assert "1 usable question(s) (1 row(s) whose every gold answer holds ';'" in message
    assert "fewer objectives" in message
