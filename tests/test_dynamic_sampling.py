"""Dynamic sampling (`MemPOConfig.dynamic_sampling`) through `MemPOTrainer._generate_and_score_completions`.

A scripted policy plays G = 2 trajectories per question: a ``Dead`` question is searched, then answered wrong by
both (rewards 0, 0: an all-equal group, whose rounds still get a memory advantage in MemPO), a ``Live`` question is
answered in one turn, right by the first trajectory of each pair and wrong by the second (rewards 1, 0). The
expected advantages, masks and token counts are written out by hand from these rules.
"""

import doctest
import re

import pytest
import torch
from datasets import Dataset
from helpers import EchoRetriever, cpu_config, cpu_recipe

from mempo_trl import MemPOTrainer, dynamic_sampling
from mempo_trl.cli import main
from mempo_trl.kit.tiny import load_tiny
from mempo_trl.rewards import mempo_outcome_reward


GOLD = ["Paris"]
SEARCH = "<mem>m {n}</mem><think>t</think><search>{q}</search>"
ANSWER = "<mem>m {n}</mem><think>t</think><answer>{a}</answer>"
LIVE = 0.5 / (0.5**0.5 + 1e-4)  # (1 - 0.5) / (unbiased std of [1, 0] + 1e-4)
ARMS = {
    "mempo": {"memory_threshold": None},  # every gold token counts: the tiny model gives them all p < 0.5
    "outcome_only": {"memory_coef": 0.0},
    "full_history": {"context_mode": "full_history"},
    "outcome_only_batch_scaled": {"memory_coef": 0.0, "scale_rewards": "batch"},  # a dropped group leaves the std
}


def row(question):
    return {"question": question, "golden_answers": GOLD}


def questions(completions, question, log_extra, **kwargs):
    """A second reward function (always 0) that logs each trajectory's question as a completions-table column."""
    log_extra("question", list(question))
    return [0.0] * len(completions)


def make_trainer(model_dir, output_dir, monkeypatch, dataset_questions, **config):
    model, tokenizer = load_tiny(model_dir)

    args = cpu_config(output_dir, per_device_train_batch_size=4, **config)
    dataset = Dataset.from_list([row(q) for q in dataset_questions])
    trainer = MemPOTrainer(
        model,
        EchoRetriever(),
        reward_funcs=[mempo_outcome_reward, questions],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    calls = {}

    def scripted_generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        outs = []
        for ids in prompt_ids:
            text = tokenizer.decode(ids, skip_special_tokens=False)
            question = re.search(r"(Dead|Live)\d", text).group()
            n = calls[question] = calls.get(question, -1) + 1
            if question.startswith("Dead"):
                turn = (
                    ANSWER.format(n=n, a="Lyon")
                    if f"<search>{question}</search>" in text
                    else SEARCH.format(n=n, q=question)
                )
            else:
                turn = ANSWER.format(n=n, a="Paris" if n % 2 == 0 else "Lyon")
            outs.append(tokenizer(turn, add_special_tokens=False)["input_ids"])
        return outs, None

    monkeypatch.setattr(trainer, "_generate_single_turn", scripted_generate)
    trainer.model.train()
    return trainer


def play(trainer, batch_questions):
    out = trainer._generate_and_score_completions([row(q) for q in batch_questions for _ in range(2)])
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith("dynamic_sampling/")}
    return out, metrics


def row_questions(trainer, out):
    """The question of every real row of ``out`` (decoded from its prompt)."""
    texts = trainer.processing_class.batch_decode(out["prompt_ids"], skip_special_tokens=True)
    return [re.search(r"(Dead|Live)\d", text).group() for text in texts]


def test_doctests():
    assert doctest.testmod(dynamic_sampling).failed == 0


@pytest.mark.parametrize("arm", list(ARMS))
def test_drop_takes_all_equal_groups_out_of_the_loss(arm, tiny_model_dir, tmp_path, monkeypatch):
    kept = make_trainer(tiny_model_dir, tmp_path / "keep", monkeypatch, ["Live1"], **ARMS[arm])
    out_keep, metrics_keep = play(kept, ["Dead1", "Live1"])
    dropping = make_trainer(
        tiny_model_dir, tmp_path / "drop", monkeypatch, ["Live1"], dynamic_sampling="drop", **ARMS[arm]
    )
    out, metrics = play(dropping, ["Dead1", "Live1"])
    assert metrics_keep == {}  # "keep" is TRL's behaviour: nothing changes, nothing is logged
    # rows: Dead1 trajectory 1 (2 rounds), Dead1 trajectory 2 (2 rounds), Live1 right, Live1 wrong
    assert row_questions(dropping, out) == ["Dead1"] * 4 + ["Live1"] * 2
    torch.testing.assert_close(out_keep["completion_mask"][4:], out["completion_mask"][4:])
    assert out["completion_mask"][:4].sum() == 0 and out["advantages"][:4].abs().sum() == 0
    live_mask = out["completion_mask"][4:].float()
    torch.testing.assert_close(out["advantages"][4:], live_mask * torch.tensor([[LIVE], [-LIVE]]))
    assert int(out["num_items_in_batch"]) == int(live_mask.sum())  # the token-level normaliser counts live rows only
    assert int(out_keep["num_items_in_batch"]) == int(out_keep["completion_mask"].sum())
    if arm == "mempo":  # kept, the all-equal group still pushes its <mem> tokens; dropped, it does not
        assert out_keep["advantages"][:4].abs().sum() > 0
        assert kept._metrics["train"]["memory/scored_rounds"][-1] == 2.0
        assert dropping._metrics["train"]["memory/scored_rounds"][-1] == 0.0
    assert metrics == {
        "dynamic_sampling/frac_reward_zero_std_before": 0.5,
        "dynamic_sampling/frac_reward_zero_std_after": 0.5,
        "dynamic_sampling/groups_dropped": 1.0,
        "dynamic_sampling/groups_refilled": 0.0,
        "dynamic_sampling/refill_rounds": 0.0,
    }


def test_drop_of_every_group_gives_a_zero_loss(tiny_model_dir, tmp_path, monkeypatch):
    trainer = make_trainer(tiny_model_dir, tmp_path, monkeypatch, ["Dead1"], dynamic_sampling="drop")
    out, metrics = play(trainer, ["Dead1", "Dead2"])
    assert out["completion_mask"].sum() == 0 and int(out["num_items_in_batch"]) == 0
    trainer.current_gradient_accumulation_steps = 1  # what `Trainer.train` sets before a step
    loss = trainer.compute_loss(trainer.model, out)  # TRL's loss takes the normaliser as at least 1: 0 / 1
    assert float(loss.detach()) == 0.0
    assert metrics["dynamic_sampling/groups_dropped"] == 2.0


@pytest.mark.parametrize("arm", ["mempo", "outcome_only", "full_history"])
def test_refill_replaces_all_equal_groups_with_fresh_prompts(arm, tiny_model_dir, tmp_path, monkeypatch):
    # Every prompt of the dataset is informative, so one refill round fills the Dead1 slot.
    trainer = make_trainer(
        tiny_model_dir, tmp_path, monkeypatch, ["Live2", "Live3", "Live4"], dynamic_sampling="refill", **ARMS[arm]
    )
    out, metrics = play(trainer, ["Dead1", "Live1"])
    asked = row_questions(trainer, out)
    assert len(asked) == 4 and asked[0] == asked[1] and asked[0] in {"Live2", "Live3", "Live4"}
    assert asked[2:] == ["Live1", "Live1"]  # the informative slot keeps its group
    mask = out["completion_mask"].float()
    assert (mask.sum(dim=1) > 0).all()
    torch.testing.assert_close(out["advantages"], mask * torch.tensor([[LIVE], [-LIVE], [LIVE], [-LIVE]]))
    assert metrics == {
        "dynamic_sampling/frac_reward_zero_std_before": 0.5,
        "dynamic_sampling/frac_reward_zero_std_after": 0.0,
        "dynamic_sampling/groups_dropped": 0.0,
        "dynamic_sampling/groups_refilled": 1.0,
        "dynamic_sampling/refill_rounds": 1.0,
    }
    # the completions table pairs each refilled trajectory with its own reward functions' columns
    assert list(trainer._logs["extra"]["question"]) == [asked[0]] * 2 + ["Live1"] * 2
    assert trainer._metrics["train"]["frac_reward_zero_std"][-1] == 0.0


def test_refill_stops_at_its_bound_and_drops_what_is_left(tiny_model_dir, tmp_path, monkeypatch):
    trainer = make_trainer(
        tiny_model_dir, tmp_path, monkeypatch, ["Dead2"], dynamic_sampling="refill", dynamic_sampling_max_rounds=2
    )
    out, metrics = play(trainer, ["Dead1", "Live1"])
    asked = row_questions(trainer, out)
    assert asked[:4] == ["Dead1"] * 4 and out["completion_mask"][:4].sum() == 0  # Dead2 was no better: not taken
    assert metrics["dynamic_sampling/refill_rounds"] == 2.0
    assert metrics["dynamic_sampling/groups_refilled"] == 0.0
    assert metrics["dynamic_sampling/groups_dropped"] == 1.0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dynamic_sampling": "filter"}, "dynamic_sampling must be one of"),
        ({"dynamic_sampling_tolerance": -0.1}, "dynamic_sampling_tolerance must be >= 0"),
        ({"dynamic_sampling_max_rounds": 0}, "dynamic_sampling_max_rounds must be >= 1"),
    ],
)
def test_bad_dynamic_sampling_settings_are_refused(fields, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        cpu_config(tmp_path, **fields)


def test_refill_with_an_environment_is_refused(tiny_model_dir, tmp_path):
    from test_environments import Counter

    args = cpu_config(tmp_path, dynamic_sampling="refill")
    with pytest.raises(ValueError, match="with `environment_factory` use dynamic_sampling='drop'"):
        MemPOTrainer(load_tiny(tiny_model_dir)[0], environment_factory=Counter, args=args)


def test_a_bad_setting_in_a_recipe_is_one_error_line(capsys, tmp_path, tiny_model_dir):
    recipe = cpu_recipe(tmp_path, tiny_model_dir, dynamic_sampling="filter_groups")
    assert main(["train", "--config", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error: " in err
    assert "dynamic_sampling must be one of ('keep', 'drop', 'refill'), got 'filter_groups'" in err
