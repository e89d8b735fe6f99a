import doctest
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mempo_trl.advantages as advantages
from mempo_trl.advantages import combine_advantages, expand_to_rounds, group_outcome_advantages
from mempo_trl.memory import compute_memory_advantages


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


def test_expand_to_rounds():
    values = torch.tensor([0.5, -1.0, 2.0])
    assert expand_to_rounds(values, [2, 0, 3]).tolist() == [0.5, 0.5, 2.0, 2.0, 2.0]
    assert expand_to_rounds(values, [0, 0, 0]).shape == (0,)
    with pytest.raises(ValueError, match="2 round counts for 3 trajectories"):
        expand_to_rounds(values, [1, 1])
    with pytest.raises(ValueError, match=">= 0"):
        expand_to_rounds(values, [1, -1, 1])


def test_combine_advantages_seed_note_example():
    # Seed note 3.1: outcome +0.75 everywhere, memory +1.20 on the <mem> tokens -> 1.95 there.
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


def test_end_to_end_rows_of_one_question():
    # Two trajectories of one question (G = 2): traj 0 has 2 rounds and is right, traj 1 has 1 round and is wrong.
    outcome = group_outcome_advantages(torch.tensor([1.0, 0.0]), 2)
    rows = expand_to_rounds(outcome, [2, 1])
    mask = torch.ones(3, 4)
    memory = compute_memory_advantages(mask, ["q"] * 3, [[], [0], [0]], [[], [1], [1]], [[], [0.3], [-0.1]])
    final = combine_advantages(rows, memory, mask)
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    m = 0.2 / (math.sqrt(0.08) + 1e-6)
    assert final.tolist() == [
        pytest.approx([a] * 4),
        pytest.approx([a + m, a + m, a, a]),
        pytest.approx([-a - m, -a - m, -a, -a]),
    ]
