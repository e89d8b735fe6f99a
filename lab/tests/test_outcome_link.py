"""The outcome link (`lab/outcome_link.py`): its statistics by hand (its command end to end at --quick: the credit
study's quick test, `test_credit_study.py`)."""

import doctest
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
