"""`mempo_trl.grpo_mirror` against TRL itself: `GRPOTrainer` and `MemPOTrainer` prepare the same one-round batch.

Both trainers generate with TRL's own vLLM colocate path on the fake engine (`tests/fake_vllm.py`), whose log-probs are
shifted so that the importance-sampling ratio is not 1, with a reference model (``beta > 0``). Each question's episode
answers in round 1, so MemPO's rows are GRPO's completions, and everything the mirror reproduces must match: the
padded tensors, old / sampling / reference log-probs, the IS ratio, the outcome advantages, the logged metrics and
the completions table.
"""

import fake_vllm
import pytest
import torch
from datasets import Dataset

from mempo_trl import MemPOConfig, MemPOTrainer
from mempo_trl.context import initial_messages
from mempo_trl.kit.tiny import load_tiny
from mempo_trl.retrieval import Passage


LOGPROB_SHIFT = 0.02
QUESTIONS = ["Q0 where?", "Q4 when?"]  # `fake_vllm.end_round`: both answer in round 1


def alternating(completions, log_metric=None, log_extra=None, **kwargs):
    """Reward 0, 1, 0, 1, ... (a non-zero advantage in every group); logs a metric and a table column."""
    log_metric("alternating/calls", 1.0)
    log_extra("parity", [i % 2 for i in range(len(completions))])
    return [float(i % 2) for i in range(len(completions))]


class Retriever:
    def search(self, queries, topk):
        return [[Passage(id=q, title=q, text="x")] for q in queries]


def _config(cls, tmp_path, name):
    return cls(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=32,
        beta=0.1,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_importance_sampling_mode="token_truncate",
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )


def _prepare(trainer, rows):
    trainer.model.train()
    inputs = [dict(row) for row in rows for _ in range(2)]
    return trainer._generate_and_score_completions(inputs)


@pytest.fixture
def batches(tiny_model_dir, tmp_path, monkeypatch):
    from trl import GRPOConfig, GRPOTrainer

    for name, value in fake_vllm.colocate_env().items():
        monkeypatch.setenv(name, value)
    fake_vllm.install(tiny_model_dir)
    complete = fake_vllm.Engine.complete

    def shifted(self, prompt_ids):
        ids, logps, key = complete(self, prompt_ids)
        return ids, [lp + LOGPROB_SHIFT for lp in logps], key

    monkeypatch.setattr(fake_vllm.Engine, "complete", shifted)
    model, tokenizer = load_tiny(tiny_model_dir)
    mempo_rows = [{"question": q, "golden_answers": ["Ulm"]} for q in QUESTIONS]
    mempo = MemPOTrainer(
        model,
        Retriever(),
        reward_funcs=[alternating],
        args=_config(MemPOConfig, tmp_path, "mempo"),
        train_dataset=Dataset.from_list(mempo_rows),
        processing_class=tokenizer,
    )
    model, tokenizer = load_tiny(tiny_model_dir)
    grpo_rows = [{"prompt": initial_messages(q)} for q in QUESTIONS]
    grpo = GRPOTrainer(
        model,
        reward_funcs=[alternating],
        args=_config(GRPOConfig, tmp_path, "grpo"),
        train_dataset=Dataset.from_list(grpo_rows),
        processing_class=tokenizer,
    )
    torch.manual_seed(0)
    mempo_out = _prepare(mempo, mempo_rows)
    torch.manual_seed(0)
    grpo_out = _prepare(grpo, grpo_rows)
    return mempo, mempo_out, grpo, grpo_out


def test_the_mirror_prepares_what_grpo_prepares(batches):
    mempo, mempo_out, grpo, grpo_out = batches
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "num_items_in_batch"):
        assert torch.equal(mempo_out[key], grpo_out[key]), key
    for key in ("old_per_token_logps", "sampling_per_token_logps", "ref_per_token_logps", "importance_sampling_ratio"):
        assert key in grpo_out and key in mempo_out, key
        torch.testing.assert_close(mempo_out[key], grpo_out[key], rtol=1e-5, atol=1e-6, msg=key)
    mask = grpo_out["completion_mask"].bool()
    ratio = grpo_out["importance_sampling_ratio"][mask]
    assert torch.allclose(ratio, torch.full_like(ratio, torch.exp(torch.tensor(-LOGPROB_SHIFT))), atol=1e-4)
    # One round per episode: MemPO's per-token advantage is GRPO's completion advantage on every token.
    torch.testing.assert_close(mempo_out["advantages"], grpo_out["advantages"].unsqueeze(1).expand_as(mask).float())
    assert grpo_out["advantages"].abs().min() > 0.5


def test_the_mirror_logs_what_grpo_logs(batches):
    mempo, _, grpo, _ = batches
    ours, theirs = mempo._metrics["train"], grpo._metrics["train"]
    assert set(theirs) <= set(ours), sorted(set(theirs) - set(ours))
    # A MemPO turn that ends on its action tag is terminated; GRPO only knows eos, so these two count it apart.
    differ = {
        "completions/clipped_ratio",
        "completions/mean_terminated_length",
        "completions/min_terminated_length",
        "completions/max_terminated_length",
    }
    assert (
        "alternating/calls" in theirs
        and "frac_reward_zero_std" in theirs
        and "sampling/importance_sampling_ratio/mean" in theirs
    )
    for name in set(theirs) - differ:
        assert ours[name] == pytest.approx(theirs[name], rel=1e-5, abs=1e-6), name
    assert mempo._logs["rewards"] == grpo._logs["rewards"]
    assert mempo._logs["advantages"] == pytest.approx(grpo._logs["advantages"])
    assert mempo._logs["extra"] == grpo._logs["extra"]
    assert list(mempo._logs["prompt"]) == list(grpo._logs["prompt"])
