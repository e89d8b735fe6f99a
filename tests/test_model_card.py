"""The Hub model card of a MemPO run, written locally (never pushed)."""

import json
from pathlib import Path

import pytest
import yaml


TINY_RECIPE = Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny_cpu.yaml"


@pytest.mark.slow
def test_model_card_names_method_paper_trl_base_data_recipe_and_metrics(warm_model_dir, demo_paths, tmp_path):
    from mempo_trl.commands.train import build_trainer, parse_args

    out = tmp_path / "mempo-tiny-card"
    script_args, training_args, model_args, retriever_args = parse_args(
        [
            "--config", str(TINY_RECIPE),
            "--model_name_or_path", str(warm_model_dir),
            "--dataset_name", str(demo_paths.train),
            "--output_dir", str(out),
            "--per_device_train_batch_size", "2", "--num_generations", "2",
            "--max_turns", "2", "--max_completion_length", "24", "--max_steps", "1",
        ]
    )  # fmt: skip
    trainer = build_trainer(script_args, training_args, model_args, retriever_args)
    trainer.train()
    trainer.save_model()
    trainer.create_model_card(dataset_name=script_args.dataset_name)
    assert json.loads((out / "mempo_agent.json").read_text())["max_turns"] == 2  # pushed with the weights

    card = (out / "README.md").read_text(encoding="utf-8")
    _, front_matter, body = card.split("---\n", 2)
    metadata = yaml.safe_load(front_matter)
    assert "mempo" in metadata["tags"] and set(trainer._tag_names) <= set(metadata["tags"])
    assert "# Model Card for mempo-tiny-card" in body  # the output_dir name, not TRL's "None"
    quick_start = body.split("## Quick start", 1)[1].split("## Training procedure", 1)[0]
    assert 'MemPOAgent.from_pretrained("mempo-tiny-card", retriever=' in quick_start
    assert "pipeline(" not in body and "time machine" not in body  # TRL's generic chat snippet is replaced
    for words in (
        "MemPO",
        "Self-Memory Policy Optimization",
        "2603.00680",
        "[TRL](https://github.com/huggingface/trl)",
    ):
        assert words in body, words
    assert f"**base model**: {warm_model_dir}" in body
    assert f"**dataset**: {demo_paths.train}" in body
    assert "**retriever**: BM25 over the demo corpus" in body
    recipe = body.split("### Recipe", 1)[1].split("###", 1)[0]
    for row in (
        "| `max_turns` | `2` |",
        "| `num_generations` | `2` |",
        "| `memory_coef` | `1.0` |",
        "`loss_type` | `dapo`",
    ):
        assert row in recipe, row
    metrics = body.split("### Final metrics", 1)[1]
    final = trainer.final_metrics()
    for key in ("episode/em", "episode/format_valid", "tokens/prompt_per_round"):
        assert f"| `{key}` | {final[key]:.4g} |" in metrics, key
