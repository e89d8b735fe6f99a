"""The outcome link (`lab/outcome_link.py`): its statistics by hand, and its command end to end at --quick."""

import doctest
import json
import math

import outcome_link
import pytest
from outcome_link import group_link, link_figures, ordered_as, positive_shares, spearman


def test_doctests():
    assert doctest.testmod(outcome_link).failed == 0


def test_spearman_by_hand():
    # ranks of x: 1 2 3 4; of y (0, 1, 0, 1): 1.5 3.5 1.5 3.5; centred: -1.5 -.5 .5 1.5 and -1 1 -1 1
    # sum of products 1.5 - .5 - .5 + 1.5 = 2; norms sqrt(5) and 2: 2 / (2 sqrt 5) = 1 / sqrt 5
    assert spearman([0.1, 0.2, 0.3, 0.4], [0.0, 1.0, 0.0, 1.0]) == pytest.approx(1 / math.sqrt(5))
    assert spearman([3.0, 2.0, 1.0], [0.0, 0.5, 1.0]) == pytest.approx(-1.0)
    assert spearman([1.0, 1.0, 1.0], [0.0, 0.5, 1.0]) is None


def test_ordered_as_needs_every_pair_with_different_outcomes():
    assert ordered_as([0.3, 0.2, 0.1], [1.0, 0.5, 0.0]) is True
    assert ordered_as([0.3, 0.1, 0.2], [1.0, 0.5, 0.0]) is False  # 0.5 vs 0.0 misordered
    assert ordered_as([0.3, 0.3, 0.1], [1.0, 1.0, 0.0]) is True  # a tie among equal outcomes is fine
    assert ordered_as([0.3, 0.3], [1.0, 0.0]) is False  # a tie across different outcomes is not


def test_true_and_false_positives_at_an_earlier_round():
    """At the round after 1 of 2 searches, a memory that keeps the first fact is complete so far; the second
    fact (not yet found) does not count."""
    held = [[True, False], [False, False], [True, True]]
    figures = group_link([0.4, 0.2, -0.6], {"share_em": [0.5, 0.0, 1.0]}, held, 1)
    assert (figures["tp"], figures["complete"], figures["fp"], figures["incomplete"]) == (1, 2, 1, 1)
    assert figures["spearman_share_em"] == pytest.approx(-0.5)
    assert figures["ordered_share_em"] is False
    assert positive_shares([0.0], [True]) == {"tp": 0, "complete": 1, "fp": 0, "incomplete": 0}


def test_link_figures_pool_counts_over_questions():
    groups = [
        {"spearman_share_em": 1.0, "ordered_share_em": True, "tp": 2, "complete": 2, "fp": 0, "incomplete": 2},
        {"spearman_share_em": -0.5, "ordered_share_em": False, "tp": 0, "complete": 1, "fp": 1, "incomplete": 3},
    ]
    figures = link_figures(groups, 50, 0)
    assert figures["spearman_share_em"]["value"] == pytest.approx(0.25)
    assert figures["ordered_share_em"]["value"] == pytest.approx(0.5)
    assert figures["true_positive"]["value"] == pytest.approx(2 / 3) and figures["true_positive"]["groups"] == 3
    assert figures["false_positive"]["value"] == pytest.approx(1 / 5)
    assert figures["false_positive"]["low"] <= 0.2 <= figures["false_positive"]["high"]


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path):
    """`credit_study.py --quick` then `outcome_link.py --quick`: every K and round from the first search's to the
    answer round, every variant; the answer round's memories are the credit study's own sampled memories."""
    import credit_study

    study_out, out = tmp_path / "study", tmp_path / "link"
    assert credit_study.main(["--quick", "--out", str(study_out)]) == 0
    study = json.loads((study_out / "credit_study.json").read_text())
    assert all(len(sha) == 64 for sha in study["artifacts"].values())  # the groups' and the adapter's sha256
    (tmp_path / "expected.json").write_text(json.dumps({**study, "figures": {}}))
    assert credit_study.main(["--quick", "--out", str(study_out), "--expect", str(tmp_path / "expected.json")]) == 1
    assert outcome_link.main(["--quick", "--study_out", str(study_out), "--out", str(out)]) == 0
    summary = json.loads((out / "outcome_link.json").read_text())
    assert set(summary["figures"]) == {"2", "4"}
    for k, cell in summary["figures"].items():
        assert set(cell) == {str(n) for n in range(1, int(k) + 1)}
        for round_cell in cell.values():
            assert set(round_cell["variants"]) == set(credit_study.VARIANTS)
    digest = credit_study.warm_digest(credit_study.study_of(True))
    link = {r["id"]: r["group"] for r in map(json.loads, (out / f"link_{digest}.jsonl").open())}
    for record in map(json.loads, (study_out / f"groups_{digest}.jsonl").open()):
        rounds = link[record["id"]]
        answer = rounds[max(rounds, key=int)]
        assert answer["memories"] == record["group"]["sampled"]["memories"]
        assert len(answer["finished"]) == len(answer["memories"])
        assert all(set(e) == {"all_parts_em", "share_em", "searches", "format_valid"} for e in answer["finished"])
