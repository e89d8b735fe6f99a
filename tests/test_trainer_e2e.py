"""Real MemPO training steps on the warm-started tiny model and the demo world (slow, run in CI)."""

import pytest
import torch
from helpers import cpu_config

from mempo_trl import MemPOTrainer
from mempo_trl.data import load_qa
from mempo_trl.kit.tiny import load_tiny
from mempo_trl.retrieval import BM25Retriever
from mempo_trl.rewards import mempo_format_reward, mempo_outcome_reward


@pytest.fixture(scope="module")
def demo_retriever(demo_paths, tmp_path_factory):
    return BM25Retriever.from_corpus(demo_paths.corpus, cache_dir=tmp_path_factory.mktemp("bm25"))


def _train(model_dir, demo_paths, retriever, tmp_path, peft_config=None, reward_funcs=None, **overrides):
    model, tokenizer = load_tiny(model_dir)
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    settings = dict(
        per_device_train_batch_size=8, num_generations=4, max_completion_length=40, learning_rate=5e-3, max_steps=2
    )
    args = cpu_config(tmp_path, **{**settings, **overrides})
    dataset = load_qa(str(demo_paths.train)).select(range(16))
    trainer = MemPOTrainer(
        model,
        retriever,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        reward_funcs=reward_funcs,
    )
    trainer.train()
    after = dict(trainer.model.named_parameters())
    return trainer, before, after


def _logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def _changed(before, after, names):
    return [n for n in names if not torch.equal(before[n], after[n].detach())]


@pytest.mark.slow
def test_mempo_steps_change_weights_and_score_memory(warm_model_dir, demo_paths, demo_retriever, tmp_path):
    trainer, before, after = _train(warm_model_dir, demo_paths, demo_retriever, tmp_path)
    assert _changed(before, after, before)  # the policy moved
    assert max(_logged(trainer, "memory/scored_rounds")) > 0  # rounds >= 2 wrote a <mem> that was scored
    assert max(_logged(trainer, "episode/format_valid")) > 0
    assert all(0.0 <= p <= 1.0 for p in _logged(trainer, "memory/p_mem") + _logged(trainer, "memory/p_full"))
    assert all(torch.isfinite(torch.tensor(_logged(trainer, "loss"))))
    # Each step accounts for itself: its tokens over its seconds, and its seconds split into the logged parts.
    steps, seen = [e for e in trainer.state.log_history if "step_time" in e], 0
    assert len(steps) == 2
    for entry in steps:
        tokens, seen = entry["num_tokens"] - seen, entry["num_tokens"]
        assert tokens > 0 and entry["tokens_per_second"] == pytest.approx(tokens / entry["step_time"])
        parts = [entry[f"time/{part}"] for part in ("generation", "retrieval", "memory_scoring", "other")]
        assert min(parts) > 0 and sum(parts) == pytest.approx(entry["step_time"])


@pytest.mark.slow
def test_lora_trains_only_the_adapter(warm_model_dir, demo_paths, demo_retriever, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer, _, after = _train(warm_model_dir, demo_paths, demo_retriever, tmp_path, peft_config=lora, beta=0.04)
    lora_b = [n for n in after if "lora_B" in n]
    # LoRA B starts at zero: any non-zero entry is a real update.
    assert lora_b and any(after[n].detach().abs().sum() > 0 for n in lora_b)
    assert _logged(trainer, "kl")  # beta > 0 with PEFT: the reference is the adapter-free model


@pytest.mark.slow
def test_reference_model_kl_and_memory_variants(warm_model_dir, demo_paths, demo_retriever, tmp_path):
    trainer, before, after = _train(
        warm_model_dir,
        demo_paths,
        demo_retriever,
        tmp_path,
        beta=0.04,
        memory_full_from_reference=True,
        memory_pooling="question_round",
        memory_scoring="shared_prefix",
        memory_threshold=None,
        memory_threshold_quantile=0.3,
        memory_reward_type="log_ratio",
    )
    assert trainer.ref_model is not None and _logged(trainer, "kl")
    assert _changed(before, after, before)


@pytest.mark.slow
def test_multiple_iterations_reuse_rollouts_with_old_logps(warm_model_dir, demo_paths, demo_retriever, tmp_path):
    trainer, before, after = _train(
        warm_model_dir,
        demo_paths,
        demo_retriever,
        tmp_path,
        num_iterations=2,
        steps_per_generation=2,
        max_steps=4,
        per_device_train_batch_size=4,
    )
    assert _changed(before, after, before)
    # 4 optimizer steps from ONE generation batch (2 slices x 2 iterations), with old log-probs for the ratio.
    assert len(_logged(trainer, "episode/turns")) == 1
    assert len(_logged(trainer, "loss")) == 4


@pytest.mark.slow
def test_full_history_baseline_trains_without_memory_scoring(warm_model_dir, demo_paths, demo_retriever, tmp_path):
    # No memory advantage here: the optional format reward gives the groups reward variance.
    trainer, before, after = _train(
        warm_model_dir,
        demo_paths,
        demo_retriever,
        tmp_path,
        context_mode="full_history",
        reward_funcs=[mempo_outcome_reward, mempo_format_reward],
    )
    assert _logged(trainer, "rewards/mempo_format_reward/mean")
    assert _changed(before, after, before)
    assert not _logged(trainer, "memory/reward")
    assert max(_logged(trainer, "memory/scored_rounds")) == 0


@pytest.mark.slow
def test_evaluate_logs_episode_and_memory_metrics(warm_model_dir, demo_paths, demo_retriever, tmp_path):
    model, tokenizer = load_tiny(warm_model_dir)
    args = cpu_config(
        tmp_path, num_generations=4, per_device_eval_batch_size=4, num_generations_eval=2, max_completion_length=40
    )
    trainer = MemPOTrainer(
        model,
        demo_retriever,
        args=args,
        train_dataset=load_qa(str(demo_paths.train)).select(range(4)),
        eval_dataset=load_qa(str(demo_paths.test)).select(range(4)),
        processing_class=tokenizer,
    )
    metrics = trainer.evaluate()
    for key in (
        "eval_loss",
        "eval_episode/em",
        "eval_episode/format_valid",
        "eval_episode/turns",
        "eval_tokens/prompt_per_round",
        "eval_time/generation",
    ):
        assert key in metrics, key
    assert 0.0 <= metrics["eval_episode/format_valid"] <= 1.0


def _longer(prompts, completions, trajectory, **kwargs):
    """A reward the tiny policy can reach without knowing any answer: the episode's length (100s of characters)."""
    return [sum(len(turn) for turn in turns) / 100 for turns in trajectory]


def _shorter(prompts, completions, trajectory, **kwargs):
    """The opposite reward."""
    return [-r for r in _longer(prompts, completions, trajectory)]


@pytest.mark.slow
def test_training_climbs_a_reward_the_policy_can_reach(warm_model_dir, demo_paths, demo_retriever, tmp_path):
    """The whole path (rollout, rewards, per-round rows, advantages, TRL's loss) moves the policy towards reward.

    Two policies train from the same warm start, one rewarded for long episodes and one for short ones; their
    episodes must end far apart in length (over the last 4 steps, 3.2 vs 0.6 hundred characters with AVX-512 kernels,
    2.9 vs 0.2 with AVX2 kernels and the AVX2 build of the warm start). A
    sign or alignment error anywhere makes the two move the wrong way, or not apart. A contrast of two runs on a
    continuous reward, not one run's climb on a 0/1 reward: 8 episodes a step gave a single run a spread of +/-0.2,
    and a warm start whose G episodes of a question all search alike (as the AVX2 build's does) gives a 0/1 reward
    no group variance, hence no gradient."""
    lengths = {}
    for reward in (_longer, _shorter):
        trainer, _, _ = _train(
            warm_model_dir,
            demo_paths,
            demo_retriever,
            tmp_path / reward.__name__,
            reward_funcs=[reward],
            max_steps=10,
            learning_rate=3e-3,
            max_turns=3,
            memory_coef=0.0,
        )
        rewards = _logged(trainer, "reward")
        print(reward.__name__, "reward per step:", [round(r, 2) for r in rewards])
        lengths[reward.__name__] = abs(sum(rewards[-4:]) / 4)
    assert lengths["_longer"] > 2 * lengths["_shorter"]
