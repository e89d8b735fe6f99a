"""`scripts/gpu_smoke.sh --cpu`: the GPU smoke's dry run, so that the script a lent GPU runs does not rot.

The stages run as on a GPU but in fp32 on the CPU; ``qwen`` (a 151,936-row vocabulary in fp32, ~2 min here) and
``quickstart`` (`test_train_cli.py` trains the same recipe) are left to the GPU run.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


def _env(stages: str) -> dict:
    """The script calls ``python``: make it this interpreter."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return {**os.environ, "PATH": path, "GPU_SMOKE_STAGES": stages, "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_gpu_smoke_dry_run_passes_every_stage(tmp_path):
    stages = ["retriever", "model", "scoring", "lora", "vllm_emulation", "zero3"]
    env = _env(" ".join(stages))
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_smoke.sh"), "--cpu", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0, (report, result.stderr[-2000:])
    assert report["result"] == "PASS"
    assert [s["stage"] for s in report["stages"]] == stages and all(s["ok"] for s in report["stages"])
    by_stage = {s["stage"]: s for s in report["stages"]}
    assert by_stage["retriever"]["bm25s_started_jax"] is False
    scoring = by_stage["scoring"]
    assert scoring["items"] == 24 and scoring["max_abs_logp_diff"] < 1e-4  # fp32: the two schemes agree closely
    assert by_stage["lora"]["lora_b_max_abs"] > 0  # LoRA trained through the checkpointed forward
    assert by_stage["vllm_emulation"]["weight_syncs"] == 2


def test_gpu_smoke_rejects_an_unknown_stage(tmp_path):
    env = _env("retriever nonsense")
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_smoke.sh"), "--cpu", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode != 0
    assert "unknown stage nonsense" in result.stderr


@pytest.mark.slow
def test_realsize_stage_dry_run_reports_memory_and_the_step_split(tmp_path):
    """The real-size stage on the CPU with the dry-run shape (Qwen2.5's vocabulary, a tiny body): LoRA and full."""
    env = _env("realsize")
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_smoke.sh"), "--cpu", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0 and report["result"] == "PASS", (report, result.stderr[-2000:])
    (stage,) = report["stages"]
    assert [c["config"] for c in stage["configs"]] == ["dry-run:lora:2", "dry-run:full:2"]
    for config in stage["configs"]:
        assert config["ok"] and len(config["warm_steps_s"]) == 1 and config["generate_round_s"] > 0
        parts = ("memory_scoring_s", "loss_fwd_bwd_s", "optimizer_s", "other_preparation_s")
        assert all(config[p] >= 0 for p in parts) and config["memory_scoring_s"] > 0
        assert sum(config[p] for p in parts) == pytest.approx(config["step_s"], rel=0.05, abs=0.05)
        assert 0 < config["memory_scoring_share"] < 1


def test_realsize_budgets_cover_every_gpu_configuration():
    import gpu_smoke

    for config in gpu_smoke.REALSIZE_GPU.split():
        shape, mode, rounds = config.split(":")
        assert (shape, mode) in gpu_smoke.REALSIZE_BUDGET_GIB and rounds in ("4", "8")
