"""LoRA adapters where they do not fit fail in one line naming the file and the fix (issue 44: G5, G6, G9, G11).

Every case runs the real CLI in process (`mempo_trl.cli.main`) on copies of one short LoRA run of the tiny model
(`lora_run`: `checkpoint-1`, `checkpoint-2` and the final adapter, r 2, alpha 4) and expects one `error:` line,
exit code 2, with nothing changed in the run it was given.
"""

import json
import re
import shutil
from pathlib import Path

import pytest
from helpers import cpu_recipe, one_error_line

from mempo_trl.cli import main


LORA = {"use_peft": True, "lora_r": 2, "lora_alpha": 4, "lora_target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_dir) -> Path:
    """A finished two-step LoRA run saving a checkpoint every step (as `mempo-trl train` writes it)."""
    directory = tmp_path_factory.mktemp("lora_run")
    recipe = cpu_recipe(directory, tiny_model_dir, max_steps=2, save_strategy="steps", save_steps=1, **LORA)
    assert main(["train", "--config", str(recipe)]) == 0
    return directory / "out"


@pytest.fixture
def run_copy(tmp_path, lora_run) -> Path:
    """A copy of `lora_run` to damage."""
    return Path(shutil.copytree(lora_run, tmp_path / "lora1"))


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------- G5: resume with another shape


@pytest.mark.parametrize(
    ("flags", "found", "fix"),
    [
        (["--lora_r", "4"], "r 2 there, --lora_r 4 here", "--lora_r 2"),
        (
            ["--lora_r", "4", "--lora_alpha", "8"],
            "r 2 there, --lora_r 4 here; lora_alpha 4 there, --lora_alpha 8 here",
            "--lora_r 2 --lora_alpha 4",
        ),
        (["--lora_target_modules", "q_proj"], "target_modules ", "--lora_target_modules q_proj v_proj"),
    ],
)
def test_resume_with_another_lora_shape_names_the_flags_to_pass(
    run_copy, tmp_path, tiny_model_dir, capsys, flags, found, fix
):
    shutil.rmtree(run_copy / "checkpoint-2")
    before = files(run_copy)
    recipe = cpu_recipe(tmp_path, tiny_model_dir, max_steps=2, save_strategy="steps", save_steps=1, **LORA)
    checkpoint = run_copy / "checkpoint-1"
    argv = ["train", "--config", str(recipe), "--output_dir", str(run_copy)]
    assert main([*argv, "--resume_from_checkpoint", str(checkpoint), *flags]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: checkpoint {checkpoint} holds a LoRA adapter of another shape than this run's (")
    assert found in line and f"see {checkpoint / 'adapter_config.json'}). Resume with {fix}, or start" in line, line
    assert files(run_copy) == before


@pytest.mark.parametrize(
    ("saved", "flags", "refused"),
    [
        ({"target_modules": ["v_proj", "q_proj", "o_proj"]}, {"lora_target_modules": "all-linear"}, None),
        ({"target_modules": ["q_proj"]}, {"lora_target_modules": "q_proj"}, None),  # TRL unwraps a one-item list
        ({"target_modules": "q_proj"}, {"lora_target_modules": ["q_proj"]}, None),
        (
            {"target_modules": ["q_proj", "v_proj"]},
            {"lora_target_modules": None},
            None,
        ),  # peft's default: not compared
        ({"modules_to_save": None}, {"lora_modules_to_save": ["lm_head"]}, "Resume with no --lora_modules_to_save,"),
        ({"use_dora": True}, {}, "use_dora True there, --use_dora False here"),
        ({"use_rslora": False}, {"use_rslora": True}, "Resume with --use_rslora False,"),
    ],
)
def test_lora_shape_check_compares_what_fixes_the_weights(tmp_path, saved, flags, refused):
    from trl import ModelConfig

    from mempo_trl.checkpoints import CheckpointError, check_checkpoint_lora

    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, **saved}))
    model_args = ModelConfig(use_peft=True, lora_r=2, lora_alpha=4, **flags)
    if refused is None:
        check_checkpoint_lora(tmp_path, model_args)
    else:
        with pytest.raises(CheckpointError, match=re.escape(refused)):
            check_checkpoint_lora(tmp_path, model_args)
    check_checkpoint_lora(tmp_path, ModelConfig(use_peft=False, lora_r=64))  # a full-weight run: not compared here


def test_resume_with_the_same_lora_shape_trains_on(run_copy, tmp_path, tiny_model_dir, capsys):
    shutil.rmtree(run_copy / "checkpoint-2")
    recipe = cpu_recipe(tmp_path, tiny_model_dir, max_steps=2, save_strategy="steps", save_steps=1, **LORA)
    argv = ["train", "--config", str(recipe), "--output_dir", str(run_copy)]
    assert main([*argv, "--resume_from_checkpoint", str(run_copy / "checkpoint-1")]) == 0
    assert (run_copy / "checkpoint-2" / "adapter_model.safetensors").is_file()


# ------------------------------------------------------------------- G6, G9: merge-lora of a damaged or partial save


def test_merge_lora_of_a_truncated_adapter_names_the_file(run_copy, tmp_path, capsys):
    weights = run_copy / "adapter_model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(1000)
    argv = ["merge-lora", "--model_name_or_path", str(run_copy), "--output_dir", str(tmp_path / "merged")]
    assert main(argv) == 2
    assert one_error_line(capsys) == (
        f"error: {weights} is truncated (1000 bytes, shorter than its header): the adapter is damaged; restore it, "
        f"or merge the newest complete checkpoint, {run_copy / 'checkpoint-2'}, instead"
    )
    assert not (tmp_path / "merged" / "model.safetensors").exists()


def test_merge_lora_of_an_adapter_whose_save_was_cut_short_is_refused(run_copy, tmp_path, capsys):
    (run_copy / "mempo_save_incomplete.json").write_text('{"step": 2}')
    argv = ["merge-lora", "--model_name_or_path", str(run_copy), "--output_dir", str(tmp_path / "merged")]
    assert main(argv) == 2
    assert one_error_line(capsys) == (
        f"error: {run_copy} holds an incomplete final save (the run was stopped while saving the trained model, "
        "mempo_save_incomplete.json is still there): rerun the training command with --resume_from_checkpoint true "
        f"to save it again from {run_copy / 'checkpoint-2'}."
    )
    assert not (tmp_path / "merged" / "model.safetensors").exists()


def test_merge_lora_of_the_intact_adapter_works(lora_run, tmp_path, capsys):
    argv = ["merge-lora", "--model_name_or_path", str(lora_run), "--output_dir", str(tmp_path / "merged")]
    assert main(argv) == 0
    assert (tmp_path / "merged" / "model.safetensors").is_file()


# --------------------------------------------------------------------- G11: an adapter given where a model is meant


def test_ask_eval_and_train_say_a_lora_directory_needs_merge_lora(
    lora_run, tmp_path, tiny_model_dir, demo_paths, capsys
):
    fix = (
        f"error: model path {lora_run} is a LoRA adapter, not a model: merge it with `mempo-trl merge-lora "
        f"--model_name_or_path {lora_run} --output_dir {lora_run}-merged` and pass the merged directory."
    )
    model = ["--model_name_or_path", str(lora_run), "--corpus", str(demo_paths.corpus)]
    assert main(["ask", "Where was Alice born?", *model]) == 2
    assert one_error_line(capsys) == fix
    data = ["--dataset_name", str(demo_paths.test), "--output_dir", str(tmp_path / "eval")]
    assert main(["eval", *model, *data]) == 2
    assert one_error_line(capsys) == fix
    recipe = cpu_recipe(tmp_path, tiny_model_dir)
    assert main(["train", "--config", str(recipe), "--model_name_or_path", str(lora_run)]) == 2
    assert one_error_line(capsys) == fix
    assert not (tmp_path / "out").exists()
