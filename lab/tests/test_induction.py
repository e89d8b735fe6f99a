"""Induction pretraining (`lab/induction_pretraining.py`): the copy examples, and the stage that trains on them; and
its experiment, `lab/induction.py`.

Run: `pytest lab/tests/test_induction.py`
"""

import doctest
import json
import random
import shutil

import induction
import induction_pretraining
from induction_pretraining import INDUCTION_FILE, copy_batch, induction_pretrain
from safetensors.torch import load_file


def test_doctests():
    assert doctest.testmod(induction_pretraining).failed == 0


def test_copy_batch_labels_only_the_repeat_and_moves_it():
    """Each label is the token the repeat copies from the first occurrence, and the distance between the two varies,
    so no fixed offset (a position-only attention head) can lower the loss: only copying can."""
    tokens = list(range(100, 1100))
    ids, labels = copy_batch(random.Random(0), tokens, batch_size=200, max_length=30)
    offsets = set()
    for x, y in zip(ids, labels):
        assert len(x) == len(y) == 61
        labelled = [i for i, label in enumerate(y) if label != -100]
        assert labelled and labelled == list(range(labelled[0], labelled[-1] + 1))
        assert all(y[i] == x[i] for i in labelled)  # the label is the token at that position (shifted by the model)
        n = len(labelled) + 1  # the repeat's first token is not labelled: nothing before it says where it starts
        start = labelled[0] - 1
        offset = next(d for d in range(1, start + 1) if x[start - d : start - d + n] == x[start : start + n])
        offsets.add(offset)
        assert all(t in tokens for t in x)
    assert len(offsets) > 20


def test_induction_pretrain_trains_the_model_in_place_and_records_it(tiny_model_dir, tmp_path):
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "model")
    before = load_file(model_dir / "model.safetensors")
    stats = induction_pretrain(model_dir, steps=3, batch_size=2, max_length=8)
    after = load_file(model_dir / "model.safetensors")
    assert any(not before[k].equal(after[k]) for k in before)
    record = json.loads((model_dir / INDUCTION_FILE).read_text())
    assert record["stats"] == stats and stats["steps"] == 3 and record["settings"]["max_length"] == 8
    assert 0.0 < stats["final_loss"] < 20.0
    # Seeded: the same call on the same weights gives the same model.
    again = shutil.copytree(tiny_model_dir, tmp_path / "again")
    induction_pretrain(again, steps=3, batch_size=2, max_length=8)
    assert all(load_file(again / "model.safetensors")[k].equal(after[k]) for k in after)


def test_induction_pretrain_refuses_zero_steps(tiny_model_dir):
    import pytest

    with pytest.raises(ValueError, match="steps >= 1"):
        induction_pretrain(tiny_model_dir, steps=0)


def test_induction_bench_runs_both_arms_and_leaves_the_committed_result_alone(tmp_path, capsys):
    """`lab/induction.py --quick`: both arms trained and evaluated, the summary where ``--out`` says with its
    command and machine; without ``--out``, ``--quick`` refuses to overwrite the committed result."""
    bench = induction
    assert bench.main(["--quick"]) == 2
    assert "error: --quick would overwrite lab/results/induction.json" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("")
    assert bench.main(["--quick", "--out", str(tmp_path / "a_file" / "induction.json")]) == 2  # before any work
    assert "error: output directory" in capsys.readouterr().err
    assert bench.main(["--quick", "--out", str(tmp_path / "induction.json")]) == 0
    result = json.loads((tmp_path / "induction.json").read_text())
    assert sorted(result["arms"]) == ["from_scratch", "induction"] and result["command"].endswith("--quick")
    assert result["induction"]["steps"] == 3 and [p["step"] for p in result["arms"]["induction"]["curve"]] == [0, 3]
    assert 0.0 <= result["arms"]["from_scratch"]["final_accuracy"] <= 1.0 and "machine" in result
    assert doctest.testmod(bench).failed == 0
