"""The RL comparison (`lab/rl_compare.py`): its rule by hand, and its GPU stage dry-run on the CPU."""

import doctest
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import rl_compare
from rl_compare import RULE, verdict


LAB = Path(__file__).resolve().parents[1]


def test_doctests():
    assert doctest.testmod(rl_compare).failed == 0


def _evals(gaps, recall_gap=0.2, warm=None):
    """Outcome-only at all-parts EM 0.2 and recall 0.5 in every seed; each MemPO arm ahead by ``gaps[seed]``."""
    evals = {"warm": warm or {"format_valid": 0.9, "searched_k": 0.85}}
    for seed, gap in enumerate(gaps):
        evals[f"outcome_only_s{seed}"] = {"all_parts_em": 0.2, "found_recall": 0.5}
        for arm in ("mempo_default", "mempo_variant"):
            evals[f"{arm}_s{seed}"] = {"all_parts_em": 0.2 + gap, "found_recall": 0.5 + recall_gap}
    return evals


@pytest.mark.parametrize(
    "gaps, recall_gap, outcome",
    [
        ([0.10, 0.12], 0.15, "win"),  # both margins met in both seeds, at the edge
        ([0.10, 0.09], 0.20, "inconclusive"),  # one seed short of the EM margin
        ([0.12, 0.12], 0.14, "inconclusive"),  # recall short
        ([0.05, -0.05], 0.0, "null"),  # within the band in both seeds, at the edge
        ([0.05, -0.06], 0.0, "inconclusive"),
    ],
)
def test_verdict_by_hand(gaps, recall_gap, outcome):
    v = verdict(_evals(gaps, recall_gap), [0, 1])
    assert v["mempo_variant"]["outcome"] == outcome
    assert v["mempo_default"]["gaps"][1]["all_parts_em"] == pytest.approx(gaps[1])


def test_verdict_refuses_an_unfit_warm_start_and_a_missing_run():
    unfit = _evals([0.2, 0.2], warm={"format_valid": 0.9, "searched_k": RULE["warm_min_searched_k"] - 0.01})
    assert verdict(unfit, [0, 1])["mempo_variant"]["outcome"] == "unfit"
    missing = _evals([0.2, 0.2])
    del missing["mempo_variant_s1"]
    assert verdict(missing, [0, 1])["mempo_variant"]["outcome"] == "missing"


@pytest.mark.slow
def test_compare_stage_dry_run(tmp_path):
    """`scripts/gpu_long_horizon.sh compare-dry-run`: the gated warm start with an RL split, one step of every arm,
    the warm start and every run evaluated, the verdict, collected as the GPU call collects them."""
    script = LAB.parent / "scripts" / "gpu_long_horizon.sh"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "LIMIT_S": "3000"}  # a slow CPU
    done = subprocess.run(
        ["bash", str(script), "compare-dry-run", str(tmp_path)], capture_output=True, text=True, env=env, timeout=1800
    )
    assert done.returncode == 0 and "exit" not in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "collected").iterdir()) == ["gate.json", "rl_compare.json"]
    summary = json.loads((tmp_path / "collected" / "rl_compare.json").read_text())
    assert set(summary["evaluation"]) == {"warm", "outcome_only_s0", "mempo_default_s0", "mempo_variant_s0"}
    for metrics in summary["evaluation"].values():
        assert {"all_parts_em", "share_em", "found_recall", "searches", "tokens"} <= set(metrics)
    assert set(summary["verdict"]) == {"mempo_default", "mempo_variant"}
    assert summary["arms"]["mempo_variant"] == {"memory_reward_type": "diff", "memory_threshold": None}
    assert [s["step"] for s in summary["training"]["outcome_only_s0"]["steps"]] == [1]
    config = json.loads((tmp_path / "compare" / "mempo_variant.yaml").read_text())
    assert config["memory_threshold"] is None
