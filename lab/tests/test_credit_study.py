"""The credit study (`lab/credit_study.py`): its figures of merit by hand, and its command end to end."""

import doctest
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import credit_study
import pytest
from credit_study import group_advantages, variant_settings


LAB = Path(__file__).resolve().parents[1]


def test_doctests():
    assert doctest.testmod(credit_study).failed == 0


def _group(mem_probs, full_prob, outcomes=None):
    """A group of one-token answers: each memory's gold probability after it, the same P_full for all."""
    n = len(mem_probs)
    return {
        "mem_logps": [[math.log(p)] for p in mem_probs],
        "full_logps": [[math.log(full_prob)]] * n,
        "outcomes": outcomes or [0.0] * n,
    }


@pytest.mark.parametrize(
    "variant, rewards, advantages",
    [
        # P_mem - P_full = 0.8 - 0.6, 0.4 - 0.6, 0.3 - 0.6; pooled: mean -0.1, std sqrt(0.07)
        ("diff", [0.2, -0.2, -0.3], [0.3 / math.sqrt(0.07), -0.1 / math.sqrt(0.07), -0.2 / math.sqrt(0.07)]),
        # the filter keeps p > 0.5: P_mem 0.8, 0, 0; rewards 0.2, -0.6, -0.6; mean -1/3, std sqrt(0.64/3)
        ("diff_filter", [0.2, -0.6, -0.6], [2 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)]),
        # the median of the log-probs 0.8, 0.4, 0.3, 0.6, 0.6, 0.6 is log 0.6: only 0.8 is kept, P_full is 0
        ("diff_quantile", [0.8, 0.0, 0.0], [2 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)]),
        # log(P + 1e-6) differences, no filter
        ("log_ratio", [math.log(0.8 / 0.6), math.log(0.4 / 0.6), math.log(0.3 / 0.6)], None),
    ],
)
def test_group_advantages_by_hand(variant, rewards, advantages):
    got_rewards, got_advantages = group_advantages(_group([0.8, 0.4, 0.3], 0.6), variant_settings(variant, 0.5))
    assert got_rewards == pytest.approx(rewards, abs=1e-5)
    if advantages is not None:
        assert got_advantages == pytest.approx(advantages, abs=1e-4)
    else:  # pooled: zero mean, unit std, the order of the rewards
        assert sum(got_advantages) == pytest.approx(0.0, abs=1e-5)
        assert got_advantages[0] > got_advantages[1] > got_advantages[2]


@pytest.mark.parametrize("variant", ["diff_weakest", "log_ratio_weakest"])
def test_the_weakest_part_variants_by_hand(variant):
    """Two-part golds (one token a part), P_full 0.8 on both: memory A holds part 1 (0.9) but lost part 2 (0.2),
    memory B is unsure of both (0.5): the weakest part scores A by part 2 (0.2 - 0.8 = -0.6, below B's -0.3), where
    the joint mean puts A at sqrt(0.9 x 0.2) - 0.8 = -0.376."""
    group = {
        "mem_logps": [[math.log(0.9), math.log(0.2)], [math.log(0.5), math.log(0.5)]],
        "full_logps": [[math.log(0.8), math.log(0.8)]] * 2,
        "outcomes": [0.0, 0.0],
    }
    rewards, _ = group_advantages(group, variant_settings(variant, 0.5), parts=[1, 2])
    if variant == "diff_weakest":
        assert rewards == pytest.approx([0.2 - 0.8, 0.5 - 0.8], abs=1e-6)
    else:
        eps = 1e-6
        assert rewards == pytest.approx([math.log((0.2 + eps) / (0.8 + eps)), math.log((0.5 + eps) / (0.8 + eps))])
    joint, _ = group_advantages(group, variant_settings("diff", 0.5), parts=[1, 2])
    assert joint[0] == pytest.approx(math.sqrt(0.9 * 0.2) - 0.8, abs=1e-6)


def test_the_losses_variant_by_hand():
    """Two-part golds, P_full 0.8 on both: A lost part 2 (0.9 / 0.2), B lost both (0.2 / 0.2), C kept both (0.9 /
    0.9). Rewards (0 - 0.6) / 2, (-0.6 - 0.6) / 2 and the joint 0.9 - 0.8; uncentred and divided by the pool's std,
    the advantages keep those signs and that order (the weakest part would tie A and B at -0.6)."""
    group = {
        "mem_logps": [[math.log(a), math.log(b)] for a, b in ((0.9, 0.2), (0.2, 0.2), (0.9, 0.9))],
        "full_logps": [[math.log(0.8), math.log(0.8)]] * 3,
        "outcomes": [0.0] * 3,
    }
    rewards, advantages = group_advantages(group, variant_settings("diff_losses_uncentred", 0.5), parts=[1, 2])
    assert rewards == pytest.approx([-0.3, -0.6, 0.1], abs=1e-6)
    std = statistics.stdev([-0.3, -0.6, 0.1])
    assert advantages == pytest.approx([r / std for r in rewards], abs=1e-4)
    weakest, _ = group_advantages(group, variant_settings("diff_weakest_uncentred", 0.5), parts=[1, 2])
    assert weakest[:2] == pytest.approx([-0.6, -0.6], abs=1e-6)


def test_gold_token_parts_align_with_the_cached_gold_logps(smollm2_tokenizer):
    row = {"golden_answers": [], "sub_answers": [["Ulm"], ["Max Planck"]]}
    parts = credit_study.gold_token_parts(smollm2_tokenizer, row)
    from mempo_trl.context import gold_answer_tokens

    ids, mask = gold_answer_tokens(smollm2_tokenizer, [], row["sub_answers"])
    assert len(parts) == sum(mask) and set(parts) == {0, 1, 2}  # the "; " between them is in no part
    gold = [i for i, m in zip(ids, mask) if m]
    assert smollm2_tokenizer.decode([i for i, p in zip(gold, parts) if p == 2]).strip() == "Max Planck"


def test_memory_advantage_ignores_the_outcomes():
    """The memory advantage of a group is its pooled memory reward whatever the outcomes (all equal or not)."""
    settings = variant_settings("diff", 0.5)
    _, equal = group_advantages(_group([0.8, 0.4, 0.3], 0.6, [1.0, 1.0, 1.0]), settings)
    _, mixed = group_advantages(_group([0.8, 0.4, 0.3], 0.6, [1.0, 0.0, 0.5]), settings)
    assert equal == pytest.approx(mixed)


def test_pool_figures_of_a_group():
    # three memories of a K = 2 question: all facts, one, none; the one-fact memory gets a positive advantage
    figures = credit_study.pool_figures([0.5, 0.7, -1.2], [0.1, 0.2, -0.3], [2, 1, 0], 2)
    expected = {"auc_wins": 2.0, "auc_pairs": 3, "sign_correct": 2, "sign_n": 3, "incomplete": 2, "fp": 1}
    assert figures == {**expected, "fp_reward": 1}


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path, monkeypatch, capsys):
    """`--quick` through the GPU script's CPU dry run (`scripts/gpu_long_horizon.sh credit-dry-run`): every phase,
    the summary of both K and every variant in the run directory (not in lab/results), collected as the GPU call
    collects it; the outcome link on that run (`_outcome_link_of`); a rebuild that differs from the summary it is
    checked against (``--expect``) is one error line; then a gate the warm start fails stops with one error line."""
    out = tmp_path / "credit"
    script = LAB.parent / "scripts" / "gpu_long_horizon.sh"
    env = {**os.environ, "PYTHON": sys.executable, "LIMIT_S": "3000"}  # a loaded CPU takes over 500 s
    finished = subprocess.run(
        ["bash", str(script), "credit-dry-run", str(out)], capture_output=True, text=True, env=env, timeout=1200
    )
    assert finished.returncode == 0 and "exit" not in finished.stdout, finished.stdout + finished.stderr[-3000:]
    collected = sorted(path.name for path in (out / "collected").iterdir())
    assert collected == ["credit_study.json", "credit_study.png", "gate.json", "phases.json", "rl_smoke.json"]
    smoke = json.loads((out / "collected" / "rl_smoke.json").read_text())
    assert sorted(smoke["arms"]) == ["mempo", "outcome_only_dynamic"]
    for arm in smoke["arms"].values():
        assert [step["step"] for step in arm["steps"]] == [1] and arm["steps"][0]["seconds"] > 0
        assert arm["heldout"]["step_before"] == 0 and arm["heldout"]["step_after"] == 1
        assert {"em_before", "em_after", "memory_recall_before", "memory_recall_after"} <= set(arm["heldout"])
    assert smoke["arms"]["outcome_only_dynamic"]["steps"][0]["refill_rounds"] is not None
    summary = json.loads((out / "credit_study.json").read_text())
    assert (out / "credit_study.png").is_file()
    assert set(summary["figures"]) == {"2", "4"}
    for cell in summary["figures"].values():
        assert set(cell["variants"]) == set(credit_study.VARIANTS)
        assert cell["variants"]["diff"]["scripted"]["auc"]["value"] is not None
    assert set(summary["seconds"]) >= {"warm_start", "gate", "scored"}
    assert summary["command"].startswith("python lab/credit_study.py --quick --device cpu")
    assert all(len(sha) == 64 for sha in summary["artifacts"].values())  # the groups' and the adapter's sha256
    _outcome_link_of(out)
    (tmp_path / "expected.json").write_text(json.dumps({**summary, "figures": {}}))
    assert credit_study.main(["--quick", "--out", str(out), "--expect", str(tmp_path / "expected.json")]) == 1
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert line == f"error: the rebuild differs from {tmp_path / 'expected.json'} in figures"
    monkeypatch.setitem(credit_study.QUICK, "gate", {**credit_study.QUICK["gate"], "min_format_valid": 1.0})
    monkeypatch.chdir(LAB.parent)
    assert credit_study.main(["--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "format-valid >= 1.0" in lines[0], err
    # the warm start, its gate and its groups are keyed by its digest: a gate of another warm start is played again
    digest = credit_study.warm_digest(credit_study.merged(credit_study.STUDY, credit_study.QUICK))
    assert (out / f"warm_{digest}" / "warm_done.json").is_file() and (out / f"groups_{digest}.jsonl").is_file()
    gate = json.loads((out / "gate.json").read_text())
    assert gate["warm_digest"] == digest
    (out / "gate.json").write_text(json.dumps({**gate, "warm_digest": "0" * 12, "by_k": {}}))
    assert credit_study.main(["--quick", "--out", str(out)]) == 2
    assert json.loads((out / "gate.json").read_text()) == gate


def _outcome_link_of(study_out):
    """`outcome_link.py --quick` on the quick study's run: every K and round from the first search's to the answer
    round, every variant; the answer round's memories are the credit study's own sampled memories, each finished."""
    import outcome_link

    out = study_out / "link"
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


def test_pairwise_auc_counts_a_tie_as_half():
    # memory 0 keeps 2 facts, memory 1 one, memory 2 none: pairs (0, 1) tied, (0, 2) and (1, 2) right
    assert credit_study.pairwise_auc([0.3, 0.3, -1.0], [2, 1, 0]) == (2.5, 3)


def test_an_unwritable_summary_folder_is_one_error_line_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(credit_study.os, "access", lambda path, mode: False)
    monkeypatch.setattr(credit_study, "write_world", lambda *a: pytest.fail("work started"))
    assert credit_study.main(["--quick", "--out", str(tmp_path / "credit")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert (
        line == f"error: cannot write the summary into {tmp_path / 'credit'}: make it writable or pass another --out"
    )
