import doctest
import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mempo_trl.advantages as advantages
from mempo_trl import MemoryRewardSettings
from mempo_trl.advantages import batch_advantages, combine_advantages, group_outcome_advantages, mempo_advantages


def test_doctests():
    assert doctest.testmod(advantages).failed == 0


def test_group_scaling_uses_unbiased_std_and_trl_epsilon():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    out = group_outcome_advantages(rewards, 4)
    # group 1: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5 (the biased std would be 0.433)
    assert out[:4].tolist() == pytest.approx([0.75 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001])
    assert out[4:].tolist() == [0.0] * 4  # std 0: (r - mean) / 1e-4 = 0
    assert group_outcome_advantages(rewards, 4, scale_rewards=True).tolist() == out.tolist()


def test_batch_and_no_scaling():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    batch_std = math.sqrt((3 * 0.25**2 + 0.75**2) / 3)  # unbiased std of the whole batch = 0.5
    batch = group_outcome_advantages(rewards, 2, scale_rewards="batch")
    assert batch.tolist() == pytest.approx([0.5 / (batch_std + 1e-4), -0.5 / (batch_std + 1e-4), 0.0, 0.0])
    for scale in ("none", False):
        assert group_outcome_advantages(rewards, 2, scale_rewards=scale).tolist() == [0.5, -0.5, 0.0, 0.0]


def test_single_generation_groups_have_zero_advantage():
    rewards = torch.tensor([1.0, 0.0, 0.3])
    assert group_outcome_advantages(rewards, 1).tolist() == [0.0, 0.0, 0.0]
    assert group_outcome_advantages(torch.tensor([0.7]), 1, scale_rewards="batch").tolist() == [0.0]


@pytest.mark.parametrize(
    ("rewards", "g", "scale", "message"),
    [
        (torch.zeros(6), 4, "group", "do not split into groups of 4"),
        (torch.zeros(6), 0, "group", "do not split"),
        (torch.zeros(2, 2), 2, "group", "must be 1-D"),
        (torch.zeros(4), 2, "std", "scale_rewards must be"),
    ],
)
def test_group_outcome_advantages_validation(rewards, g, scale, message):
    with pytest.raises(ValueError, match=message):
        group_outcome_advantages(rewards, g, scale)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.sampled_from(["group", "batch", "none"]), st.data())
def test_group_advantages_are_finite_and_centred(g, n_groups, scale, data):
    values = data.draw(st.lists(st.floats(-10, 10), min_size=g * n_groups, max_size=g * n_groups))
    out = group_outcome_advantages(torch.tensor(values), g, scale)
    assert torch.isfinite(out).all()
    if scale == "none":
        assert out.view(n_groups, g).sum(dim=1).abs().max() < 1e-4


def test_combine_advantages_seed_note_example():
    # Worked example: outcome +0.75 everywhere, memory +1.20 on the <mem> tokens -> 1.95 there.
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    memory = torch.tensor([[1.2, 1.2, 0.0, 0.0, 0.0, 0.0], [0.0, -0.4, -0.4, 0.0, 0.0, 0.0]])
    out = combine_advantages(torch.tensor([0.75, -0.5]), memory, mask)
    assert out.dtype == torch.float32
    assert out.tolist() == [
        pytest.approx([1.95, 1.95, 0.75, 0.75, 0.75, 0.0]),
        pytest.approx([-0.5, -0.9, -0.9, -0.5, 0.0, 0.0]),
    ]
    half = combine_advantages(torch.tensor([0.75, -0.5]), memory, mask, memory_coef=0.5)
    assert half[0, 0].item() == pytest.approx(1.35)
    with pytest.raises(ValueError, match="do not match"):
        combine_advantages(torch.tensor([0.75]), memory, mask)
    with pytest.raises(ValueError, match="do not match"):
        combine_advantages(torch.tensor([0.75, 0.1]), memory, mask[:, :3])


def test_rows_of_one_question():
    # Two trajectories of one question (G = 2): traj 0 has 2 rounds and is right, traj 1 has 1 round and is wrong.
    # Only traj 0's round 2 is scored (reward 0.3): a pool of one value uses mean 0, std 1.
    out = mempo_advantages(
        torch.tensor([1.0, 0.0]),
        [0, 0, 1],
        [0, 1, 0],
        [None, 0.3, None],
        [None, (0, 1), None],
        torch.ones(3, 4),
        slice(0, 3),
        num_generations=2,
    )
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert out.outcome.tolist() == pytest.approx([a, -a])
    assert out.advantages.tolist() == [
        pytest.approx([a] * 4),
        pytest.approx([a + 0.3, a + 0.3, a, a], abs=1e-6),
        pytest.approx([-a] * 4),
    ]
    assert out.memory.tolist() == [[0.0] * 4, pytest.approx([0.3, 0.3, 0.0, 0.0], abs=1e-6), [0.0] * 4]


# Two questions (G = 2): trajectories 0, 1 answer "a", 2, 3 answer "b"; outcome rewards 1, 0, 0, 0.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0])
TRAJECTORIES = [0, 0, 1, 1, 2, 3, 3, 3]
ROUNDS = [0, 1, 0, 1, 0, 0, 1, 2]
MEMORY = [None, 0.2, None, 0.6, None, None, 0.5, 0.1]
SPANS = [None, (0, 1), None, (1, 2), None, None, (1, 3), (2, 4)]


def _run(**kwargs):
    """`mempo_advantages` on the batch above; ``memory_*`` keywords are its `MemoryRewardSettings`."""
    settings = MemoryRewardSettings(**{k: kwargs.pop(k) for k in list(kwargs) if k.startswith("memory_")})
    defaults = dict(completion_mask=torch.ones(8, 5), local_rows=slice(0, 8), num_generations=2)
    return mempo_advantages(REWARDS, TRAJECTORIES, ROUNDS, MEMORY, SPANS, **{**defaults, **kwargs}, settings=settings)


def test_memory_pools_per_question_and_per_question_round():
    a = 0.5 / (math.sqrt(0.5) + 1e-4)  # outcome advantage of question "a"; question "b" has all rewards 0
    pooled = _run()
    m_a = (0.6 - 0.4) / (math.sqrt(0.08) + 1e-6)  # pool a = {0.2, 0.6}
    m_b = (0.5 - 0.3) / (math.sqrt(0.08) + 1e-6)  # pool b = {0.5, 0.1}
    expected = [
        [a] * 5,
        [a - m_a, a - m_a, a, a, a],
        [-a] * 5,
        [-a, -a + m_a, -a + m_a, -a, -a],
        [0.0] * 5,
        [0.0] * 5,
        [0.0, m_b, m_b, m_b, 0.0],
        [0.0, 0.0, -m_b, -m_b, -m_b],
    ]
    assert pooled.advantages.tolist() == [pytest.approx(row, abs=1e-5) for row in expected]
    # Per (question, round): b's pools hold one value each (mean 0, std 1); a's two round-2 rewards still pool.
    per_round = _run(memory_pooling="question_round")
    assert per_round.advantages[1].tolist() == pytest.approx([a - m_a, a - m_a, a, a, a], abs=1e-5)
    assert per_round.advantages[6].tolist() == pytest.approx([0.0] + [0.5 / (1 + 1e-6)] * 3 + [0.0])
    assert per_round.advantages[7].tolist() == pytest.approx([0.0, 0.0] + [0.1 / (1 + 1e-6)] * 3)
    half = _run(memory_coef=0.5)
    assert half.advantages[6].tolist() == pytest.approx([0.0, m_b / 2, m_b / 2, m_b / 2, 0.0])
    assert half.memory.tolist() == pooled.memory.tolist()


def test_memory_scale_divides_by_the_pool_std_the_batch_std_or_nothing():
    # Scored rewards 0.2, 0.6 (question a) and 0.5, 0.1 (question b): pool means 0.4 and 0.3 in every mode.
    batch_std = math.sqrt(sum((v - 0.35) ** 2 for v in (0.2, 0.6, 0.5, 0.1)) / 3)  # 0.2380: all four values
    batch = _run(memory_scale_rewards="batch").memory
    assert batch[1].tolist() == pytest.approx([-0.2 / (batch_std + 1e-6)] * 2 + [0.0] * 3, abs=1e-6)
    assert batch[6].tolist() == pytest.approx([0.0] + [0.2 / (batch_std + 1e-6)] * 3 + [0.0], abs=1e-6)
    none = _run(memory_scale_rewards="none").memory
    assert none[3].tolist() == pytest.approx([0.0, 0.2, 0.2, 0.0, 0.0], abs=1e-6)
    assert none[7].tolist() == pytest.approx([0.0, 0.0, -0.2, -0.2, -0.2], abs=1e-6)
    # A pool of one value keeps mean 0 and takes the batch's std.
    single = _run(memory_pooling="question_round", memory_scale_rewards="batch").memory
    assert single[6].tolist() == pytest.approx([0.0] + [0.5 / (batch_std + 1e-6)] * 3 + [0.0], abs=1e-6)
    with pytest.raises(ValueError, match="memory_scale_rewards must be one of"):
        _run(memory_scale_rewards="question")


def test_gate_keeps_memory_where_outcome_advantage_is_zero_or_more():
    gated = _run(memory_gate_on_outcome=True)
    pooled = _run()
    # Question "a": trajectory 1 has outcome advantage < 0 -> its memory advantage is dropped (after pooling).
    assert gated.memory[3].tolist() == [0.0] * 5
    assert gated.memory[1].tolist() == pooled.memory[1].tolist()
    # Question "b": every outcome advantage is exactly 0 -> kept (the gate is >= 0).
    assert gated.memory[6].tolist() == pooled.memory[6].tolist() != [0.0] * 5


def test_local_rows_slice_and_placeholders():
    full = _run()
    mask = torch.ones(5, 5)
    mask[1, 3:] = 0  # a shorter completion
    mask[4] = 0  # placeholder rows past the local slice
    part = _run(completion_mask=mask, local_rows=slice(4, 8))
    torch.testing.assert_close(part.advantages[:4], full.advantages[4:] * mask[:4])
    assert part.advantages[4].tolist() == [0.0] * 5
    torch.testing.assert_close(part.outcome, full.outcome)


def test_mempo_advantages_validation():
    with pytest.raises(ValueError, match="one entry per row"):
        mempo_advantages(REWARDS, TRAJECTORIES, ROUNDS[:3], MEMORY, SPANS, torch.ones(8, 5), slice(0, 8), 2)
    with pytest.raises(ValueError, match="needs at least 8 rows"):
        _run(completion_mask=torch.ones(7, 5))
    with pytest.raises(ValueError, match="memory_pooling must be one of"):
        _run(memory_pooling="round")
    with pytest.raises(ValueError, match="needs its <mem> span"):
        mempo_advantages(REWARDS, [0], [1], [0.5], [None], torch.ones(1, 5), slice(0, 1), 2)


def test_an_unscorable_trajectory_gets_no_advantage_and_leaves_its_group_alone():
    """A trajectory every reward function returned None for (NaN after TRL's gathering) is out of its group's mean and
    std and gets advantage 0, as in TRL 1.16; counted as reward 0 it would move its group and itself."""

    nan = float("nan")
    got = group_outcome_advantages(torch.tensor([1.0, 0.0, nan, 3.0, 3.0, 5.0]), 3, "group")
    std = math.sqrt(((1 - 0.5) ** 2 + (0 - 0.5) ** 2) / 1)  # unbiased, over the two scored values
    rest = statistics.stdev([3.0, 3.0, 5.0])
    expected = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.0, *((v - 11 / 3) / (rest + 1e-4) for v in (3.0, 3.0, 5.0))]
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-5, rtol=1e-5)
    batch = group_outcome_advantages(torch.tensor([1.0, nan, 0.0, 0.0]), 2, "batch")
    torch.testing.assert_close(batch, torch.tensor([0.0, 0.0, 0.0, 0.0]))  # group 1 has one scored value: centred 0


def test_batch_advantages_pool_the_rounds_of_all_processes_and_return_this_ones():
    """Process 1 of 2 (one episode each; G = 2, both answer one question): its row is trajectory 1, pooled with
    process 0's row of trajectory 0. Outcome rewards 1 and 0, weighted by 2: advantages +1 and -1 ("none" scaling:
    reward - group mean). Memory rewards 0.3 (process 0) and 0.1 (here): pool mean 0.2, std 0.1414 (unbiased), so
    this row's memory advantage is (0.1 - 0.2) / 0.1414 = -0.7071 on its <mem> tokens 0..1."""
    from types import SimpleNamespace

    theirs = torch.tensor([[0, 1, 0.3, 0, 1], [-1, 0, math.nan, -1, -1]], dtype=torch.float64)  # and a placeholder
    mine = [SimpleNamespace(episode_index=0, round_index=1, mem_span=(0, 1))]
    gathered = []

    def gather(table):
        gathered.append(table)
        return torch.cat([theirs, table])

    settings = MemoryRewardSettings(memory_scale_rewards="group")
    out = batch_advantages(
        torch.tensor([[1.0], [0.0]]),
        torch.tensor([2.0]),
        mine,
        torch.tensor([0.1]),
        torch.ones(2, 3),
        rank=1,
        episodes_per_process=1,
        gather=gather,
        num_generations=2,
        scale_rewards="none",
        settings=settings,
    )
    (table,) = gathered
    assert table.shape == (2, 5) and table[0].tolist() == [1, 1, pytest.approx(0.1), 0, 1] and table[1, 0] == -1
    assert out.outcome.tolist() == [1.0, -1.0]
    memory = -0.1 / math.sqrt(0.02)
    assert out.advantages[0].tolist() == pytest.approx([-1.0 + memory, -1.0 + memory, -1.0], abs=1e-4)  # float32
    assert out.advantages[1].tolist() == [0.0, 0.0, 0.0]  # a placeholder row


def test_batch_advantages_normalize_then_sum_and_unscorable_rows():
    """TRL's ``normalize_then_sum``: each function normalised in its group, then weighted and summed; a NaN memory
    reward (an unscored round) gives no memory advantage."""
    from types import SimpleNamespace

    rows = [SimpleNamespace(episode_index=e, round_index=0, mem_span=None) for e in range(2)]
    out = batch_advantages(
        torch.tensor([[1.0, 0.0], [0.0, 0.0]]),
        torch.tensor([1.0, 3.0]),
        rows,
        torch.tensor([math.nan, math.nan]),
        torch.ones(2, 1),
        rank=0,
        episodes_per_process=2,
        gather=lambda table: table,
        num_generations=2,
        aggregation="normalize_then_sum",
    )
    # function 1 in its group: (1 - 0.5) / std(1, 0) = 0.7071 and -0.7071; function 2 all equal: 0
    assert out.outcome.tolist() == pytest.approx([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)], abs=1e-4)
    assert out.memory.abs().sum() == 0


def test_uncentred_memory_advantage_keeps_each_rewards_sign():
    """``memory_center_rewards=False``: two rounds of one question with memory rewards -0.1 and -0.3 (both memories
    worse than the full history): centred, the first gets +0.1 (scale "none"); uncentred both stay negative, -0.1
    and -0.3 on their <mem> tokens (outcome rewards equal: outcome advantage 0)."""
    args = ([1.0, 1.0], [0, 1], [1, 1], [-0.1, -0.3], [(0, 0), (0, 0)], torch.ones(2, 2), slice(0, 2), 2)
    centred = mempo_advantages(
        torch.tensor(args[0]), *args[1:], settings=MemoryRewardSettings(memory_scale_rewards="none")
    )
    assert centred.advantages[:, 0].tolist() == pytest.approx([0.1, -0.1], abs=1e-6)
    settings = MemoryRewardSettings(memory_scale_rewards="none", memory_center_rewards=False)
    out = mempo_advantages(torch.tensor(args[0]), *args[1:], settings=settings)
    torch.testing.assert_close(out.advantages, torch.tensor([[-0.1, 0.0], [-0.3, 0.0]]))
