import doctest
import math
from dataclasses import fields

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mempo_trl.memory as memory
from mempo_trl.memory import (
    MemoryScores,
    answer_probability,
    losses_reward,
    memory_reward,
    memory_scores,
    normalize_memory_rewards,
    quantile_threshold,
    scatter_span_values,
    weakest_part_reward,
)
from mempo_trl.memory_rewards import MEMORY_REWARDS
from mempo_trl.settings import MemoryRewardSettings


INF = float("inf")


def test_doctests():
    assert doctest.testmod(memory, optionflags=doctest.ELLIPSIS).failed == 0


# ------------------------------------------------------------------------------------------- answer_probability


def test_answer_probability_threshold_on_and_off():
    logps = torch.tensor([[-0.1, -0.3, -2.0, -5.0], [-0.2, -0.4, -0.6, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    on = answer_probability(logps, mask)  # keeps logp > log(0.5) = -0.693
    assert on.tolist() == pytest.approx([math.exp(-0.2), math.exp(-1.2 / 4)])
    off = answer_probability(logps, mask, threshold=None)
    assert off.tolist() == pytest.approx([math.exp(-2.4 / 3), math.exp(-1.2 / 4)])
    strict = answer_probability(logps, mask, threshold=-0.25)
    assert strict.tolist() == pytest.approx([math.exp(-0.1), math.exp(-0.1)])


def test_answer_probability_empty_kept_set_is_zero():
    logps = torch.tensor([[-2.0, -3.0], [-0.1, -0.1], [-0.1, -0.1]])
    mask = torch.tensor([[True, True], [False, False], [True, False]])
    assert answer_probability(logps, mask).tolist() == pytest.approx([0.0, 0.0, math.exp(-0.1)])
    assert answer_probability(torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.bool)).tolist() == [0.0, 0.0]


def test_answer_probability_ignores_inf_and_nan_at_masked_positions():
    logps = torch.tensor([[-INF, -0.5, float("nan")], [-INF, -INF, -INF]])
    mask = torch.tensor([[0, 1, 0], [0, 0, 0]])
    out = answer_probability(logps, mask, threshold=None)
    assert out.tolist() == pytest.approx([math.exp(-0.5), 0.0])
    kept_minus_inf = answer_probability(torch.tensor([[-INF, -0.5]]), torch.ones(1, 2), threshold=None)
    assert kept_minus_inf.tolist() == [0.0]
    with pytest.raises(ValueError, match="same shape"):
        answer_probability(torch.zeros(2, 3), torch.ones(2, 2))


@settings(max_examples=100, deadline=None)
@given(st.data(), st.integers(1, 5), st.integers(0, 6), st.sampled_from([None, math.log(0.5), -3.0]))
def test_answer_probability_is_a_finite_probability(data, n, k, threshold):
    values = data.draw(st.lists(st.floats(-1e4, 0.0), min_size=n * k, max_size=n * k))
    bits = data.draw(st.lists(st.booleans(), min_size=n * k, max_size=n * k))
    p = answer_probability(torch.tensor(values).view(n, k), torch.tensor(bits).view(n, k), threshold)
    assert p.shape == (n,) and torch.isfinite(p).all() and (p >= 0).all() and (p <= 1).all()


# ------------------------------------------------------------------------------------------- quantile_threshold


def test_quantile_threshold_matches_numpy_and_filters():
    logps = torch.tensor([[-0.1, -0.4, -2.0, -7.0], [-0.9, -0.05, -1.5, -3.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    kept = np.array([-0.1, -0.4, -2.0, -0.9, -0.05, -1.5, -3.0])
    for q in (0.0, 0.3, 0.5, 1.0):
        assert quantile_threshold(logps, mask, q) == pytest.approx(float(np.quantile(kept, q)))
    threshold = quantile_threshold(logps, mask, 0.3)  # -1.68: drops -2.0 in row 0, -3.0 in row 1
    p = answer_probability(logps, mask, threshold)
    assert p.tolist() == pytest.approx([math.exp(-0.25), math.exp(-2.45 / 3)])


def test_quantile_threshold_edge_cases():
    assert quantile_threshold(torch.zeros(2, 3), torch.zeros(2, 3), 0.3) == -INF
    with_inf = torch.tensor([[-INF, -1.0, -0.5]])
    assert quantile_threshold(with_inf, torch.ones(1, 3), 0.25) == -INF
    assert quantile_threshold(with_inf, torch.ones(1, 3), 0.75) == pytest.approx(-0.75)
    with pytest.raises(ValueError, match=r"q must be in \[0, 1\]"):
        quantile_threshold(with_inf, torch.ones(1, 3), 1.5)
    with pytest.raises(ValueError, match="same shape"):
        quantile_threshold(with_inf, torch.ones(3), 0.5)


# ------------------------------------------------------------------------------------------------ memory_reward


def test_memory_reward_spec_worked_numbers():
    # Worked example: round 1 mem 0.12 vs full 0.35 -> -0.23; round 2 mem 0.71 vs full 0.68 -> +0.03.
    p_mem = answer_probability(torch.tensor([[math.log(0.12)], [math.log(0.71)]]), torch.ones(2, 1), threshold=None)
    p_full = answer_probability(torch.tensor([[math.log(0.35)], [math.log(0.68)]]), torch.ones(2, 1), threshold=None)
    assert memory_reward(p_mem, p_full).tolist() == pytest.approx([-0.23, 0.03], abs=1e-6)


def test_memory_reward_log_ratio_and_length_penalty():
    p_mem, p_full = torch.tensor([0.12, 0.0, 0.5]), torch.tensor([0.35, 0.0, 0.25])
    log_ratio = memory_reward(p_mem, p_full, mode="log_ratio")
    expected = [math.log(0.120001 / 0.350001), 0.0, math.log(0.500001 / 0.250001)]
    assert log_ratio.tolist() == pytest.approx(expected, rel=1e-5)
    penalized = memory_reward(p_mem, p_full, mem_lengths=[20, 0, 200], length_penalty=0.1, max_mem_tokens=100)
    assert penalized.tolist() == pytest.approx([-0.23 - 0.02, 0.0, 0.25 - 0.2])
    both = memory_reward(
        p_mem, p_full, mode="log_ratio", mem_lengths=torch.tensor([50, 50, 50]), length_penalty=1.0, max_mem_tokens=100
    )
    assert both.tolist() == pytest.approx([v - 0.5 for v in expected], rel=1e-5)
    ignored = memory_reward(p_mem, p_full, mem_lengths=[20, 0, 200], max_mem_tokens=100)
    assert ignored.tolist() == pytest.approx([-0.23, 0.0, 0.25])


def test_the_memory_reward_variants_are_the_choices_of_their_setting():
    """One registry: `memory_reward_type` offers exactly its keys, and each key computes its own variant."""
    (choices,) = [f.metadata["choices"] for f in fields(MemoryRewardSettings) if f.name == "memory_reward_type"]
    assert tuple(MEMORY_REWARDS) == tuple(choices)
    p_mem, p_full = torch.tensor([0.5]), torch.tensor([0.25])
    assert [memory_reward(p_mem, p_full, mode=mode, eps=1e-9).item() for mode in choices] == pytest.approx(
        [0.25, math.log(2.0)]
    )


def test_memory_scores_fill_the_scored_rows_and_leave_the_others_nan():
    """Rows 0 and 2 of 3 are scored: P = exp(mean kept log p), reward P_mem - P_full less the length penalty."""
    full = (torch.tensor([[math.log(0.5)], [math.log(0.8)]]), torch.ones(2, 1))
    mem = (torch.tensor([[math.log(0.75)], [math.log(0.2)]]), torch.ones(2, 1))
    settings = MemoryRewardSettings(memory_length_penalty=0.5)
    scores = memory_scores(3, [0, 2], full, mem, [10, 20], settings, threshold=None, max_mem_tokens=100)
    assert isinstance(scores, MemoryScores)
    assert scores.p_full[[0, 2]].tolist() == pytest.approx([0.5, 0.8])
    assert scores.reward[[0, 2]].tolist() == pytest.approx([0.25 - 0.05, -0.6 - 0.1])
    assert all(math.isnan(column[1]) for column in scores)
    assert [c.numel() for c in memory_scores(2, [], full, mem, [], settings, None, 100)] == [2, 2, 2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "ratio"}, "memory_reward_type must be one of"),
        ({"mode": "log_ratio", "eps": 0.0}, "eps must be > 0"),
        ({"length_penalty": -1.0}, "length_penalty must be >= 0"),
        ({"length_penalty": 0.1}, "needs mem_lengths"),
        ({"length_penalty": 0.1, "mem_lengths": [1, 2]}, "needs mem_lengths"),
        ({"length_penalty": 0.1, "mem_lengths": [1, 2], "max_mem_tokens": 0}, "positive max_mem_tokens"),
        ({"length_penalty": 0.1, "mem_lengths": [1, 2, 3], "max_mem_tokens": 10}, "must have the shape"),
    ],
)
def test_memory_reward_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        memory_reward(torch.tensor([0.1, 0.2]), torch.tensor([0.3, 0.4]), **kwargs)
    with pytest.raises(ValueError, match="same shape"):
        memory_reward(torch.tensor([0.1, 0.2]), torch.tensor([0.3]))


probs = st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8)


@settings(max_examples=100, deadline=None)
@given(probs, st.data(), st.sampled_from(["diff", "log_ratio"]))
def test_memory_reward_is_finite(p_mem, data, mode):
    p_full = data.draw(st.lists(st.floats(0.0, 1.0), min_size=len(p_mem), max_size=len(p_mem)))
    lengths = data.draw(st.lists(st.integers(0, 512), min_size=len(p_mem), max_size=len(p_mem)))
    reward = memory_reward(
        torch.tensor(p_mem), torch.tensor(p_full), mode, mem_lengths=lengths, length_penalty=0.5, max_mem_tokens=256
    )
    assert torch.isfinite(reward).all()


# ------------------------------------------------------------------------------------ normalize_memory_rewards


def test_normalize_pool_of_16x3_against_torch():
    gen = torch.Generator().manual_seed(0)
    pool = torch.rand(16, 3, generator=gen, dtype=torch.float64) * 2 - 1
    other = torch.rand(16, 2, generator=gen, dtype=torch.float64)
    # Interleave the two questions' rows: q1 row 0, q2 row 0, q1 row 1, ...
    group_ids, rows = [], []
    for i in range(16):
        group_ids += ["q1", "q2"]
        rows += [pool[i].tolist(), other[i].tolist()]
    out = normalize_memory_rewards(group_ids, rows)
    expected_q1 = ((pool - pool.mean()) / (pool.std(unbiased=True) + 1e-6)).tolist()
    expected_q2 = ((other - other.mean()) / (other.std(unbiased=True) + 1e-6)).tolist()
    for i in range(16):
        assert out[2 * i] == pytest.approx(expected_q1[i], abs=1e-12)
        assert out[2 * i + 1] == pytest.approx(expected_q2[i], abs=1e-12)
    flat = np.array(out[0::2]).ravel()
    assert flat.mean() == pytest.approx(0.0, abs=1e-12) and flat.std(ddof=1) == pytest.approx(1.0, abs=1e-5)


def test_normalize_small_and_degenerate_pools():
    # q1: one value -> mean 0, std 1; q2: std 0 -> r - mean; q3: empty rows only; q4: ordinary pool of two
    out = normalize_memory_rewards(["q1", "q2", "q2", "q3", "q4", "q4"], [[0.3], [0.2], [0.2, 0.2], [], [1.0], [-1.0]])
    assert out[0] == pytest.approx([0.3 / (1 + 1e-6)], abs=1e-15)
    assert out[1:3] == [[0.0], [0.0, 0.0]]
    assert out[3] == []
    s = math.sqrt(2.0)  # unbiased std of {1, -1}
    assert out[4] == pytest.approx([1 / (s + 1e-6)]) and out[5] == pytest.approx([-1 / (s + 1e-6)])
    assert normalize_memory_rewards([], []) == []


def test_normalize_per_round_pools():
    # Round imbalance (docs/algorithm.md, "Variants"): later rounds have systematically lower rewards.
    group_ids = ["q", "q", "q"]
    rewards = [[-0.1, -0.3], [-0.2, -0.4], [-0.15]]
    rounds = [[2, 3], [2, 3], [2]]
    pooled = normalize_memory_rewards(group_ids, rewards)
    per_round = normalize_memory_rewards(group_ids, rewards, round_ids=rounds)
    assert pooled[0][0] > 0 and pooled[0][1] < 0
    r2 = np.array([-0.1, -0.2, -0.15])
    r2_expected = (r2 - r2.mean()) / (r2.std(ddof=1) + 1e-6)
    r3 = np.array([-0.3, -0.4])
    r3_expected = (r3 - r3.mean()) / (r3.std(ddof=1) + 1e-6)
    assert [per_round[0][0], per_round[1][0], per_round[2][0]] == pytest.approx(r2_expected.tolist())
    assert [per_round[0][1], per_round[1][1]] == pytest.approx(r3_expected.tolist())
    with pytest.raises(ValueError, match="nested shape"):
        normalize_memory_rewards(group_ids, rewards, round_ids=[[2, 3], [2], [2]])
    with pytest.raises(ValueError, match="nested shape"):
        normalize_memory_rewards(group_ids, rewards, round_ids=[[2, 3], [2, 3]])
    with pytest.raises(ValueError, match="2 group ids for 3 reward rows"):
        normalize_memory_rewards(group_ids[:2], rewards)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.lists(st.floats(-1e6, 1e6), max_size=4)), max_size=12))
def test_normalize_is_finite_and_keeps_structure(rows):
    out = normalize_memory_rewards([g for g, _ in rows], [r for _, r in rows])
    assert [len(r) for r in out] == [len(r) for _, r in rows]
    assert all(math.isfinite(v) for row in out for v in row)


# ------------------------------------------------------------------------------------------ scatter / advantages


def test_scatter_span_values():
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    out = scatter_span_values(mask, [[0, 3], [], [2]], [[1, 9], [], [4]], [[0.5, -1.0], [], [2.0]])
    assert out.dtype == torch.float32
    assert out.tolist() == [
        [0.5, 0.5, 0.0, -1.0, -1.0, 0.0],  # second span clipped to T and masked
        [0.0] * 6,
        [0.0, 0.0, 2.0, 0.0, 0.0, 0.0],
    ]
    assert scatter_span_values(torch.ones(1, 3), [[5, -2]], [[7, 0]], [[1.0, 3.0]]).tolist() == [[3.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="need 2 rows"):
        scatter_span_values(torch.ones(2, 3), [[0]], [[1]], [[1.0]])
    with pytest.raises(ValueError, match="row 0: 1 starts, 2 ends and 1 values"):
        scatter_span_values(torch.ones(1, 3), [[0]], [[1, 2]], [[1.0]])


def test_weakest_part_reward_scores_a_memory_by_the_part_it_lost():
    """Row 0: two parts; the memory holds part 1 as well as the full history (0.9 each) but part 2 at 0.2 against
    0.8. Joint: sqrt(.9 * .2) - sqrt(.9 * .8) = 0.4243 - 0.8485; weakest: part 2, 0.2 - 0.8 = -0.6 (part 1: 0). Row
    1 has no part tokens (parts all 0): the joint reward. With the default filter (log 0.5) part 2's memory tokens
    are dropped: P_mem = 0, reward -0.8."""
    log = torch.log
    full = (
        log(torch.tensor([[0.9, 0.9, 0.8, 0.8], [0.5, 0.5, 1.0, 1.0]])),
        torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
    )
    mem = (log(torch.tensor([[0.9, 0.9, 0.2, 0.2], [0.8, 0.2, 1.0, 1.0]])), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]))
    parts = torch.tensor([[1, 1, 2, 2], [0, 0, 0, 0]])
    got = weakest_part_reward(full, mem, parts, threshold=None)
    assert got.tolist() == pytest.approx([0.2 - 0.8, 0.4 - 0.5], abs=1e-6)
    joint = memory_reward(answer_probability(*mem, None), answer_probability(*full, None))
    assert joint[0].item() == pytest.approx(math.sqrt(0.9 * 0.2) - math.sqrt(0.9 * 0.8), abs=1e-6)
    assert weakest_part_reward(full, mem, parts)[0].item() == pytest.approx(-0.8, abs=1e-6)
    ratio = weakest_part_reward(full, mem, parts, mode="log_ratio", threshold=None)[0].item()
    assert ratio == pytest.approx(math.log(0.2 + 1e-6) - math.log(0.8 + 1e-6), abs=1e-5)


def test_losses_reward_never_rewards_a_lost_part_and_grades_how_many_were_lost():
    """Four-part golds, one token a part, P_full 0.8 on each. Row 0 gains on three parts (0.9) and lost one (0.2):
    (0 + 0 + 0 - 0.6) / 4. Row 1 lost two: (-0.6 - 0.6) / 4, lower (the weakest part ties them at -0.6). Row 2 lost
    none: the joint reward, 0.9 - 0.8. Row 3 gains on three parts (1.0) and lost one a little (0.7): the joint
    reward, 0.7^(1/4) - 0.8 = +0.115, pays for the loss; losses gives -0.1 / 4."""
    probabilities = torch.tensor(
        [[0.9, 0.9, 0.9, 0.2], [0.9, 0.9, 0.2, 0.2], [0.9, 0.9, 0.9, 0.9], [1.0, 1.0, 1.0, 0.7]]
    )
    full = (torch.log(torch.full((4, 4), 0.8)), torch.ones(4, 4))
    mem = (torch.log(probabilities), torch.ones(4, 4))
    parts = torch.tensor([[1, 2, 3, 4]] * 4)
    got = losses_reward(full, mem, parts, threshold=None)
    assert got.tolist() == pytest.approx([-0.6 / 4, -1.2 / 4, 0.9 - 0.8, -0.1 / 4], abs=1e-6)
    joint = memory_reward(answer_probability(*mem, None), answer_probability(*full, None))
    assert joint[3].item() == pytest.approx(0.7**0.25 - 0.8, abs=1e-6) and joint[3] > 0  # the mean pays for it
    assert weakest_part_reward(full, mem, parts, threshold=None)[:2].tolist() == pytest.approx([-0.6, -0.6])  # a tie
    settings = MemoryRewardSettings(memory_reward_parts="losses", memory_threshold=None)
    scores = memory_scores(4, [0, 1, 2, 3], full, mem, [1] * 4, settings, None, 100, parts)
    assert scores.reward.tolist() == pytest.approx(got.tolist(), abs=1e-6)


def test_memory_scores_take_the_weakest_part_only_when_asked():
    """`memory_scores` with ``memory_reward_parts="weakest"``: the reward of row 0's weakest part less the length
    penalty (0.5 x 10 / 100); P_full and P_mem stay joint; "joint" ignores the parts."""
    log = torch.log
    full = (log(torch.tensor([[0.9, 0.8]])), torch.tensor([[1, 1]]))
    mem = (log(torch.tensor([[0.9, 0.2]])), torch.tensor([[1, 1]]))
    parts = torch.tensor([[1, 2]])
    weakest = MemoryRewardSettings(memory_reward_parts="weakest", memory_length_penalty=0.5, memory_threshold=None)
    scores = memory_scores(2, [1], full, mem, [10], weakest, None, 100, parts)
    assert scores.reward[1].item() == pytest.approx(0.2 - 0.8 - 0.05, abs=1e-6) and math.isnan(scores.reward[0])
    assert scores.p_mem[1].item() == pytest.approx(math.sqrt(0.9 * 0.2), abs=1e-6)
    joint = MemoryRewardSettings(memory_length_penalty=0.5, memory_threshold=None)
    expected = math.sqrt(0.9 * 0.2) - math.sqrt(0.9 * 0.8) - 0.05
    assert memory_scores(2, [1], full, mem, [10], joint, None, 100, parts).reward[1].item() == pytest.approx(expected)
