"""The learning kit (`mempo_trl.kit.learner`), the lab's analytics (`lab/analytics.py`) and the experiment script
`lab/learning.py` in its quick mode."""

import doctest
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import analytics
import learning
import pytest
import torch
from analytics import answer_time_facts, failure_kind, memory_signal

from mempo_trl.kit import learner
from mempo_trl.kit.learner import memory_recall, needed_facts, write_learner_world


ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "lab"
TWO_HOP = {
    "question": "What is the population of the birthplace of Tisdin Purbro?",
    "golden_answers": ["634,400"],
    "data_source": "demo_2hop",
    "supporting_ids": ["52", "93"],
    "sub_answers": [],
    "hop_queries": ["In which city was Tisdin Purbro born?", "What is the population of Sedo?"],
}
"""A demo-world 2-hop row; `hop_facts` finds ``Tisdin Purbro: Sedo.`` and ``Sedo: 634,400.`` for it."""


class NoPassages:
    """A retriever that finds nothing."""

    def search(self, queries, topk):
        return [[] for _ in queries]


@pytest.mark.parametrize("module", [learner, analytics, learning], ids=lambda m: m.__name__)
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


def test_the_headline_is_the_readme_command_and_publishes_its_summary():
    """The README's answer comes from `HEADLINE`: its command sets exactly HEADLINE's warm start and budget, and that
    configuration alone writes `lab/results/learning.json` (the doctests of `default_results`)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = re.search(r"python lab/learning\.py (--mem-drop .*?)\n```", readme, re.S).group(1).replace("\\\n", " ")
    words = command.split()
    mem_drop = float(words[words.index("--mem-drop") + 1])
    items = [w for w in words[words.index("--set") + 1 :] if "=" in w]
    budget = {**learning.BUDGET, **learning.parse_overrides(items)}
    assert (mem_drop, budget) == (learning.HEADLINE["mem_drop"], learning.HEADLINE["budget"])
    summary = json.loads((LAB / "results" / "learning.json").read_text())
    assert summary["settings"]["budget"] == learning.HEADLINE["budget"]
    assert summary["settings"]["warm"]["derived"]["mem_drop"] == learning.HEADLINE["mem_drop"]


def test_splits_are_disjoint_and_complete(tmp_path):
    from mempo_trl.data import read_jsonl

    world = {"seed": 2, "num_entities": 60, "num_questions": 100}
    paths = write_learner_world(tmp_path, world, {"test": 10, "rl": 20})
    questions = [{row["question"] for row in read_jsonl(path)} for path in paths[1:]]
    assert [len(q) for q in questions] == [len(read_jsonl(p)) for p in paths[1:]]
    assert not (questions[0] & questions[1] or questions[0] & questions[2] or questions[1] & questions[2])
    assert sum(len(q) for q in questions) == 100
    with pytest.raises(ValueError, match="too few"):
        write_learner_world(tmp_path / "x", world, {"test": 50, "rl": 50})


def test_memory_recall_counts_whole_normalised_values():
    assert memory_recall("A: 1,492. B: the Seikeis.", ["1492", "Seikeis"]) == 1.0
    assert memory_recall("A: 14920.", ["1492"]) == 0.0  # a value inside another does not count
    assert memory_recall(None, ["x"]) == 0.0


def test_failure_kinds_are_checked_in_order():
    info = "<information>Doc 1(Title: Ulm) Ulm, a city of 1,492 people, lies on the Danube.</information>"
    other = "<information>Doc 1(Title: Bonn) Bonn lies on the Rhine.</information>"
    answer_turn = {"mem": "", "information": None}
    base = {
        "question": "How many people live in Ulm?",
        "golden_answers": ["1,492"],
        "em": 0.0,
        "format_valid": True,
        "answer": "Danube",
        "rounds": [{"mem": "", "information": info}, answer_turn],
    }
    forgot = [{"mem": "", "information": info}, {"mem": "", "information": other}, answer_turn]
    kept = [{"mem": "", "information": info}, {"mem": "Ulm: 1,492.", "information": other}, answer_turn]
    cases = [
        ({"em": 1.0}, (), "correct"),
        ({"answer": None, "format_valid": False}, (), "no_answer"),  # out of turns, every turn well-formed
        ({"answer": None, "format_valid": False, "rounds": [{"valid": False}]}, (), "invalid_format"),
        ({"format_valid": False}, (), "invalid_format"),
        ({"rounds": [{"mem": "", "information": info.replace("1,492", "1,400")}, answer_turn]}, (), "not_retrieved"),
        ({"rounds": forgot}, (), "forgotten"),  # retrieved in round 1, not in what the answer turn saw
        ({"rounds": kept}, (), "wrong_choice"),  # ... unless the memory kept it
        ({"answer": "1,429"}, (), "miscopied"),
        ({"answer": "the danube"}, (), "wrong_choice"),  # case and punctuation aside
        ({"answer": "ulm"}, (), "wrong_choice"),  # a value of the question
        ({"answer": "Ul"}, (), "miscopied"),  # part of a word is not the word
        # Needed values (a comparison's, a multi-objective row's sub-answers) replace the gold answer:
        ({"rounds": forgot, "answer": "Ulm; Bonn"}, ["Rhine"], "wrong_choice"),
        ({"rounds": forgot, "answer": "Danube; Rhine"}, ["Danube", "Rhine"], "forgotten"),
        ({"rounds": kept, "answer": "1,492; Rhone"}, ["1,492", "Rhine"], "miscopied"),
    ]
    assert [failure_kind({**base, **change}, needed) for change, needed, _ in cases] == [kind for *_, kind in cases]
    assert failure_kind({**base, "rounds": forgot}, memory_context=False) == "wrong_choice"  # full history sees all


def test_answer_time_facts_leave_out_only_a_bridge():
    two_hop = TWO_HOP
    multi = {**two_hop, "data_source": "demo_multi", "sub_answers": [["1446"], ["1903"]]}
    assert answer_time_facts(two_hop, needed_facts(two_hop, NoPassages())) == [
        "634,400"
    ]  # the bridge "Sedo" is not needed to answer
    assert answer_time_facts(multi, needed_facts(multi, NoPassages())) == ["1446", "1903"]
    assert (
        answer_time_facts({**two_hop, "hop_queries": []}, needed_facts({**two_hop, "hop_queries": []}, NoPassages()))
        == []
    )  # then: the gold answer


def test_the_quick_starts_row_metric_scores_the_last_memory_against_the_needed_facts():
    """`memory_recall_metric` (what `--heldout_questions` reports): the episode's EM and F1, and the share of the
    row's hop values in its last ``<mem>``; NaN (not counted) for a row without hops."""
    from mempo_trl.evaluation import heldout_metrics

    row = TWO_HOP
    rounds = [{"mem": "Nothing yet."}, {"mem": "Tisdin Purbro: Sedo."}, {"mem": None}]  # the last turn wrote none
    record = {"em": 0.0, "f1": 0.5, "rounds": rounds}
    metric = learner.memory_recall_metric(NoPassages())
    assert metric(row, record) == {"em": 0.0, "f1": 0.5, "memory_recall": 0.5}  # "Sedo" of "Sedo", "634,400"
    assert math.isnan(metric({**row, "hop_queries": []}, record)["memory_recall"])
    # Summed up over rows, a row without hops does not count.
    result = SimpleNamespace(
        metrics={
            "overall": dict.fromkeys(
                ("em", "f1", "format_valid", "turns_per_question", "total_tokens_per_question", "peak_context_tokens"),
                0.0,
            ),
            "by_data_source": {"demo_2hop": {"em": 0.0, "f1": 0.5}},
        },
        records=[{**record, "data_source": "demo_2hop"}] * 2,
    )
    summed = heldout_metrics(result, [row, {**row, "hop_queries": []}], metric)
    assert summed["memory_recall"] == summed["by_type"]["demo_2hop"]["memory_recall"] == 0.5


@pytest.mark.slow
def test_quick_mode_runs_end_to_end_and_resumes(tmp_path, capsys):
    """`--quick`: every arm trains and is evaluated; the outputs are written; a rerun skips the finished runs."""
    assert learning.main(["--quick", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "learning.json").read_text())
    assert sorted(summary["arms"]) == sorted(learning.ARMS)
    for arm in summary["arms"].values():
        for key in (
            "warm_em",
            "final_em_mean",
            "final_em_std",
            "seeds",
            "final_em_by_type",
            "tokens_per_question",
            "memory_recall",
        ):
            assert key in arm
        assert arm["seeds"] == [0] and arm["tokens_per_question"] > 0
        # Why each held-out row missed (`failure_kind`) is kept with every evaluation and summarised per arm.
        assert math.isclose(sum(arm["final_failures"].values()), 1.0)
    assert summary["command"].startswith("python lab/learning.py") and "trl" in summary["versions"]
    curves = json.loads((tmp_path / "learning_curves.json").read_text())
    assert {c["arm"] for c in curves} == set(learning.ARMS)
    assert all([p["step"] for p in c["curve"]] == [0, 1, 2] for c in curves)
    assert all(math.isclose(p["failures"]["correct"], p["em"]) for c in curves for p in c["curve"])
    assert (tmp_path / "learning.png").stat().st_size > 0
    capsys.readouterr()
    assert learning.main(["--quick", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("done already") == len(learning.ARMS)
    # A probe (`--set`) trains from the same warm start into its own directory, leaving the shipped runs alone.
    shipped = {p: p.read_bytes() for p in (tmp_path / "runs").glob("*/run.json")}
    assert learning.main(["--quick", "--out", str(tmp_path), "--arms", "mempo", "--set", "learning_rate=0.001"]) == 0
    probe = tmp_path / "probes" / "learning_rate=0.001"
    assert (
        json.loads((probe / "runs" / "mempo_s0" / "run.json").read_text())["settings"]["budget"]["learning_rate"]
        == 1e-3
    )
    assert json.loads((probe / "learning.json").read_text())["arms"]["mempo"]["seeds"] == [0]
    assert {p: p.read_bytes() for p in (tmp_path / "runs").glob("*/run.json")} == shipped
    # `--headroom` trains nothing and writes headroom.json next to the (probe's) runs.
    capsys.readouterr()
    assert learning.main(["--quick", "--out", str(tmp_path), "--headroom", "--set", "temperature=0.7"]) == 0
    assert "headroom on 8 held-out rows: greedy EM " in capsys.readouterr().out
    result = json.loads((tmp_path / "probes" / "temperature=0.7" / "headroom.json").read_text())
    assert not (tmp_path / "probes" / "temperature=0.7" / "runs").exists()
    assert (result["rows"], result["samples"], result["temperature"]) == (8, 2, 0.7)
    assert math.isclose(sum(result["failures"].values()), 1.0) and result["failures"]["correct"] == result["greedy_em"]
    assert result["mean_at_1"] <= result["pass_at_k"] and result["mixed_groups"] <= result["pass_at_k"]
    assert sum(t["rows"] for t in result["by_type"].values()) == 8
    signal = result["memory_signal"]
    assert (signal["unfiltered"]["threshold"], signal["filtered"]["threshold"]) == (None, math.log(0.5))
    assert 0 < signal["unfiltered"]["rows"] <= 8 and 0 <= signal["unfiltered"]["p_all"] <= 1
    # `--mem-drop P` continues the warm start with a more forgetful oracle memory, into its own directories.
    assert learning.main(["--quick", "--out", str(tmp_path), "--mem-drop", "0.9", "--arms", "mempo"]) == 0
    derived = json.loads((tmp_path / "warm_model_mem_drop=0.9" / "warm_start.json").read_text())
    assert derived["settings"]["mem_drop"] == 0.9 and derived["derived"]["base"] is not None
    run = json.loads((tmp_path / "mem_drop=0.9" / "runs" / "mempo_s0" / "run.json").read_text())
    assert run["settings"]["warm"]["derived"]["mem_drop"] == 0.9
    assert {p: p.read_bytes() for p in (tmp_path / "runs").glob("*/run.json")} == shipped


def test_unwritable_output_fails_before_any_work(tmp_path, capsys):
    """A file where the output directory should be: one `error:` line, exit 2, no world or model built."""
    blocker = tmp_path / "taken"
    blocker.write_text("not a directory")
    assert learning.main(["--quick", "--out", str(blocker / "learning")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "taken" in err and err.count("\n") == 1
    assert not (tmp_path / "learning").exists()


@pytest.mark.parametrize("item", ["learnin_rate=1e-4", "learning_rate"])
def test_set_rejects_a_bad_override_before_any_work(tmp_path, capsys, item):
    overrides = learning.parse_overrides(["learning_rate=1e-4", "memory_threshold=null", "loss_type=bnpo"])
    assert overrides == {"learning_rate": 1e-4, "memory_threshold": None, "loss_type": "bnpo"}
    assert learning.main(["--quick", "--out", str(tmp_path / "out"), "--set", item]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --set {item}: expected KEY=VALUE with KEY a MemPOConfig field (e.g. learning_rate=1e-4)\n"
    assert not (tmp_path / "out").exists()


def test_mem_drop_must_be_a_probability(tmp_path, capsys):
    assert learning.main(["--quick", "--out", str(tmp_path / "out"), "--mem-drop", "1.5"]) == 2
    assert capsys.readouterr().err == "error: --mem-drop 1.5: expected a probability in [0, 1]\n"
    assert not (tmp_path / "out").exists()


class _ReadsMemory(torch.nn.Module):
    """A fake LM for `memory_signal`: every gold-answer token gets logit n, n = how many of ``facts`` the row's text
    holds, ``OTHERS`` other tokens get logit 0 and the rest of the vocabulary -1e4 (exp is exactly 0 in float32), so
    P(gold) = e^n / (|S| e^n + OTHERS) per gold token, S the gold token ids. The softmax then sums a few dozen
    terms, whatever the vocabulary size: its float32 error stays far below the tests' tolerance on any CPU (over
    151,936 terms, AVX2 and AVX-512 reductions round the sum differently by ~2e-4)."""

    OTHERS = 32

    def __init__(self, tokenizer, facts, gold_ids):
        super().__init__()
        self.tokenizer, self.facts, self.gold_ids = tokenizer, facts, sorted(set(gold_ids))
        self.vocab = len(tokenizer)
        self.others = [i for i in range(self.vocab) if i not in self.gold_ids][: self.OTHERS]
        self.unused = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0, use_cache=False):
        logits = torch.full((*input_ids.shape, self.vocab), -1e4)
        logits[:, :, self.others] = 0.0
        for b, ids in enumerate(input_ids.tolist()):
            text = self.tokenizer.decode(ids)
            logits[b, :, self.gold_ids] = float(sum(fact in text for fact in self.facts))
        return SimpleNamespace(logits=logits[:, -logits_to_keep:])


def test_memory_signal_measures_what_each_remembered_fact_adds_to_p_gold(any_tokenizer):
    from mempo_trl.context import gold_answer_tokens

    row = TWO_HOP
    facts = ["Tisdin Purbro: Sedo.", "Sedo: 634,400."]  # what `hop_facts` finds for this row

    gold_ids, gold_mask = gold_answer_tokens(any_tokenizer, row["golden_answers"])
    model = _ReadsMemory(any_tokenizer, facts, [i for i, m in zip(gold_ids, gold_mask) if m])
    result = memory_signal(model, any_tokenizer, [row], NoPassages())

    size = len(model.gold_ids)

    def p(n):
        return math.exp(n) / (size * math.exp(n) + model.OTHERS)

    two_hop = result["by_type"]["demo_2hop"]
    assert two_hop["rows"] == result["rows"] == 1
    assert two_hop["p_all"] == pytest.approx(p(2), rel=1e-4)
    assert two_hop["p_drop"] == pytest.approx(p(1), rel=1e-4)  # either fact dropped leaves one
    assert two_hop["p_none"] == pytest.approx(p(0), rel=1e-4)
    assert result["fact_value"] == pytest.approx(p(2) - p(1), rel=1e-4)


def test_the_shipped_learner_is_the_experiments_forgetful_warm_start(tmp_path):
    """The quick start's `model_name_or_path: learner` is the warm start of `lab/learning.py --mem-drop 0.6` (one
    copy of the weights, in the package): the experiment uses it when its SFT settings and world files are the ones
    the shipped learner records, and builds its own warm start for anything else."""
    from dataclasses import asdict

    from mempo_trl.kit.learner import shipped_learner

    paths = write_learner_world(tmp_path, learner.LEARNER_WORLD, learner.SPLIT_SIZES)
    derived = {**asdict(learning.LEARNER_WARM), **learning.FORGETFUL, "mem_drop": learning.HEADLINE["mem_drop"]}
    assert learning.shipped_warm_start(derived, paths) == shipped_learner()
    assert learning.shipped_warm_start({**derived, "mem_drop": 0.9}, paths) is None
    small = write_learner_world(
        tmp_path / "small", {"seed": 1, "num_entities": 60, "num_questions": 90}, {"test": 20, "rl": 30}
    )
    assert learning.shipped_warm_start(derived, small) is None
    settings = json.loads((shipped_learner() / "mempo_agent.json").read_text())
    assert settings["instruction"] == learner.LEARNER_INSTRUCTION


@pytest.mark.parametrize("module", ["analytics", "horizon_world", "induction_pretraining"])
def test_a_lab_module_run_as_a_script_says_it_is_a_module(module):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(LAB / f"{module}.py"), "--anything"], capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert (
        done.stderr.startswith(f"error: lab/{module}.py is a module, not a script: ") and done.stderr.count("\n") == 1
    )
