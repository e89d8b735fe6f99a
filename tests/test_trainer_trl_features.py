"""What `GRPOTrainer` offers that `MemPOTrainer`'s override must keep, or refuse loudly.

- Reward functions' ``log_metric`` / ``log_extra`` values reach the logged metrics and the completions table, as in
  `GRPOTrainer` (whose flush sits in the `_generate_and_score_completions` that MemPO replaces).
- ``tools=`` is an error that names the alternative, never silently ignored.
"""

import pytest
from datasets import Dataset
from helpers import GOLDS, SCRIPT, EchoRetriever, cpu_config, play_script

from mempo_trl import MemPOConfig, MemPOTrainer
from mempo_trl.kit.tiny import load_tiny


def turns_reward(completions, trajectory, log_metric, log_extra, **kwargs):
    """Reward 1; logs the mean number of turns (a metric) and every trajectory's turns (a table column)."""
    turns = [len(t) for t in trajectory]
    log_metric("custom/turns", sum(turns) / len(turns))
    log_extra("turns", turns)
    return [1.0] * len(completions)


def make_trainer(model_dir, output_dir, monkeypatch):
    model, tokenizer = load_tiny(model_dir)
    args = cpu_config(output_dir)
    dataset = Dataset.from_list([{"question": q, "golden_answers": GOLDS[q]} for q in SCRIPT])
    trainer = MemPOTrainer(
        model,
        EchoRetriever(),
        reward_funcs=[turns_reward],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    play_script(trainer, tokenizer, monkeypatch)
    return trainer


def test_reward_function_metrics_and_columns_reach_the_logs(tiny_model_dir, tmp_path, monkeypatch):
    trainer = make_trainer(tiny_model_dir, tmp_path, monkeypatch)
    trainer.train()
    (step,) = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert step["custom/turns"] == pytest.approx((2 + 1 + 1 + 3) / 4)
    assert sorted(trainer._logs["extra"]["turns"]) == [1, 1, 2, 3]
    assert len(trainer._logs["extra"]["turns"]) == len(trainer._logs["prompt"])  # one value per table row
    assert not trainer._pending_metrics and not trainer._pending_extra_logs  # flushed, not piling up


def test_tools_are_refused_with_the_alternative(tiny_model_dir, tmp_path):
    model, tokenizer = load_tiny(tiny_model_dir)

    def search(query: str) -> str:
        """Search.

        Args:
            query: the query.
        """
        return query

    args = MemPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match=r"does not take `tools=`.*as an environment"):
        MemPOTrainer(model, EchoRetriever(), args=args, processing_class=tokenizer, tools=[search])


def test_a_trajectory_no_reward_function_scores_gets_advantage_zero(tiny_model_dir, tmp_path, monkeypatch):
    """As in GRPOTrainer: when every reward function returns None for a trajectory it is unscorable, so it is out of
    its group's baseline and its advantage is 0 (counted as reward 0, it would give its group-mate one)."""

    def turns_or_none(completions, trajectory, **kwargs):
        return [None if len(t) == 3 else float(len(t)) for t in trajectory]

    trainer = make_trainer(tiny_model_dir, tmp_path, monkeypatch)
    trainer.reward_funcs, trainer.reward_func_names = [turns_or_none], ["turns_or_none"]
    trainer.args.memory_coef = 0.0  # the outcome advantage alone
    trainer.model.train()
    inputs = [{"question": q, "golden_answers": GOLDS[q]} for q in SCRIPT for _ in range(2)]
    out = trainer._generate_and_score_completions(inputs)
    # Rows: Alpha 2 + 1 rounds (rewards 2, 1), Beta 1 + 3 rounds (rewards 1, None).
    a = 0.5 / (2**-0.5 + 1e-4)
    assert out["advantages"][:, 0].tolist() == pytest.approx([a, a, -a, 0.0, 0.0, 0.0, 0.0], abs=1e-5)


def test_checkpointing_is_off_for_no_grad_forwards_without_deprecation_warnings(tiny_model_dir):
    """`activation_checkpointing_off` (memory scoring, old log-probs) turns checkpointing off and back on under
    transformers 5's names: TRL's `disable_gradient_checkpointing` warned (`FutureWarning`) on every step."""
    import warnings

    from mempo_trl.grpo_mirror import activation_checkpointing_off

    model, _ = load_tiny(tiny_model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any deprecation warning fails the test
        model.activation_checkpointing_enable({"use_reentrant": False})
        with activation_checkpointing_off(model, {"use_reentrant": False}):
            assert not model.is_activation_checkpointing
        assert model.is_activation_checkpointing
        model.activation_checkpointing_disable()
        with activation_checkpointing_off(model):  # off stays off
            assert not model.is_activation_checkpointing
        assert not model.is_activation_checkpointing
