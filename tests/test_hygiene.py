"""Package hygiene: license, dependency extras, no deprecation warnings from our settings, one log line per step."""

import tomllib
import warnings
from pathlib import Path

import pytest
from datasets import Dataset
from helpers import EchoRetriever

from mempo_trl import MemPOConfig, MemPOTrainer
from mempo_trl.callbacks import use_step_summary
from mempo_trl.kit.tiny import load_tiny


ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
BASE = dict(use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=2, num_generations=2)


def test_license_file_matches_pyproject():
    assert PYPROJECT["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_dev_composes_every_extra_but_vllm():
    extras = PYPROJECT["optional-dependencies"]
    composed = next(d for d in extras["dev"] if d.startswith("mempo_trl["))
    assert set(composed[len("mempo_trl[") : -1].split(",")) == set(extras) - {"dev", "vllm"}
    core = " ".join(PYPROJECT["dependencies"])
    for optional in ("matplotlib", "fastapi", "faiss", "deepspeed", "vllm", "pytest"):
        assert optional not in core


def test_our_settings_raise_no_deprecation_warning(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = MemPOConfig(output_dir=str(tmp_path), **BASE)
        off = MemPOConfig(output_dir=str(tmp_path), activation_checkpointing=False, **BASE)
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning | DeprecationWarning)] == []
    assert args.activation_checkpointing and args.gradient_checkpointing  # TRL's default: on
    assert not off.activation_checkpointing and not off.gradient_checkpointing
    with pytest.warns(FutureWarning, match="gradient_checkpointing"):  # a user's old name still counts
        assert not MemPOConfig(output_dir=str(tmp_path), gradient_checkpointing=False, **BASE).activation_checkpointing


def test_sft_defaults_work_on_a_cpu_without_a_deprecation_warning(tmp_path):
    """`mempo-trl sft`'s config: TRL's bf16 default stops a CPU run ("doesn't support bf16/gpu"), and its
    `gradient_checkpointing=True` warns; on a machine without a bf16 GPU the run is float32, checkpointing is on under
    its current name, and an explicit value still wins."""
    from transformers.utils import is_torch_bf16_gpu_available

    from mempo_trl.config import MemPOSFTConfig as config_class

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = config_class(output_dir=str(tmp_path), report_to="none")
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning | DeprecationWarning)] == []
    assert args.bf16 is is_torch_bf16_gpu_available() and args.activation_checkpointing
    assert config_class(output_dir=str(tmp_path), use_cpu=True, report_to="none").bf16 is False
    assert not config_class(output_dir=str(tmp_path), activation_checkpointing=False).activation_checkpointing


@pytest.mark.parametrize("disable_tqdm", [True, False])
def test_one_line_per_logged_step(tiny_model_dir, tmp_path, capsys, disable_tqdm):
    model, tokenizer = load_tiny(tiny_model_dir)
    args = MemPOConfig(output_dir=str(tmp_path), disable_tqdm=disable_tqdm, max_steps=2, **BASE)
    dataset = Dataset.from_list([{"question": "q?", "golden_answers": ["Ulm"]}])
    trainer = MemPOTrainer(model, EchoRetriever(), args=args, train_dataset=dataset, processing_class=tokenizer)
    use_step_summary(trainer)
    trainer.state.max_steps = 2
    trainer.callback_handler.on_train_begin(trainer.args, trainer.state, trainer.control)
    capsys.readouterr()
    trainer.log({"reward": 0.5, "episode/em": 0.25, "step_time": 3.0})
    captured = capsys.readouterr()
    lines = [line for line in captured.out.splitlines() if line.strip()]
    assert "'reward'" not in captured.err  # (stderr holds the progress bar)
    assert lines == ["step 0/2 | reward 0.500 | em 0.250 | format - | mem_reward - | prompt/round - | 3.00 s/step"]
    assert trainer.state.log_history[-1]["reward"] == 0.5  # the dict still goes to the report_to backends
    if disable_tqdm:  # evaluation logs are printed as TRL prints them
        trainer.log({"eval_loss": 1.0})
        assert "'eval_loss'" in capsys.readouterr().out
