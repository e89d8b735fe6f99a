"""MemPO's metrics over processes (`mempo_trl.metrics.mean_metrics`), on hand-written values."""

import doctest

import pytest
import torch

import mempo_trl.metrics as metrics
from mempo_trl.metrics import mean_metrics


def test_doctests():
    assert doctest.testmod(metrics).failed == 0


def test_means_and_stds_span_processes():
    """Two processes: this one's values [1, 2] of memory/reward, the other's [3] (its sums [3, 1, 9] added by
    ``gather_sum``): mean 2, std sqrt((1 + 4 + 9) / 3 - 4) = sqrt(2/3); episode/em has a value on the other only."""
    other = {"memory/reward": [3.0], "episode/em": [1.0], "tokens/mem_length": []}
    theirs = [[sum(v), len(v), sum(x * x for x in v)] for v in other.values()]
    here = {"memory/reward": [1.0, 2.0], "episode/em": [], "tokens/mem_length": []}
    out = mean_metrics(here, lambda local: local + torch.tensor(theirs))
    assert out == pytest.approx({"memory/reward": 2.0, "memory/reward_std": (2 / 3) ** 0.5, "episode/em": 1.0})
