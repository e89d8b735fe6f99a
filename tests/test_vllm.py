"""TRL's vLLM generation (server mode, colocate with tensor parallelism) on a fake engine, over two CPU processes.

`tests/fake_vllm.py` replaces only what TRL imports from vLLM; TRL's `VLLMGeneration` (gather, broadcast, slice by
position, `extract_logprobs`, weight sync) runs as on a GPU box. The fake engine's turns name their episode and round,
and its log-probs are those of a synced copy of the model, so misrouted completions or misaligned rows show.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import fake_vllm
import pytest
from datasets import Dataset
from fake_vllm import end_round, turn_text
from helpers import cpu_config, free_port, worker_env

from mempo_trl import MemPOTrainer
from mempo_trl.kit.tiny import load_tiny
from mempo_trl.retrieval import Passage


WORKER = Path(__file__).parent / "scripts" / "vllm_worker.py"


def _torchrun(mode: str, model_dir: Path, out: Path, nproc: int = 2) -> list[dict]:
    port = str(free_port())  # for the rendezvous
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", port]
    result = subprocess.run(
        [*cmd, str(WORKER), mode, str(model_dir), str(out)],
        cwd=out,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def _check_episodes(ranks: list[dict]) -> None:
    """Every episode got its own turn in every round and ran to its scripted end."""
    episodes = [ep for r in ranks for ep in r["episodes"]]
    assert len(episodes) == 8  # 2 steps x 2 questions x G = 2
    for ep in episodes:
        k = int(ep["question"][1])
        expected = [f"<mem>q{k} r{t}</mem>" for t in range(1, end_round(k) + 1)]
        assert [turn[: len(e)] for turn, e in zip(ep["turns"], expected)] == expected, ep
        assert len(ep["turns"]) == end_round(k)
    # The processes really sent different numbers of prompts in some round (what the padding is for).
    per_rank_rounds = [[sum(1 for ep in r["episodes"][:2] if len(ep["turns"]) > t) for t in range(4)] for r in ranks]
    assert per_rank_rounds[0] != per_rank_rounds[1]


def _check_sampling_metrics(log_history: list[dict]) -> None:
    """TRL's IS diagnostics are logged, finite (NaN log-probs skipped) and show aligned rows (ratio 1)."""
    steps = [entry for entry in log_history if "loss" in entry]
    assert len(steps) == 2
    for entry in steps:
        for name in ("min", "mean", "max"):
            assert entry[f"sampling/importance_sampling_ratio/{name}"] == pytest.approx(1.0, abs=1e-4)
        assert 0.0 <= entry["sampling/sampling_logp_difference/max"] < 1e-4
        assert math.isfinite(entry["loss"])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["server", "colocate_tp"])
def test_vllm_hands_every_process_its_own_completions(tiny_model_dir, tmp_path, mode):
    ranks = _torchrun(mode, tiny_model_dir, tmp_path)
    _check_episodes(ranks)
    _check_sampling_metrics(ranks[0]["log_history"])
    engines = [r["engine"] for r in ranks if r["engine"] is not None]
    assert engines and all(e["syncs"] == 2 for e in engines)  # one weight sync per step, before round 1
    # Every generate call got the same number of prompts from both processes (padded), 2 + 2 at most.
    assert all(n == 4 for e in engines for n in e["prompts"])


def test_sleep_mode_keeps_vllm_awake_across_the_rounds_of_a_step(tiny_model_dir, tmp_path, monkeypatch):
    for name, value in fake_vllm.colocate_env().items():
        monkeypatch.setenv(name, value)  # TRL's colocate init writes these; monkeypatch restores them
    fake_vllm.install(tiny_model_dir)
    model, tokenizer = load_tiny(tiny_model_dir)
    args = cpu_config(
        tmp_path,
        per_device_train_batch_size=2,
        max_turns=4,
        max_steps=2,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_enable_sleep_mode=True,
        disable_tqdm=True,
    )
    dataset = Dataset.from_list([{"question": "Q3 where?", "golden_answers": ["A3"]}])  # 4 rounds per episode

    class Retriever:
        def search(self, queries, topk):
            return [[Passage(id=q, title=q, text="x")] for q in queries]

    trainer = MemPOTrainer(model, Retriever(), args=args, train_dataset=dataset, processing_class=tokenizer)
    chunks = []  # (rows, rows per forward) of the old log-prob forwards
    logps = trainer._get_per_token_logps_and_entropies

    def recording_logps(model, input_ids, *args, batch_size=None, **kwargs):
        chunks.append((input_ids.size(0), batch_size))
        return logps(model, input_ids, *args, batch_size=batch_size, **kwargs)

    trainer._get_per_token_logps_and_entropies = recording_logps
    trainer.train()
    assert chunks[0] == (8, 8)  # one forward for the step's 2 x 4 rows (steps_per_generation = 1)
    counters = fake_vllm.engine_of(trainer).counters
    assert counters.generate_calls == 2 * 4
    assert counters.syncs == 2  # one per step (TRL alone: one per round)
    assert counters.sleeps == 1 + 2  # at start-up, then after each step's rollout
    assert trainer.vllm_generation.enable_sleep_mode and trainer.vllm_generation._llm_weights_sleeping


def test_the_share_of_each_rounds_tokens_masked_by_truncation_or_the_is_cap_is_logged(
    tiny_model_dir, tmp_path, monkeypatch
):
    """One real training step on the fake engine, TRL's per-token IS mask (`token_mask`, cap 3) and
    `mask_truncated_completions`: in round 2 the engine's log-probs of the first two tokens are 2 below the trainer's
    (ratio e^2 > 3: masked), round 3's turn is cut before its closing tag (truncated: all masked). Logged per round and
    overall, as shares of the round's completion tokens, computed here from the turns' token counts."""
    for name, value in fake_vllm.colocate_env().items():
        monkeypatch.setenv(name, value)
    fake_vllm.install(tiny_model_dir)
    complete = fake_vllm.Engine.complete

    def skewed_complete(self, prompt_ids):
        ids, logps, key = complete(self, prompt_ids)
        if key is not None and key[1] == 2:
            logps = [lp - 2.0 for lp in logps[:2]] + logps[2:]
        if key is not None and key[1] == 3:  # cut before the closing tag: the turn hit its length budget
            ids = self.tokenizer(turn_text(*key).rsplit("</", 1)[0], add_special_tokens=False)["input_ids"]
            logps = logps[: len(ids)]
        return ids, logps, key

    monkeypatch.setattr(fake_vllm.Engine, "complete", skewed_complete)
    model, tokenizer = load_tiny(tiny_model_dir)
    args = cpu_config(
        tmp_path,
        per_device_train_batch_size=2,
        max_turns=4,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_importance_sampling_mode="token_mask",
        mask_truncated_completions=True,
        disable_tqdm=True,
    )
    dataset = Dataset.from_list([{"question": "Q3 where?", "golden_answers": ["A3"]}])  # answers in round 4

    class Retriever:
        def search(self, queries, topk):
            return [[Passage(id=q, title=q, text="x")] for q in queries]

    trainer = MemPOTrainer(model, Retriever(), args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    logged = trainer.state.log_history[0]
    lengths = [len(tokenizer(turn_text(3, t), add_special_tokens=False)["input_ids"]) for t in (1, 2)]
    lengths.append(len(tokenizer(turn_text(3, 3).rsplit("</", 1)[0], add_special_tokens=False)["input_ids"]))
    assert logged["tokens/masked_share/round_1"] == 0.0
    assert logged["tokens/masked_share/round_2"] == pytest.approx(2 / lengths[1])
    assert logged["tokens/masked_share/round_3"] == 1.0
    assert "tokens/masked_share/round_4" not in logged  # the truncated turn ended the episodes
    assert logged["tokens/masked_share"] == pytest.approx((2 + lengths[2]) / sum(lengths))
