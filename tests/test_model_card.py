"""The Hub model card of a MemPO run, written locally (never pushed)."""

import json
from pathlib import Path

import pytest
import yaml


TINY_RECIPE = Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny_cpu.yaml"


@pytest.mark.slow
def test_model_card_names_method_paper_trl_base_data_recipe_and_metrics(warm_model_dir, demo_paths, tmp_path):
    import shutil

    from mempo_trl.commands.recipe import build_trainer, train
    from mempo_trl.commands.train import parse_args
    from mempo_trl.kit.cli import write_kit_card

    base = shutil.copytree(warm_model_dir, tmp_path / "base")
    write_kit_card(base, "a kit model")  # its license, Apache-2.0, is the trained model's
    out = tmp_path / "mempo-tiny-card"
    script_args, training_args, model_args, retriever_args = parse_args(
        [
            "--config",
            str(TINY_RECIPE),
            "--model_name_or_path",
            str(base),
            "--dataset_name",
            str(demo_paths.train),
            "--corpus",
            str(demo_paths.corpus),
            "--output_dir",
            str(out),
            "--per_device_train_batch_size",
            "2",
            "--num_generations",
            "2",
            "--max_turns",
            "2",
            "--max_completion_length",
            "24",
            "--max_steps",
            "1",
        ]
    )
    trainer = build_trainer(script_args, training_args, model_args, retriever_args)
    train(trainer, training_args, script_args.dataset_name)  # the recipe's: train, save, evaluate, card
    assert json.loads((out / "mempo_agent.json").read_text())["max_turns"] == 2  # pushed with the weights

    card = (out / "README.md").read_text(encoding="utf-8")
    _, front_matter, body = card.split("---\n", 2)
    metadata = yaml.safe_load(front_matter)
    assert "mempo" in metadata["tags"] and set(trainer._tag_names) <= set(metadata["tags"])
    assert metadata["license"] == "apache-2.0" and "licence" not in metadata  # TRL's placeholder `licence: license`
    assert "# Model Card for mempo-tiny-card" in body  # the output_dir name, not TRL's "None"
    assert f"fine-tuned version of the local model `{base}` (not on the Hub)." in body
    quick_start = body.split("## Quick start", 1)[1].split("## Training procedure", 1)[0]
    assert 'pip install "mempo_trl @ git+https://github.com/mempo-trl/mempo_trl"' in quick_start
    # Not pushed: the usage names the directory, a question of its own training data and the corpus it searched.
    question = trainer.train_dataset[0]["question"]
    assert f'MemPOAgent.from_pretrained("{out}", retriever="{demo_paths.corpus}")' in quick_start
    assert f"agent.run({question!r})" in quick_start
    assert f"--model_name_or_path {out} --corpus {demo_paths.corpus}" in quick_start
    assert "pipeline(" not in body and "time machine" not in body  # TRL's generic chat snippet is replaced
    procedure = body.split("## Training procedure", 1)[1].split("### Framework versions", 1)[0]
    for words in (
        "MemPO",
        "Self-Memory Policy Optimization",
        "2603.00680",
        "[TRL](https://github.com/huggingface/trl)",
        "https://github.com/mempo-trl/mempo_trl",
    ):
        assert words in procedure, words
    assert f"**dataset**: {demo_paths.train}" in procedure
    assert f"**retriever**: BM25 over {demo_paths.corpus}" in procedure
    heldout = procedure.split("### Held-out evaluation", 1)[1].split("###", 1)[0]
    curve = next(c for c in trainer.callback_handler.callbacks if hasattr(c, "curve")).curve
    assert "on 50 held-out questions never trained on, before (step 0) and after (step 1)" in heldout
    assert f"| em | {curve[0]['em']:.3f} | {curve[-1]['em']:.3f} |" in heldout
    recipe = procedure.split("### Recipe", 1)[1].split("###", 1)[0]
    for row in (
        "| `max_turns` | `2` |",
        "| `num_generations` | `2` |",
        "| `memory_coef` | `1.0` |",
        "`loss_type` | `dapo`",
    ):
        assert row in recipe, row
    metrics = procedure.split("### Last training step", 1)[1]
    assert "not an evaluation (that is the held-out table above)" in metrics
    final = trainer.final_metrics()
    for key in ("episode/em", "episode/format_valid", "tokens/prompt_per_round"):
        assert f"| `{key}` | {final[key]:.4g} |" in metrics, key


def test_pushed_card_uses_the_hub_id_and_local_base_models_resolve(tmp_path):
    from mempo_trl.model_card import base_model_license, describe_base_model, heldout_summary, search_usage

    assert 'from_pretrained("you/mempo-agent", retriever="http://h:8000")' in search_usage(
        "you/mempo-agent", "http://h:8000", "q?"
    )
    assert "--retriever_url http://h:8000" in search_usage("you/mempo-agent", "http://h:8000", "q?")
    assert describe_base_model(str(tmp_path)) == f"the local model `{tmp_path}` (not on the Hub)"
    assert base_model_license(str(tmp_path)) is None  # no card: the trained model's card names no license
    (tmp_path / "README.md").write_text("---\nlicense: mit\ntags: [x]\n---\n# a card\n")
    assert base_model_license(str(tmp_path)) == "mit"
    assert heldout_summary([object()]) is None


def test_the_kit_learner_carries_its_license_into_the_card(tmp_path):
    from mempo_trl.cli import main
    from mempo_trl.model_card import base_model_license, set_license

    assert main(["kit", "learner", "--output_dir", str(tmp_path / "kit")]) == 0
    license = base_model_license(str(tmp_path / "kit" / "model"))
    assert license == "apache-2.0"
    trl_front_matter = "---\nlibrary_name: transformers\nlicence: license\ntags: [mempo]\n---\n"
    assert (
        set_license(trl_front_matter, license)
        == "---\nlibrary_name: transformers\nlicense: apache-2.0\ntags: [mempo]\n---\n"
    )
