import doctest

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mempo_trl.rewards as rewards
from mempo_trl.rewards import (
    OutcomeScore,
    exact_match,
    f1_score,
    mempo_all_parts_reward,
    mempo_outcome_reward,
    normalize_answer,
    outcome_score,
    sub_exact_match,
)


def test_doctests():
    assert doctest.testmod(rewards).failed == 0


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        ("The  Eiffel Tower!", "eiffel tower"),
        ("an apple, a pear", "apple pear"),
        ("Theory of the Atom", "theory of atom"),
        ("U.S.A.", "usa"),
        ("  \n ", ""),
        ("Ulm\tGermany", "ulm germany"),
    ],
)
def test_normalize_answer(raw, normalized):
    assert normalize_answer(raw) == normalized


def test_exact_match():
    assert exact_match("The Paris.", ["London", "paris"]) == 1.0
    assert exact_match("Paris France", ["paris"]) == 0.0
    assert exact_match("paris", "Paris") == 1.0
    assert exact_match(None, ["paris"]) == 0.0
    assert exact_match("paris", []) == 0.0


def test_sub_exact_match():
    assert sub_exact_match("It is Paris, France.", ["paris"]) == 1.0
    assert sub_exact_match("Paris", ["paris france"]) == 0.0
    assert sub_exact_match(None, ["paris"]) == 0.0
    assert sub_exact_match("anything", ["the"]) == 0.0  # an alias that normalises to "" needs an empty prediction
    assert sub_exact_match("a", ["the"]) == 1.0


def test_f1_score_hand_computed():
    # pred tokens [gunter, czisch, mayor], gold [gunter, czisch]: P = 2/3, R = 1, F1 = 0.8
    assert f1_score("Gunter Czisch, the mayor", ["Gunter Czisch"]) == pytest.approx(0.8)
    assert f1_score("Gunter Czisch, the mayor", ["nobody", "Czisch"]) == pytest.approx(0.5)
    assert f1_score("paris paris", ["paris"]) == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert f1_score("London", ["paris"]) == 0.0
    assert f1_score("the", ["a"]) == 1.0
    assert f1_score("the", ["paris"]) == 0.0
    assert f1_score(None, ["paris"]) == 0.0


@pytest.mark.parametrize(
    ("prediction", "gold", "f1"),
    [
        ("Café", "Cafe\u0301", 1.0),  # NFC vs NFD: the same text
        ("Ｐａｒｉｓ", "Paris", 1.0),  # full-width letters
        ("Paris\u200b", "Paris", 1.0),  # a zero-width space
        ("\ufeffParis", "Paris", 1.0),  # a byte-order mark
        ("ﬁsh", "fish", 1.0),  # the fi ligature
        ("Ｐａｒｉｓ Ｆｒａｎｃｅ", "Paris", 2 * 0.5 * 1 / 1.5),  # tokens [paris, france] vs [paris]: P 1/2, R 1
        ("Cafe", "Café", 0.0),  # an accent is a letter, not a form: still another word
    ],
)
def test_unicode_forms_of_the_same_text_match(prediction, gold, f1):
    assert exact_match(prediction, [gold]) == float(f1 == 1.0)
    assert f1_score(prediction, [gold]) == pytest.approx(f1)
    assert sub_exact_match(prediction, [gold]) == float(f1 > 0)


def squad_normalize(s: str) -> str:
    """SQuAD's normalisation as published (lower-case, punctuation, articles, white space), with no Unicode step."""
    import re
    import string

    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(max_codepoint=127), max_size=40))
def test_ascii_normalises_exactly_as_squad(text):
    assert normalize_answer(text) == squad_normalize(text)


answers = st.text(max_size=30)


@settings(max_examples=200, deadline=None)
@given(answers, st.lists(answers, min_size=1, max_size=3))
def test_metric_relations(pred, golds):
    em, f1, sub = exact_match(pred, golds), f1_score(pred, golds), sub_exact_match(pred, golds)
    assert em in (0.0, 1.0) and sub in (0.0, 1.0) and 0.0 <= f1 <= 1.0
    if em == 1.0:
        assert f1 == 1.0 and sub == 1.0


def test_outcome_score_single_and_invalid():
    assert outcome_score("the Paris", ["paris", "Paris, France"]) == OutcomeScore(1.0, 1.0, 1.0, (1.0,))
    score = outcome_score("Paris France", ["paris"])
    assert (score.em, score.sub_em, score.per_question_em) == (0.0, 1.0, (0.0,))
    assert score.f1 == pytest.approx(2 / 3)
    assert outcome_score("paris", ["paris"], format_valid=False) == OutcomeScore(0.0, 0.0, 0.0, (0.0,))
    assert outcome_score(None, ["paris"]) == OutcomeScore(0.0, 0.0, 0.0, (0.0,))


def test_outcome_score_multi_objective():
    subs = [["Ulm", "Ulm, Germany"], ["Gunter Czisch"], ["1879"]]
    score = outcome_score("ulm; Czisch; 1879", ["unused"], subs)
    assert score.per_question_em == (1.0, 0.0, 1.0)
    assert score.em == pytest.approx(2 / 3)
    assert score.f1 == pytest.approx((1.0 + 2 / 3 + 1.0) / 3)
    assert score.sub_em == pytest.approx(2 / 3)  # "czisch" does not contain "gunter czisch"
    missing = outcome_score("Ulm", [], subs)  # only one part: questions 2 and 3 score 0
    assert missing.per_question_em == (1.0, 0.0, 0.0) and missing.em == pytest.approx(1 / 3)
    extra = outcome_score("Ulm; Gunter Czisch; 1879; more", [], subs)
    assert extra.em == 1.0
    assert outcome_score("Ulm", [], subs, format_valid=False).per_question_em == (0.0, 0.0, 0.0)
    assert outcome_score("Ulm", ["Ulm"], []) == OutcomeScore(1.0, 1.0, 1.0, (1.0,))  # empty sub_answers: single row


def test_mempo_outcome_reward():
    good = "<mem>m</mem>\n<think>t</think>\n<answer> Ulm </answer>"
    conversational = [{"role": "assistant", "content": good}]
    parts = [{"role": "assistant", "content": [{"type": "text", "text": good}]}]
    search = "<mem>m</mem><think>t</think><search>Ulm</search>"
    broken = "<mem>m</mem><answer>Ulm</answer>"
    completions = [good, conversational, parts, search, broken, good, [], good]
    golds = [["ulm"]] * 7 + [[]]
    subs = [None] * 7 + [[["Ulm"], ["Max"]]]
    out = mempo_outcome_reward(["q"] * 8, completions, golds, sub_answers=subs, extra_column=[0] * 8)
    assert out == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.5]
    valid = [True, True, True, True, True, False, True, True]
    assert mempo_outcome_reward(["q"] * 8, completions, golds, sub_answers=subs, format_valid=valid)[5] == 0.0
    assert mempo_outcome_reward(["q"], ["<mem>m</mem><think>t</think><answer>Ulm</answer>"], [["Berlin"]]) == [0.0]


def test_all_parts_reward_pays_only_for_the_whole_answer():
    def turn(answer):
        return f"<mem>m</mem><think>t</think><answer>{answer}</answer>"

    subs = [[["1927"], ["Ulm"], ["40 metres", "40"]]] * 5 + [None]
    completions = [turn("1927; Ulm; 40"), turn("1927; Ulm; 41"), turn("1927"), turn("1927; Ulm; 40"), "", turn("Ulm")]
    golds = [[]] * 5 + [["ulm"]]
    valid = [True, True, True, False, True, True]
    args = (["q"] * 6, completions, golds, subs, valid)
    assert mempo_outcome_reward(*args) == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0, 0.0, 1.0])
    assert mempo_all_parts_reward(*args) == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
