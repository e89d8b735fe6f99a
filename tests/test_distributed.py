"""Multi-process runs on CPU (gloo): the memory pool of a question split over two processes, refill, and the
per-token advantages the loss gets."""

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port, scripted_p_mem, worker_env


WORKER = Path(__file__).parent / "scripts" / "pooling_worker.py"
REFILL_WORKER = Path(__file__).parent / "scripts" / "dynamic_sampling_worker.py"
PERTURN_WORKER = Path(__file__).parent / "scripts" / "perturn_worker.py"
P_FULL = 0.5
"""The P_full of every round `PERTURN_WORKER` scores."""


def _run(cmd: list[str], tmp_path: Path) -> None:
    result = subprocess.run(cmd, cwd=tmp_path, env=worker_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_memory_pool_split_over_two_processes_matches_one_process(tiny_model_dir, tmp_path):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    _run([sys.executable, str(WORKER), str(tiny_model_dir), str(one)], tmp_path)
    port = str(free_port())  # for the rendezvous
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    _run([*torchrun, str(WORKER), str(tiny_model_dir), str(two)], tmp_path)
    single, split = json.loads(one.read_text()), json.loads(two.read_text())
    assert (single["world"], split["world"]) == (1, 2)
    # Trajectories 0-1 ran on process 0 and 2-3 on process 1; their 9 rows carry identical per-token advantages.
    assert len(split["rows"]) == 9
    assert split["rows"] == single["rows"]
    # The two processes' episodes end at different rounds (5 and 4 real rows), yet both pass the same row count.
    assert len(split["row_counts"]) == 2 and len(set(split["row_counts"])) == 1
    # The memory advantage really is there: the <mem> tokens of round 2 differ from the rest of the row.
    assert any(len(set(row)) > 1 for row in split["rows"])


@pytest.mark.slow
@pytest.mark.distributed
def test_refill_over_two_processes_replaces_a_group_split_between_them(tiny_model_dir, tmp_path):
    out = tmp_path / "two.json"
    port = str(free_port())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    _run([*torchrun, str(REFILL_WORKER), str(tiny_model_dir), str(out)], tmp_path)
    result = json.loads(out.read_text())
    assert result["world"] == 2
    # Dead1 (rows 2-3, one on each process) became the same fresh prompt on both; every pair is informative.
    assert [row["question"] for row in result["rows"]] == ["Live1", "Live1", "Live3", "Live3", "Live2", "Live2"]
    live = round(0.5 / (0.5**0.5 + 1e-4), 4)
    assert [row["advantage"] for row in result["rows"]] == [live, -live, live, -live, -live, live]
    assert all(row["tokens"] > 0 for row in result["rows"])
    assert result["metrics"]["dynamic_sampling/groups_refilled"] == 1.0
    assert result["metrics"]["dynamic_sampling/groups_dropped"] == 0.0


def _hand_advantages(tokenizer, ranks: list[dict], num_generations: int = 4) -> dict[tuple, list[float]]:
    """Each trained row's per-token advantage, by hand from the rollout's records (``ranks``: each process's
    episodes and rows, after refill): GRPO's ``(r - mean) / (std + 1e-4)`` of the trajectory's exact-match reward on
    every completion token, plus its round's memory advantage (P_mem - P_full, normalised over the rounds >= 2 of its
    question's G trajectories) on exactly the tokens of its ``<mem>...</mem>``. Keyed by (prompt, completion) ids."""
    episodes = [(r["rank"], e, ep) for r in ranks for e, ep in enumerate(r["episodes"])]
    index = {(rank, e): g for g, (rank, e, _) in enumerate(episodes)}
    rewards = [float(re.search(r"<answer>(.*)</answer>", ep["turns"][-1]).group(1) == "Paris") for *_, ep in episodes]
    outcome = []
    for g in range(0, len(rewards), num_generations):
        group = rewards[g : g + num_generations]
        outcome += [(r - statistics.mean(group)) / (statistics.stdev(group) + 1e-4) for r in group]
    trained = [
        (index[(r["rank"], row["episode"])], row)
        for r in ranks
        for row in r["rows"]
        if not r["dropped"][row["episode"]]
    ]
    memory, pools = {}, {}  # each scored round's memory reward (by row), each question's pool of them
    for g, row in trained:
        if row["round"] > 0:
            text = re.match(r"<mem>(.*?)</mem>", tokenizer.decode(row["completion"])).group(1)
            memory[id(row)] = scripted_p_mem(text) - P_FULL
            pools.setdefault(g // num_generations, []).append(memory[id(row)])
    expected = {}
    for g, row in trained:
        ids = row["completion"]
        values = [outcome[g]] * len(ids)
        if row["round"] > 0:
            pool = pools[g // num_generations]
            mean, std = (statistics.mean(pool), statistics.stdev(pool)) if len(pool) > 1 else (0.0, 1.0)
            end = next(k for k in range(len(ids)) if tokenizer.decode(ids[: k + 1]).endswith("</mem>"))
            values = [v + (memory[id(row)] - mean) / (std + 1e-6) if k <= end else v for k, v in enumerate(values)]
        expected[(tuple(row["prompt"]), tuple(ids))] = values
    return expected


@pytest.mark.slow
@pytest.mark.distributed
def test_every_trained_token_carries_its_own_trajectorys_advantage(tiny_model_dir, tmp_path):
    """Per-turn training, checked where it goes wrong at scale (SkyRL#1507: per-turn rows given their advantage at
    the wrong token positions): one real optimizer step over two processes, with refill, a group split between the
    processes and TRL's shuffle and split into micro-batches. Every row the loss gets is matched to its round by its
    token ids, and every token of it must carry exactly the hand-computed advantage."""
    from mempo_trl.loading import load_tokenizer

    port = str(free_port())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    result = subprocess.run(
        [*torchrun, str(PERTURN_WORKER), str(tiny_model_dir), str(tmp_path)],
        cwd=tmp_path,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    metrics = ranks[0]["metrics"]
    assert metrics["dynamic_sampling/groups_refilled"] >= 1 and metrics["dynamic_sampling/groups_dropped"] == 0
    # The rollout's rounds: several per trajectory, the middle group's four split 2 + 2 over the processes.
    questions = [[ep["question"] for ep in r["episodes"]] for r in ranks]
    assert len(set(questions[0][4:] + questions[1][:2])) == 1
    assert {len(ep["turns"]) for r in ranks for ep in r["episodes"]} == {1, 2, 3}

    expected = _hand_advantages(load_tokenizer(tiny_model_dir), ranks)
    seen = []
    for row in (row for r in ranks for row in r["loss_rows"]):
        length = int(sum(row["mask"]))
        if length == 0:  # a placeholder row (processes hand the loss the same number of rows)
            assert not any(row["advantages"]), row
            continue
        key = (tuple(row["prompt"]), tuple(row["completion"][:length]))
        assert key in expected, "the loss got a row that is no round of the rollout"
        assert row["mask"] == [1] * length + [0] * (len(row["mask"]) - length)
        want = expected[key] + [0.0] * (len(row["advantages"]) - length)
        assert row["advantages"] == pytest.approx(want, abs=1e-5), key
        seen.append(key)
    assert sorted(seen) == sorted(expected)  # every trained round reached the loss, once
    assert all(any(v != 0 for v in values) for values in expected.values())
