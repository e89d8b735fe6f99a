"""Resuming from a checkpoint gives the same model as training straight through (single process, CPU)."""

from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from mempo_trl.kit.demo_world import demo_paths


DEMO = demo_paths()
TINY_RECIPE = Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny_cpu.yaml"


class StopAfter(TrainerCallback):
    """Stop training after `step` optimizer steps, as if the job had been cut off right after a checkpoint."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def _args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--config",
        str(TINY_RECIPE),
        "--model_name_or_path",
        str(model_dir),
        "--dataset_name",
        str(DEMO.train.parent),
        "--corpus",
        str(DEMO.corpus),
        "--output_dir",
        str(out),
        "--per_device_train_batch_size",
        "4",
        "--num_generations",
        "4",
        "--max_turns",
        "3",
        "--max_completion_length",
        "48",
        "--max_steps",
        "4",
        "--learning_rate",
        "1e-3",
        "--seed",
        "7",
        *extra,
    ]


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def _logged(trainer, key: str) -> dict[int, float]:
    return {entry["step"]: entry[key] for entry in trainer.state.log_history if key in entry}


@pytest.mark.slow
def test_resume_from_checkpoint_matches_straight_run(warm_model_dir, tmp_path):
    from mempo_trl.commands.recipe import build_trainer, train
    from mempo_trl.commands.train import parse_args

    straight = build_trainer(*parse_args(_args(warm_model_dir, tmp_path / "straight")))
    start = _weights(straight)
    straight.train()
    assert straight.state.global_step == 4
    final = _weights(straight)
    assert any(not torch.equal(start[n], final[n]) for n in start), "the weights must move, or the test is vacuous"

    resumed_dir = tmp_path / "resumed"
    saving = ("--save_strategy", "steps", "--save_steps", "2")
    first = build_trainer(*parse_args(_args(warm_model_dir, resumed_dir, *saving)))
    first.add_callback(StopAfter(2))
    first.train()
    checkpoint = resumed_dir / "checkpoint-2"
    assert first.state.global_step == 2
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= {
        p.name for p in checkpoint.iterdir()
    }
    halfway = _weights(first)
    assert any(not torch.equal(halfway[n], final[n]) for n in final)

    script_args, training_args, model_args, retriever_args = parse_args(
        _args(warm_model_dir, resumed_dir, *saving, "--resume_from_checkpoint", str(checkpoint))
    )
    second = build_trainer(script_args, training_args, model_args, retriever_args)
    train(second, training_args)
    assert second.state.global_step == 4
    resumed = _weights(second)
    for name in final:
        torch.testing.assert_close(resumed[name], final[name], msg=name)  # float32 tolerances
    # Steps 3 and 4 saw the same rollouts (data order and sampling RNG restored).
    for key in ("reward", "loss", "tokens/prompt_per_round"):
        straight_log, resumed_log = _logged(straight, key), _logged(second, key)
        assert {s: straight_log[s] for s in (3, 4)} == {s: resumed_log[s] for s in (3, 4)}, key
