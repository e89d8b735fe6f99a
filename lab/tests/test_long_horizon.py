"""The long-horizon task family (`lab/horizon_world.py`) and its experiment, `lab/long_horizon.py`."""

import doctest
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

import horizon_world
import long_horizon
import pytest
from helpers import one_error_line
from horizon_world import HORIZON_SPLITS, generate_horizon_world

from mempo_trl.data import read_jsonl
from mempo_trl.kit.learner import LEARNER_INSTRUCTION
from mempo_trl.protocol import TurnProtocol
from mempo_trl.rewards import outcome_score


LAB = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def world():
    return generate_horizon_world(
        seed=3,
        num_entities=80,
        rows_per_horizon={"warm": 20, "rl": 10, "validation": 5, "test": 8},
        horizons=(1, 2, 4, 6),
    )


def test_rows_ask_k_facts_about_k_entities(world):
    for rows in world.splits.values():
        for row in rows:
            k = int(row["data_source"].removeprefix("horizon_"))
            assert len(row["sub_questions"]) == len(row["sub_answers"]) == len(row["hop_queries"]) == k
            assert row["golden_answers"] == ["; ".join(answers[0] for answers in row["sub_answers"])]
            assert row["question"].count("\n") == k - 1
    counts = {k: sum(r["data_source"] == f"horizon_{k}" for r in world.splits["test"]) for k in (1, 2, 4, 6)}
    assert counts == {1: 8, 2: 8, 4: 8, 6: 8}


def test_splits_share_no_question_and_no_asked_entity(world):
    questions = {name: {row["question"] for row in rows} for name, rows in world.splits.items()}
    pools = {name: set(names) for name, names in world.pools.items()}
    for a in HORIZON_SPLITS:
        for b in HORIZON_SPLITS:
            if a < b:
                assert not questions[a] & questions[b]
                assert not pools[a] & pools[b]
    for name, rows in world.splits.items():
        others = set().union(*(pools[o] for o in HORIZON_SPLITS if o != name))
        for row in rows:
            for question in row["sub_questions"]:
                assert any(entity in question for entity in pools[name]), question
                assert not any(f" {entity}" in question for entity in others), question


def test_each_objective_earns_its_share_of_em_and_f1():
    row = generate_horizon_world(
        seed=3, num_entities=60, rows_per_horizon={"warm": 1, "rl": 1, "validation": 1, "test": 1}, horizons=(4,)
    ).splits["test"][0]
    values = [answers[0] for answers in row["sub_answers"]]
    half = "; ".join(values[:2] + ["0", "0"])
    scores = outcome_score(half, row["golden_answers"], row["sub_answers"])
    assert scores.em == 0.5 and scores.f1 == 0.5 and scores.per_question_em == (1.0, 1.0, 0.0, 0.0)
    assert outcome_score("; ".join(values), row["golden_answers"], row["sub_answers"]).em == 1.0


@pytest.mark.parametrize("module", [horizon_world, long_horizon], ids=lambda m: m.__name__)
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


def test_targets_are_computed_from_the_arms():
    module = long_horizon

    def cell(em, std, tokens):
        return {"final_em_mean": em, "final_em_std": std, "tokens_per_question": tokens}

    horizons = {
        "4": {
            "mempo": cell(0.5, 0.02, 400),
            "outcome_only": cell(0.4, 0.03, 410),
            "full_history": cell(0.45, 0.01, 900),
        },
        "8": {
            "mempo": cell(0.3, 0.02, 700),
            "outcome_only": cell(0.29, 0.05, 700),
            "full_history": cell(0.1, 0.01, 2000),
        },
    }
    result = module.targets(horizons)
    four, eight = result["by_horizon"]["4"], result["by_horizon"]["8"]
    assert four["token_ratio_vs_full_history"] == pytest.approx(400 / 900) and four["tokens_met"]
    assert four["em_minus_outcome_only"] == pytest.approx(0.1) and four["beats_outcome_only"]
    assert eight["em_minus_outcome_only"] == pytest.approx(0.01) and not eight["beats_outcome_only"]
    assert result["gap_grows_with_k"] is True  # 0.05 at K=4, 0.2 at K=8


@pytest.mark.slow
def test_quick_mode_runs_every_arm_and_resumes(tmp_path, capsys, monkeypatch):
    from mempo_trl import MemPOTrainer

    module = long_horizon
    out = tmp_path / "lh"
    searched = []  # what each run's RL episodes search
    train = MemPOTrainer.train
    monkeypatch.setattr(MemPOTrainer, "train", lambda self, **kw: searched.append(self.retriever) or train(self, **kw))
    kept = tmp_path / "kept"  # what lab/results/long_horizon_runs is for the default settings
    assert module.main(["--quick", "--out", str(out), "--records", str(kept)]) == 0
    summary = json.loads((out / "long_horizon.json").read_text())
    assert sorted(summary["horizons"]) == ["1", "4"]
    for cells in summary["horizons"].values():
        assert sorted(cells) == ["full_history", "mempo", "outcome_only", "outcome_only_dynamic"]
        assert cells["full_history"]["memory_recall"] is None  # no memory to measure
        assert "context_overflow" not in cells["mempo"]  # reported only with a context budget
        assert all(cell["seeds"] == [0] for cell in cells.values())
        for cell in cells.values():  # per seed, share and all-parts EM, in both context modes
            assert len(cell["final_em_per_seed"]) == len(cell["final_all_parts_em_per_seed"]) == 1
            assert 0.0 <= cell["final_all_parts_em_mean"] <= cell["final_em_mean"] <= 1.0
            assert sorted(cell["by_context_mode"]) == ["full_history", "memory"]
            for mode in cell["by_context_mode"].values():  # searches, turns and tokens too
                assert set(mode) == {field + "_per_seed" for field in module.PER_SEED}
                assert len(mode["searches_per_seed"]) == len(mode["tokens_per_question_per_seed"]) == 1
            assert cell["searches_per_seed"] == [cell["searches"]] and len(cell["machine_per_seed"]) == 1
    assert sum(summary["run_machines"].values()) == 4
    assert summary["arms"]["outcome_only_dynamic"] == {"memory_coef": 0.0, "dynamic_sampling": "refill"}
    assert summary["settings"]["rl_corpus"] == module.RL_CORPUS
    dynamic = json.loads((out / "runs" / "test" / "outcome_only_dynamic_s0" / "run.json").read_text())
    assert dynamic["after"] == dynamic["after_by_mode"]["memory"]
    # RL searches no passage about a validation or test entity; evaluation searches the whole corpus
    pools = json.loads((out / "world" / "world.json").read_text())["pools"]
    held_out = pools["validation"] + pools["test"]
    naming = re.compile(r"\b(?:" + "|".join(held_out) + r")\b")
    assert len(searched) == 4
    for retriever in searched:
        found = [p for ps in retriever.search(held_out, 3) for p in ps]
        assert found and not any(naming.search(p.title + "\n" + p.text) for p in found)
    monkeypatch.undo()
    assert summary["command"].startswith("python lab/long_horizon.py --quick")
    assert (out / "long_horizon.png").is_file()
    capsys.readouterr()
    assert module.main(["--quick", "--out", str(out)]) == 0
    assert capsys.readouterr().out.count("done already") == 4
    # A run stopped after its last checkpoint (no run.json) resumes from it instead of starting over.
    mempo_dir = out / "runs" / "test" / "mempo_s0"
    (mempo_dir / "run.json").unlink()
    assert module.main(["--quick", "--out", str(out), "--arms", "mempo"]) == 0
    assert json.loads((mempo_dir / "run.json").read_text())["resumed_from"] == "checkpoint-1"
    # A change to one arm's settings redoes that arm's runs only.
    monkeypatch.setitem(module.ARMS, "mempo", {"memory_scale_rewards": "none"})
    capsys.readouterr()
    assert module.main(["--quick", "--out", str(out)]) == 0
    assert capsys.readouterr().out.count("done already") == 3
    redone = json.loads((mempo_dir / "run.json").read_text())
    assert redone["settings"]["arm"] == {"memory_scale_rewards": "none"} and redone["resumed_from"] is None
    summary = json.loads((out / "long_horizon.json").read_text())
    assert summary["arms"]["mempo"] == {"memory_scale_rewards": "none"} and "arm" not in summary["settings"]
    assert summary["horizons"]["4"]["mempo"]["seeds"] == [0]
    monkeypatch.undo()
    committed = LAB / "results" / "long_horizon_warm_check_validation.json"
    before = committed.read_bytes() if committed.is_file() else None
    assert module.main(["--quick", "--out", str(out), "--warm_only", "--split", "validation"]) == 0
    assert (committed.read_bytes() if committed.is_file() else None) == before  # only the default run writes it
    check = json.loads((out / "warm_check_validation.json").read_text())
    assert json.loads((out / "warm_model" / "induction.json").read_text())["stats"]["steps"] == 2  # before the SFT
    assert sorted(check["memory"]) == sorted(check["full_history"]) == ["1", "4"]
    assert check["full_history"]["4"]["memory_recall"] is None and "fact_value" in check["memory_signal"]
    assert 0.0 < check["name_token_coverage"] <= 1.0
    assert check["name_copy_nll"]["rows"] == 4 and check["name_copy_nll"]["first"] > 0.0
    assert check["value_copy_nll"]["rows"] == 4 and check["value_copy_nll"]["value"] > 0.0
    assert check["value_copy_nll"]["rows_from_memory"] == 2 and check["value_copy_nll"]["from_memory"] > 0.0
    out_text = capsys.readouterr().out
    assert "K=4: EM memory" in out_text and "validation names: " in out_text and "nats (first token)" in out_text
    # A later session (a fresh machine: no runs/) takes the kept runs of the same warm start instead of training them
    # again, and trains a run whose kept record came from another warm start.
    names = ["full_history_s0", "mempo_s0", "outcome_only_dynamic_s0", "outcome_only_s0"]
    sha = module.warm_fingerprint(dict.fromkeys(module.CONTEXT_MODES, out / "warm_model"))
    assert sorted(p.stem for p in (kept / sha[:12] / "test").glob("*.json")) == names
    assert json.loads((kept / sha[:12] / "test" / "mempo_s0.json").read_text())["settings"]["warm_sha256"] == sha
    mine = kept / sha[:12] / "test" / "outcome_only_s0.json"
    other = kept / ("0" * 12) / "test" / "outcome_only_s0.json"  # the same run from another warm start
    other.parent.mkdir(parents=True)
    other.write_text(mine.read_text().replace(sha, "0" * 64))
    mine.unlink()
    shutil.rmtree(out / "runs")
    assert module.main(["--quick", "--out", str(out), "--records", str(kept)]) == 0
    assert capsys.readouterr().out.count("done already") == 3
    assert json.loads(mine.read_text())["settings"]["warm_sha256"] == sha
    assert json.loads(other.read_text())["settings"]["warm_sha256"] == "0" * 64  # kept apart, untouched
    assert sorted(p.parent.name for p in (out / "runs" / "test").glob("*/run.json")) == names


@pytest.mark.slow
def test_tune_gives_every_arm_the_same_validation_grid_and_later_runs_use_its_choice(tmp_path, capsys, monkeypatch):
    grid = ({"learning_rate": 1e-4}, {"learning_rate": 3e-3})
    monkeypatch.setattr(long_horizon, "TUNE_GRID", grid)
    out, arms = tmp_path / "lh", ["outcome_only", "outcome_only_dynamic"]
    committed = LAB / "results" / "long_horizon_tuned.json"
    before = committed.read_bytes() if committed.is_file() else None
    assert long_horizon.main(["--quick", "--tune", "--out", str(out), "--arms", *arms]) == 0
    assert (committed.read_bytes() if committed.is_file() else None) == before  # only the default --tune writes it
    tuned = json.loads((out / "long_horizon_tuned.json").read_text())
    assert sorted(tuned["arms"]) == arms and tuned["settings"]["split"] == "validation"
    runs = sorted(p.parent.name for p in (out / "runs" / "validation_tune").glob("*/run.json"))
    assert runs == sorted(f"{arm}_g{i}_s0" for arm in arms for i in range(2))  # the same grid and seed for each arm
    for arm in arms:
        records = [
            json.loads((out / "runs" / "validation_tune" / f"{arm}_g{i}_s0" / "run.json").read_text())
            for i in range(2)
        ]
        scores = [statistics.fmean(cell["em"] for cell in r["after"].values()) for r in records]
        assert tuned["arms"][arm]["scores"] == pytest.approx(scores)
        assert tuned["arms"][arm]["choice"] == grid[scores.index(max(scores))]
    assert records[0]["settings"]["arm"] == {"learning_rate": 1e-4, **long_horizon.ARMS["outcome_only_dynamic"]}
    assert not (out / "runs" / "test").exists()  # tuning never touches the test split
    assert long_horizon.main(["--quick", "--out", str(out), "--arms", "outcome_only"]) == 0
    run = json.loads((out / "runs" / "test" / "outcome_only_s0" / "run.json").read_text())
    assert run["settings"]["arm"] == {**tuned["arms"]["outcome_only"]["choice"], "memory_coef": 0.0}


def test_bad_arguments_fail_before_any_work(tmp_path, capsys):
    module = long_horizon
    assert module.main(["--quick", "--out", str(tmp_path / "x"), "--set", "no_such_field=1"]) == 2
    assert "error: --set no_such_field=1" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_name_token_coverage_counts_the_name_tokens_the_warm_texts_show(tiny_model_dir):
    from mempo_trl.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    names = ["Hamlet Paris"]
    ids = tokenizer(" Hamlet Paris", add_special_tokens=False)["input_ids"]
    assert long_horizon.name_token_coverage(tokenizer, names, ["about Hamlet Paris here"]) == 1.0
    assert long_horizon.name_token_coverage(tokenizer, names, ["nothing"]) < 1.0 and len(ids) >= 1


def test_default_settings_are_unchanged_and_the_options_only_add_keys():
    """The default settings key the cached warm start (a ~55-minute build) and the finished runs (``run.json``): with
    neither option they are today's, key for key and in order (``run.json`` writes them as they are)."""
    today = {
        "world": {
            "seed": 2,
            "num_entities": 240,
            "rows_per_horizon": {"warm": 300, "rl": 120, "validation": 30, "test": 50},
            "horizons": [1, 2, 4, 6, 8],
        },
        "warm": {
            "steps": 1500,
            "batch_size": 16,
            "lr": 3e-3,
            "seed": 0,
            "mem_drop": 0.3,
            "instruction": LEARNER_INSTRUCTION,
            "fresh_names": 2,
            "fresh_values": True,
            "prompt_loss": True,
            "induction_steps": 3000,
        },
        "budget": {
            "max_steps": 60,
            "per_device_train_batch_size": 16,
            "num_generations": 4,
            "learning_rate": 3e-4,
            "max_completion_length": 192,
            "max_turns": 10,
            "retrieval_topk": 3,
            "temperature": 0.7,
            "beta": 0.0,
            "loss_type": "dapo",
            "instruction": LEARNER_INSTRUCTION,
        },
        "split": "test",
    }
    settings = long_horizon.experiment_settings(False, "test", {})
    assert json.dumps(settings) == json.dumps(today)
    assert long_horizon.budget_suffix(settings["budget"]) == ""  # the runs, summary and warm check keep their names
    # Evaluation plays the protocol it played before the options existed.
    assert long_horizon.turn_protocol(settings["budget"], "full_history") == TurnProtocol(
        instruction=LEARNER_INSTRUCTION,
        max_turns=10,
        retrieval_topk=3,
        context_mode="full_history",
        max_completion_length=192,
    )
    both = long_horizon.experiment_settings(False, "validation", {"max_context_tokens": 1024}, passage_words=100)
    assert both["world"] == {**today["world"], "passage_words": 100}
    assert both["budget"] == {**today["budget"], "max_context_tokens": 1024} and both["warm"] == today["warm"]
    assert long_horizon.turn_protocol(both["budget"], "memory").max_context_tokens == 1024  # every arm, same budget
    quick = long_horizon.experiment_settings(True, "test", {}, passage_words=100)
    assert "passage_words" not in long_horizon.QUICK["world"] and "passage_words" not in long_horizon.WORLD
    assert quick["world"] == {**long_horizon.QUICK["world"], "passage_words": 100}
    smollm2 = long_horizon.experiment_settings(False, "test", {}, learner="smollm2")  # its own warm start and key
    assert (
        smollm2 == {**settings, "warm": long_horizon.SMOLLM2_WARM, "learner": "smollm2"} and "learner" not in settings
    )


@pytest.mark.slow
def test_quick_mode_with_wiki_length_passages_and_a_context_budget(tmp_path):
    out = tmp_path / "lh"
    argv = ["--quick", "--out", str(out), "--passage_words", "100", "--set", "max_context_tokens=600"]
    assert long_horizon.main(argv) == 0
    variant = out / "passage_words_100"
    assert sorted(p.name for p in out.iterdir()) == ["passage_words_100"]  # nothing of the default world is touched
    world = json.loads((variant / "world" / "world.json").read_text())["world"]
    assert world == {**long_horizon.QUICK["world"], "passage_words": 100}
    corpus = read_jsonl(variant / "world" / "corpus.jsonl")
    assert min(len(p["contents"].split("\n", 1)[1].split()) for p in corpus) >= 100
    run = json.loads((variant / "runs" / "test_max_context_tokens_600" / "mempo_s0" / "run.json").read_text())
    settings = long_horizon.experiment_settings(True, "test", {"max_context_tokens": 600}, 100)
    warm = long_horizon.warm_fingerprint(dict.fromkeys(long_horizon.CONTEXT_MODES, variant / "warm_model"))
    assert run["settings"] == long_horizon.run_settings({**settings, "warm_sha256": warm}, "mempo")
    summary = json.loads((variant / "long_horizon_max_context_tokens_600.json").read_text())
    assert sorted(summary["horizons"]) == ["1", "4"]
    for cells in summary["horizons"].values():
        assert sorted(cells) == sorted(long_horizon.ARMS)
        assert all(0.0 <= cell["context_overflow"] <= 1.0 for cell in cells.values())


@pytest.mark.slow
def test_the_all_parts_reward_trains_every_arm_in_runs_of_its_own(tmp_path):
    out = tmp_path / "lh"
    assert long_horizon.main(["--quick", "--out", str(out), "--outcome_reward", "all_parts"]) == 0
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["test_all_parts"]
    for arm in long_horizon.ARMS:
        run_dir = out / "runs" / "test_all_parts" / f"{arm}_s0"
        assert json.loads((run_dir / "run.json").read_text())["settings"]["outcome_reward"] == "all_parts"
        logged = json.loads((run_dir / "checkpoint-1" / "trainer_state.json").read_text())["log_history"][0]
        assert "rewards/mempo_all_parts_reward/mean" in logged and "rewards/mempo_outcome_reward/mean" not in logged
    summary = json.loads((out / "long_horizon_all_parts.json").read_text())
    assert summary["settings"]["outcome_reward"] == "all_parts" and summary["command"].endswith("all_parts")


@pytest.mark.parametrize(
    "option, message",
    [
        (["--passage_words", "0"], "error: --passage_words 0: expected >= 1"),
        (["--set", "max_context_tokens=0"], "error: max_context_tokens must be a positive integer"),
        (["--set", "max_context_tokens=2.5"], "error: max_context_tokens must be an integer"),
        (["--set", "context_overflow=drop"], "error: context_overflow must be one of"),
    ],
)
def test_bad_option_values_fail_before_any_work(tmp_path, capsys, option, message):
    assert long_horizon.main(["--quick", "--out", str(tmp_path / "x"), *option]) == 2
    assert one_error_line(capsys).startswith(message)
    assert not (tmp_path / "x").exists()


def test_rl_episodes_cannot_retrieve_a_passage_about_a_held_out_entity(world, tmp_path):
    """The RL retriever's corpus (`rl_corpus`) has no passage naming a validation or test entity, whatever the query
    (the held-out rows' own searches, the names themselves), while the whole corpus, which evaluation searches,
    returns them; the RL entities keep their passages."""
    from mempo_trl.retrieval import BM25Retriever

    held_out = [name for split in long_horizon.HELD_OUT_SPLITS for name in world.pools[split]]
    retrievers = {}
    for name, passages in (("full", world.passages), ("rl", long_horizon.rl_corpus(world.passages, held_out))):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(p) + "\n" for p in passages))
        retrievers[name] = BM25Retriever.from_corpus(str(path), cache_dir=str(tmp_path / "bm25"))
    rows = world.splits["validation"] + world.splits["test"]
    queries = [q for row in rows for q in row["hop_queries"]] + held_out
    naming = re.compile(r"\b(?:" + "|".join(held_out) + r")\b")

    def named(retriever):
        return {naming.search(p.title + "\n" + p.text) is not None for ps in retriever.search(queries, 10) for p in ps}

    assert named(retrievers["full"]) == {True, False}  # the leak the RL corpus closes
    assert named(retrievers["rl"]) == {False}
    found = retrievers["rl"].search(list(world.pools["rl"]), 3)
    assert all(any(p.title == name for p in ps) for name, ps in zip(world.pools["rl"], found))


def test_fresh_name_rows_rename_every_made_up_word_and_keep_the_episode_playable(world, tmp_path):
    """Each copy of a warm row names its entities with words no other copy and no world entity uses, consistently in
    the question, the searches and the passages, so the oracle episode (what the warm start trains on) is the same
    game: each search finds its entity and the memory holds the asked values."""
    from mempo_trl.kit.warmstart import hop_facts, oracle_episode_turns
    from mempo_trl.retrieval import BM25Retriever

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(p) + "\n" for p in world.passages))
    retriever = BM25Retriever.from_corpus(str(corpus), cache_dir=str(tmp_path / "bm25"))
    rows = [r for r in world.splits["warm"] if r["data_source"] in ("horizon_1", "horizon_4")][:6]
    renamed, frozen = long_horizon.fresh_name_rows(rows, retriever, world.words, copies=2, seed=0, topk=3)
    assert len(renamed) == 12 and len({r["id"] for r in renamed}) == 12
    word = re.compile(r"[A-Z][a-z]+")

    def words(row, searched):
        texts = [row["question"], *row["hop_queries"]] + [p.title + " " + p.text for ps in searched for p in ps]
        return {w for text in texts for w in word.findall(text)}

    owner: dict[str, str] = {}
    for new, old in zip(renamed, rows * 2):
        results = frozen.search(new["hop_queries"], 3)
        assert not words(new, results) & set(world.words)  # no name of the world is left
        fresh = words(new, results) - words(old, retriever.search(old["hop_queries"], 3))
        assert fresh and all(owner.setdefault(w, new["id"]) == new["id"] for w in fresh)  # no copy shares one
        assert new["sub_answers"] == old["sub_answers"]
        for query, passages in zip(new["hop_queries"], results):
            subject = query.rstrip("?").split(" of ")[-1].split(" was ")[-1].split(" did ")[-1]
            assert any(subject.split()[0] in p.title for p in passages), (query, passages)
        facts = hop_facts(new, results)
        assert [f.split(": ")[-1].rstrip(".") for f in facts] == [a[0] for a in old["sub_answers"]]
        assert oracle_episode_turns(new, frozen, max_turns=10)[-1][0].endswith(old["golden_answers"][0] + " </answer>")


def test_fresh_values_redraw_each_asked_value_in_the_answers_and_every_passage(world, tmp_path):
    """With ``fresh_values`` a copy asks the same questions of other names whose values are new: each asked value is
    redrawn (the same value asked twice in a row, once), written in its new form wherever the episode's passages had
    the old one, and the oracle's memory and answer hold the new values, so the warm start can only copy them."""
    from mempo_trl.kit.warmstart import hop_facts, oracle_episode_turns
    from mempo_trl.retrieval import BM25Retriever

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(p) + "\n" for p in world.passages))
    retriever = BM25Retriever.from_corpus(str(corpus), cache_dir=str(tmp_path / "bm25"))
    rows = [r for r in world.splits["warm"] if r["data_source"] in ("horizon_4", "horizon_6")]
    renamed, frozen = long_horizon.fresh_name_rows(rows, retriever, world.words, 2, seed=0, topk=3, fresh_values=True)
    kinds = set()
    for new, old in zip(renamed, rows * 2):
        results = frozen.search(new["hop_queries"], 3)
        texts = " ".join(p.text for passages in results for p in passages)
        assert new["golden_answers"] == ["; ".join(answers[0] for answers in new["sub_answers"])]
        for fresh, before, passages in zip(new["sub_answers"], old["sub_answers"], results):
            assert fresh[0] != before[0] and len(fresh) == len(before)
            assert any(long_horizon._within(fresh[0], p.text) for p in passages)
            if before[0] not in {answers[0] for answers in new["sub_answers"]}:  # occupations are few
                assert not long_horizon._within(before[0], texts)
            kinds.add(before[0][0].isdigit())
        assert [f.split(": ")[-1].rstrip(".") for f in hop_facts(new, results)] == [a[0] for a in new["sub_answers"]]
        assert oracle_episode_turns(new, frozen, max_turns=10)[-1][0].endswith(new["golden_answers"][0] + " </answer>")
    assert kinds == {True, False}  # numbers and occupations


def test_copy_nll_scores_the_asked_name_in_the_first_search_and_the_value_in_the_memory(
    world, tmp_path, tiny_model_dir
):
    """A model with uniform next-token odds pays ln(V) per name token; one that puts all mass on the oracle's next
    token pays 0: the function reads the asked name's tokens, first and later apart."""
    import math

    import torch

    from mempo_trl.kit.tiny import load_tiny
    from mempo_trl.retrieval import BM25Retriever

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(p) + "\n" for p in world.passages))
    retriever = BM25Retriever.from_corpus(str(corpus), cache_dir=str(tmp_path / "bm25"))
    _, tokenizer = load_tiny(tiny_model_dir)
    rows = world.splits["validation"][:3]

    name_tokens = {
        t
        for row in rows
        for t in tokenizer(
            " "
            + row["hop_queries"][0]
            .split(" of ")[-1]
            .split(" was ")[-1]
            .split(" did ")[-1]
            .split(" is the ")[-1]
            .rstrip("?"),
            add_special_tokens=False,
        )["input_ids"]
    }

    class Model:
        device = torch.device("cpu")

        def __init__(self, blind_to: set):
            self.blind_to = blind_to

        def __call__(self, input_ids):  # all mass on the token that follows, except before a token it is blind to
            logits = torch.zeros(*input_ids.shape, len(tokenizer))
            logits[0, :-1].scatter_(1, input_ids[0, 1:, None], 1e4)
            blind = torch.tensor([t in self.blind_to for t in input_ids[0, 1:].tolist()])
            logits[0, :-1][blind] = 0.0
            return type("Out", (), {"logits": logits})

    oracle = long_horizon.name_copy_nll(Model(set()), tokenizer, rows, retriever, LEARNER_INSTRUCTION)
    assert oracle["first"] == pytest.approx(0.0, abs=1e-6) and oracle["later"] == pytest.approx(0.0, abs=1e-6)
    assert oracle["rows"] == 3
    blind = long_horizon.name_copy_nll(Model(name_tokens), tokenizer, rows, retriever, LEARNER_INSTRUCTION)
    assert blind["first"] == pytest.approx(math.log(len(tokenizer)))  # every name token, and only those
    assert blind["later"] == pytest.approx(math.log(len(tokenizer)))

    # value_copy_nll reads the first asked value in the memory written after the first search (every row) and in
    # the one written after the second (rows with K >= 2, from the previous memory), and only it
    rows = [r for r in world.splits["validation"] if len(r["hop_queries"]) == 1][:1]
    rows += [r for r in world.splits["validation"] if len(r["hop_queries"]) >= 2][:2]
    value_tokens = set()
    for row in rows:
        ids = tokenizer(" " + row["sub_answers"][0][0], add_special_tokens=False)["input_ids"]
        value_tokens |= set(ids[tokenizer.decode(ids[:1]) == " " :])
    assert long_horizon.value_copy_nll(Model(set()), tokenizer, rows, retriever, LEARNER_INSTRUCTION) == {
        "value": pytest.approx(0.0, abs=1e-6),
        "from_memory": pytest.approx(0.0, abs=1e-6),
        "rows": 3,
        "rows_from_memory": 2,
    }
    blind = long_horizon.value_copy_nll(Model(value_tokens), tokenizer, rows, retriever, LEARNER_INSTRUCTION)
    assert blind["value"] == pytest.approx(math.log(len(tokenizer)))
    assert blind["from_memory"] == pytest.approx(math.log(len(tokenizer)))
    assert (
        long_horizon.value_copy_nll(Model(set()), tokenizer, rows[:1], retriever, LEARNER_INSTRUCTION)["from_memory"]
        is None
    )


def test_copy_nll_finds_the_name_and_the_value_under_the_real_qwen2_5_tokenizer(world, tmp_path):
    """Qwen2.5 writes the space before a number as its own token and each digit as one: the asked name and value are
    still found in the oracle's search and memory, and a uniform model pays ln(V) on each (the lone space is not
    counted)."""
    import math

    import torch

    from mempo_trl.kit.qwen import build_qwen2_5_tokenizer
    from mempo_trl.retrieval import BM25Retriever

    tokenizer = build_qwen2_5_tokenizer()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(p) + "\n" for p in world.passages))
    retriever = BM25Retriever.from_corpus(str(corpus), cache_dir=str(tmp_path / "bm25"))
    rows = world.splits["validation"][:2] + [r for r in world.splits["validation"] if len(r["hop_queries"]) >= 2][:2]
    assert any(row["sub_answers"][0][0][0].isdigit() for row in rows)

    class Uniform:
        device = torch.device("cpu")

        def __call__(self, input_ids):
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, len(tokenizer))})

    uniform = math.log(len(tokenizer))
    value = long_horizon.value_copy_nll(Uniform(), tokenizer, rows, retriever, LEARNER_INSTRUCTION)
    name = long_horizon.name_copy_nll(Uniform(), tokenizer, rows, retriever, LEARNER_INSTRUCTION)
    assert value["value"] == pytest.approx(uniform) and value["rows"] == 4
    assert value["rows_from_memory"] == sum(len(row["hop_queries"]) >= 2 for row in rows) > 0
    assert value["from_memory"] == pytest.approx(uniform)
    assert name["first"] == pytest.approx(uniform) and name["later"] == pytest.approx(uniform)


def test_the_default_warm_check_is_also_written_to_lab_results_with_its_command(tmp_path, monkeypatch):
    """``--warm_only`` with the default settings and ``--out`` writes the check the README cites, with its command,
    settings, versions and machine, to ``lab/results/long_horizon_warm_check_<split>.json``; any other ``--out``
    leaves it alone (the world, warm start and check itself are stubbed: this is the wiring)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        long_horizon,
        "prepare",
        lambda out, world, warm, device, learner: ({}, dict.fromkeys(("memory", "full_history"), out)),
    )
    monkeypatch.setattr(long_horizon, "print_oracle_tokens", lambda *args: {"2": {"ratio": 0.5}})
    monkeypatch.setattr(long_horizon, "warm_check", lambda *args: {"memory": {"1": {"em": 0.5}}})
    monkeypatch.setattr(long_horizon, "smollm2_warm_check", lambda *args: {"memory": {"1": {"em": 0.25}}})
    kept = []
    monkeypatch.setattr(long_horizon, "commit_warm", lambda warm_dir, command: kept.append(command))
    committed = tmp_path / "lab" / "results" / "long_horizon_warm_check_validation.json"
    assert long_horizon.main(["--warm_only", "--split", "validation", "--out", "elsewhere"]) == 0
    assert not committed.exists()
    assert long_horizon.main(["--warm_only", "--split", "validation"]) == 0
    record = json.loads(committed.read_text())
    assert record["memory"] == {"1": {"em": 0.5}} and record["settings"]["split"] == "validation"
    assert record["command"] == "python lab/long_horizon.py --warm_only --split validation"
    assert "torch" in record["versions"] and record["machine"]["cpus"] >= 1
    assert record["scripted_oracle_tokens"] == {"2": {"ratio": 0.5}}
    # the default settings' warm start is kept (whatever --out), where none is kept yet
    assert kept == [f"python lab/long_horizon.py --warm_only --split validation{o}" for o in (" --out elsewhere", "")]
    # SmolLM2's default (wiki-length passages) writes its own; with other passages it does not
    smollm2 = tmp_path / "lab" / "results" / "long_horizon_smollm2_warm_check_validation.json"
    assert (
        long_horizon.main(["--warm_only", "--split", "validation", "--learner", "smollm2", "--passage_words", "50"])
        == 0
    )
    assert not smollm2.exists()
    assert long_horizon.main(["--warm_only", "--split", "validation", "--learner", "smollm2"]) == 0
    record = json.loads(smollm2.read_text())
    assert record["memory"] == {"1": {"em": 0.25}} and record["settings"]["learner"] == "smollm2"
    assert record["settings"]["world"]["passage_words"] == long_horizon.SMOLLM2_PASSAGE_WORDS
    assert json.loads(committed.read_text())["memory"] == {"1": {"em": 0.5}}  # the kit learner's is left alone


def test_the_copy_task_runs_before_the_sft_and_not_again_when_the_sft_resumes(tmp_path, monkeypatch):
    """`prepare` runs `induction_pretrain` on the freshly built model, then the SFT; a warm start resumed from an SFT
    checkpoint (whose weights replace the model's) skips it (the SFT and the check of the checkpoint are stubbed)."""
    import induction_pretraining

    import mempo_trl.checkpoints
    import mempo_trl.kit.warmstart

    calls = []

    def sft(model_dir, *args, **kwargs):
        calls.append("sft")
        (Path(model_dir) / mempo_trl.kit.warmstart.WARM_START_FILE).write_text("{}")
        return {"steps": 2, "examples": 1, "initial_loss": 1.0, "final_loss": 1.0, "seconds": 0.0}

    monkeypatch.setattr(
        induction_pretraining,
        "induction_pretrain",
        lambda model_dir, steps, **kw: (
            calls.append(f"induction {steps}")
            or {"steps": steps, "initial_loss": 7.0, "final_loss": 0.1, "seconds": 0.0}
        ),
    )
    monkeypatch.setattr(mempo_trl.kit.warmstart, "sft_warm_start", sft)
    settings = long_horizon.experiment_settings(True, "validation", {})
    long_horizon.prepare(tmp_path, settings["world"], settings["warm"], "cpu")
    assert calls == ["induction 2", "sft"]
    calls.clear()
    (tmp_path / "warm_model" / mempo_trl.kit.warmstart.WARM_START_FILE).unlink()  # stopped before it finished
    monkeypatch.setattr(mempo_trl.checkpoints, "newest_complete_checkpoint", lambda path: Path(path) / "checkpoint-1")
    long_horizon.prepare(tmp_path, settings["world"], settings["warm"], "cpu")
    assert calls == ["sft"]


def test_the_scripted_oracle_bound_counts_every_round_context_in_both_modes(world, tiny_model_dir, tmp_path):
    """`oracle_context_tokens`: per K, the oracle's tokens per question (each round's prompt and its turn) in each
    context mode. K = 1 has one search, whose result both modes keep: ratio 1. K = 2: the first two rounds read the
    same in both modes; the third sees the second turn and its result with memory, both turns and results with full
    history, so full history costs exactly the first turn and its result more (counted here by hand)."""
    from mempo_trl.context import initial_messages, render_prompt, round_messages
    from mempo_trl.kit.warmstart import oracle_episode_turns
    from mempo_trl.loading import load_tokenizer
    from mempo_trl.retrieval import BM25Retriever

    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in world.passages))
    retriever = BM25Retriever.from_corpus(str(path), cache_dir=str(tmp_path / "bm25"))
    tokenizer = load_tokenizer(tiny_model_dir)
    budget = {"retrieval_topk": 3, "instruction": LEARNER_INSTRUCTION, "max_turns": 8}
    rows = [row for row in world.splits["test"] if row["data_source"] in ("horizon_1", "horizon_2")]
    cells = long_horizon.oracle_context_tokens(rows, retriever, tokenizer, budget)
    assert list(cells) == ["1", "2"] and cells["1"]["rows"] == cells["2"]["rows"] == 8
    assert cells["1"]["ratio"] == 1.0 and cells["1"]["tokens_memory"] == cells["1"]["tokens_full_history"]

    def by_hand(row, mode):  # every round: its context as `round_messages` rebuilds it, plus the turn's tokens
        base = initial_messages(row["question"], instruction=LEARNER_INSTRUCTION)
        turns, history, total = oracle_episode_turns(row, retriever, topk=3), [], 0
        for text, information in turns:
            total += len(render_prompt(tokenizer, round_messages(base, history, mode)))
            total += len(tokenizer(text, add_special_tokens=False)["input_ids"])
            history += [(text, information)] if information is not None else []
        return total

    k2 = [row for row in rows if row["data_source"] == "horizon_2"]
    for mode in ("memory", "full_history"):
        assert cells["2"][f"tokens_{mode}"] == statistics.fmean(by_hand(row, mode) for row in k2)
    row = k2[0]
    base = initial_messages(row["question"], instruction=LEARNER_INSTRUCTION)
    (t1, i1), (t2, i2), _ = oracle_episode_turns(row, retriever, topk=3)
    extra = len(render_prompt(tokenizer, round_messages(base, [(t1, i1), (t2, i2)], "full_history")))
    extra -= len(render_prompt(tokenizer, round_messages(base, [(t1, i1), (t2, i2)], "memory")))
    assert extra > 0 and by_hand(row, "full_history") - by_hand(row, "memory") == extra
    assert cells["2"]["ratio"] == cells["2"]["tokens_memory"] / cells["2"]["tokens_full_history"] < 1.0
    assert cells["2"]["peak_full_history"] > cells["2"]["peak_memory"]


@pytest.mark.slow
def test_quick_mode_with_the_smollm2_learner(smollm2_tokenizer, tmp_path, capsys):
    """``--learner smollm2 --quick``, through the GPU script's CPU dry run (`scripts/gpu_long_horizon.sh dry-run`):
    SmolLM2 from its wheel, one full SFT step in each context mode on wiki-length passages, one RL step per arm (the
    ``full_history`` arm from the full-history start, MemPO from the forgetful one), 2 evaluated questions; its summary
    under its own name with the scripted oracle's ratio per K, collected as the GPU run collects it; then
    ``--warm_only`` checks both starts in both context modes (~3 min on a loaded 2-core CPU)."""
    out = tmp_path / "lh"
    published = LAB / "results" / "long_horizon_smollm2.json"
    before = published.read_bytes() if published.is_file() else None
    argv = ["--quick", "--learner", "smollm2", "--out", str(out), "--arms", "mempo", "full_history"]
    script = LAB.parent / "scripts" / "gpu_long_horizon.sh"
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(script), "dry-run", str(out)], capture_output=True, text=True, timeout=1200, env=env
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "scripted oracle, K=2: tokens per question memory" in done.stdout
    collected = sorted(path.name for path in (out / "collected").iterdir())
    assert collected == ["long_horizon_smollm2.json", "long_horizon_smollm2.png", "runs.tgz"]
    with tarfile.open(out / "collected" / "runs.tgz") as archive:
        assert sorted(archive.getnames()) == ["runs/test/full_history_s0/run.json", "runs/test/mempo_s0/run.json"]
    root = out / f"passage_words_{long_horizon.SMOLLM2_PASSAGE_WORDS}" / "smollm2"
    summary = json.loads((root / "long_horizon_smollm2.json").read_text())
    assert (root / "long_horizon_smollm2.png").is_file() and not (root / "long_horizon.json").exists()
    assert (published.read_bytes() if published.is_file() else None) == before
    assert summary["settings"]["learner"] == "smollm2" and summary["settings"]["world"]["passage_words"] == 100
    assert sorted(summary["horizons"]) == ["1", "2"]
    assert all(sorted(cells) == ["full_history", "mempo"] for cells in summary["horizons"].values())
    oracle = summary["scripted_oracle_tokens"]
    assert oracle["1"]["ratio"] == 1.0 and 0.0 < oracle["2"]["ratio"] < 1.0
    for mode in ("memory", "full_history"):
        warm = json.loads((root / f"warm_model_{mode}" / "warm_start.json").read_text())
        assert warm["horizon"]["context_mode"] == mode and warm["stats"]["steps"] == 1
    runs = root / "runs" / "test"
    assert json.loads((runs / "mempo_s0" / "run.json").read_text())["warm_start"].endswith("warm_model_memory")
    assert json.loads((runs / "full_history_s0" / "run.json").read_text())["warm_start"].endswith("full_history")
    assert long_horizon.main([*argv[:5], "--warm_only", "--split", "validation"]) == 0
    check = json.loads((root / "warm_check_validation.json").read_text())
    assert sorted(check) == ["full_history", "memory", "scripted_oracle_tokens"]
    for start in ("memory", "full_history"):
        for mode in ("memory", "full_history"):
            cells = check[start][mode]
            assert sorted(cells) == ["1", "2"] and all(cell["rows"] == 1 for cell in cells.values())
            for cell in cells.values():
                assert {
                    "em",
                    "all_parts_em",
                    "turns",
                    "searches",
                    "tokens_per_question",
                    "peak_context_tokens",
                    "memory_recall",
                } <= set(cell)
    assert "full_history start, K=2: EM memory" in capsys.readouterr().out


def test_the_committed_warm_start_is_restored_for_its_settings_only_and_checked_by_sha256(tmp_path):
    """`commit_warm` keeps a warm start's files with their sha256; `restore_committed_warm` copies them into a run's
    warm directory (replacing one built on this machine) for the same key only, and refuses a damaged copy."""
    from mempo_trl.kit.warmstart import WARM_START_FILE

    key = {"size": {"hidden_size": 8}, "warm": {"steps": 2}}
    built = tmp_path / "built"
    built.mkdir()
    (built / "model.safetensors").write_bytes(b"weights of this machine")
    (built / "tokenizer.json").write_text("{}")
    (built / WARM_START_FILE).write_text(json.dumps({"horizon": key}))
    (built / "horizon_key.json").write_text(json.dumps(key))
    (built / "sft").mkdir()  # checkpoints are not kept
    committed = tmp_path / "committed"
    long_horizon.commit_warm(built, "python lab/long_horizon.py --warm_only", committed=committed)
    manifest = json.loads((committed / long_horizon.WARM_MANIFEST).read_text())
    assert sorted(manifest["files"]) == ["model.safetensors", "tokenizer.json", WARM_START_FILE]
    assert manifest["warm_sha256"] == long_horizon.warm_fingerprint(dict.fromkeys(("memory", "full_history"), built))
    assert manifest["command"] == "python lab/long_horizon.py --warm_only"

    other = tmp_path / "other_machine"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"weights of another machine")
    assert long_horizon.restore_committed_warm(other, key, committed=committed)
    assert (other / "model.safetensors").read_bytes() == b"weights of this machine"
    assert not long_horizon.restore_committed_warm(
        tmp_path / "fresh", {**key, "warm": {"steps": 3}}, committed=committed
    )
    assert not (tmp_path / "fresh").exists()
    (committed / "model.safetensors").write_bytes(b"edited")
    with pytest.raises(ValueError, match="model.safetensors does not match the sha256"):
        long_horizon.restore_committed_warm(tmp_path / "fresh", key, committed=committed)


def test_the_default_runs_fail_loudly_without_their_tuned_choice(tmp_path, capsys):
    """`read_tuned` compares the settings without the warm start's sha256; a choice tuned for other settings is
    never used, and for the default settings (``required``) that is an error naming what differs."""
    settings = {"world": {"seed": 2}, "budget": {"max_steps": 60}, "split": "test", "warm_sha256": "aaa"}
    path = tmp_path / "tuned.json"
    record = {
        "settings": {**settings, "split": "validation", "warm_sha256": "bbb"},
        "arms": {"mempo": {"choice": {"learning_rate": 1e-4}}},
    }
    path.write_text(json.dumps(record))
    assert long_horizon.read_tuned(path, settings, required=True) == {"mempo": {"learning_rate": 1e-4}}
    assert "tuned on warm start bbb" in capsys.readouterr().out
    changed = {**settings, "budget": {"max_steps": 30}}
    assert long_horizon.read_tuned(path, changed) == {}
    with pytest.raises(ValueError, match=r"other settings \(budget differ\)"):
        long_horizon.read_tuned(path, changed, required=True)
    with pytest.raises(ValueError, match="is missing"):
        long_horizon.read_tuned(tmp_path / "none.json", settings, required=True)


def test_the_workers_of_jobs_end_with_a_killed_experiment(tmp_path):
    """`--jobs N` runs in a pool whose workers (each training a run for minutes) end with the experiment, however
    it ends: a SIGKILL cannot be forwarded, so each worker asks for the parent-death signal."""
    import signal

    from helpers import ProcessTree

    code = (
        f"import sys, time; sys.path.insert(0, {str(LAB)!r}); import long_horizon; "
        "pool = long_horizon.job_pool(2); pool.map_async(time.sleep, [600, 600], chunksize=1); "
        "print('started', flush=True); time.sleep(600)"
    )
    experiment = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    tree = ProcessTree(experiment.pid)
    try:
        assert experiment.stdout.readline() == "started\n"
        tree.wait_seen(2)
        os.kill(experiment.pid, signal.SIGKILL)
        assert experiment.wait(timeout=60) == -signal.SIGKILL
        assert tree.wait_gone(timeout=60) == []
    finally:
        tree.kill()
