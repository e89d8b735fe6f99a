"""Multi-process runs on CPU (gloo): the memory pool of a question split over two processes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port, worker_env


WORKER = Path(__file__).parent / "scripts" / "pooling_worker.py"
REFILL_WORKER = Path(__file__).parent / "scripts" / "dynamic_sampling_worker.py"


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
