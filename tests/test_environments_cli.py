"""Environments end to end: `MemPOAgent.run(row)`, token accounting with `evaluate`, and `mempo-trl train` /
`mempo-trl eval --environment` on the kit environments with the real tiny model."""

import json

import pytest
from helpers import cpu_recipe

from mempo_trl.agent import AgentError, MemPOAgent
from mempo_trl.cli import main
from mempo_trl.context import ENVIRONMENT_INSTRUCTION
from mempo_trl.evaluation import compare_modes, evaluate
from mempo_trl.kit.envs import (
    KIT_ENVIRONMENTS,
    ORACLES,
    KeyVaultEnv,
    OracleGenerator,
    SafeEnv,
    key_vault_rows,
    safe_rows,
)
from mempo_trl.kit.tiny import load_tiny


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tiny(tiny_model_dir)[1]


def oracle_agent(tokenizer, name):
    factory = KIT_ENVIRONMENTS[name][0]
    return MemPOAgent(tokenizer, None, OracleGenerator(tokenizer, ORACLES[name]), environment_factory=factory)


def test_the_agent_plays_an_environment_row_and_counts_its_tokens(tokenizer):
    agent = oracle_agent(tokenizer, "keyvault")
    assert agent.protocol.instruction == ENVIRONMENT_INSTRUCTION
    row = key_vault_rows(1, seed=3, num_boxes=4)[0]
    result = agent.run(row)
    env = KeyVaultEnv()
    assert result.question == env.reset(**row) and result.answer == env.golden_answers[0]
    assert result.num_turns == 5 and result.num_searches == 4 and result.format_valid
    assert [t["action"] for t in result.turns] == ["tool_call"] * 4 + ["answer"]
    assert result.turns[0]["information"] == env.open_box(json.loads(result.turns[0]["content"])["arguments"]["box"])
    sizes = [t["prompt_tokens"] + t["completion_tokens"] for t in result.turns]
    assert result.total_tokens == sum(sizes) and result.peak_context_tokens == max(sizes)
    with pytest.raises(AgentError, match="exactly one of"):
        MemPOAgent(tokenizer, None, agent.generator)


@pytest.mark.parametrize("name", sorted(KIT_ENVIRONMENTS))
def test_memory_contexts_stay_flat_where_full_history_grows(tokenizer, name):
    agent = oracle_agent(tokenizer, name)
    rows = KIT_ENVIRONMENTS[name][1](6, seed=1)
    memory = evaluate(agent, rows, context_mode="memory", progress=False)
    full = evaluate(agent, rows, context_mode="full_history", progress=False)
    for result in (memory, full):
        overall = result.metrics["overall"]
        assert overall["format_valid"] == 1.0
        if name == "safe":  # no gold: no exact match; the environment's reward instead
            assert overall["reward"] == 1.0 and all(r["em"] is None for r in result.records)
        else:
            assert overall["em"] == 1.0 and "reward" not in overall
    per_round_memory = memory.metrics["overall"]["prompt_tokens_per_round"]
    per_round_full = full.metrics["overall"]["prompt_tokens_per_round"]
    assert per_round_memory[0] == per_round_full[0] and per_round_memory[1] == per_round_full[1]
    assert max(per_round_memory[1:]) - min(per_round_memory[1:]) < 20
    assert all(b > a for a, b in zip(per_round_full, per_round_full[1:]))
    assert compare_modes(memory, full)["total_token_reduction_pct"] > 5


def kit_rows(directory, name: str, capsys) -> str:
    """`mempo-trl kit env-rows`: the kit environment's seeded rows, train.jsonl (seed 0) and test.jsonl (seed 1)."""
    argv = ["kit", "env-rows", "--environment", name, "--output_dir", str(directory), "--num_rows", "8"]
    assert main([*argv, "--num_test_rows", "3"]) == 0
    assert "train.jsonl 8 rows (seed 0), test.jsonl 3 rows (seed 1)" in capsys.readouterr().out
    return str(directory)


def test_eval_cli_plays_a_kit_environment_in_both_modes(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "eval"
    rows = kit_rows(tmp_path / "rows", "safe", capsys) + "/test.jsonl"
    argv = ["eval", "--model_name_or_path", str(tiny_model_dir), "--environment", "mempo_trl.kit.envs.SafeEnv"]
    argv += ["--dataset_name", rows, "--output_dir", str(out)]
    argv += ["--max_eval_samples", "3", "--max_turns", "2", "--max_completion_length", "8", "--context_mode", "both"]
    assert main([*argv, "--disable_tqdm", "true"]) == 0
    assert "reward" in capsys.readouterr().out
    report = json.loads((out / "results.json").read_text())
    assert report["settings"]["protocol"]["instruction"] == ENVIRONMENT_INSTRUCTION
    assert report["settings"]["protocol"]["action"] == "tool_call"
    assert report["settings"]["retriever"] == {"environment": "mempo_trl.kit.envs.SafeEnv"}
    lines = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    tasks = [SafeEnv().reset(**row) for row in safe_rows(3, seed=1)]  # the held-out kit rows
    assert [line["question"] for line in lines] == tasks * 2
    assert all(line["reward"] == 0.0 and line["em"] is None for line in lines)
    for mode in ("memory", "full_history"):
        assert report["modes"][mode]["overall"]["reward"] == 0.0


def test_eval_cli_refuses_an_unknown_environment_in_one_line(tiny_model_dir, tmp_path, capsys):
    argv = ["eval", "--model_name_or_path", str(tiny_model_dir), "--environment", "nope.Env", "--dataset_name", "x"]
    assert main([*argv, "--output_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "error: unknown environment 'nope.Env'" in err and "Traceback" not in err


@pytest.fixture
def recipe(tmp_path, tiny_model_dir):
    def write(**fields):
        return str(cpu_recipe(tmp_path, tiny_model_dir, **{"num_generations": 2, "max_turns": 2, **fields}))

    return write


@pytest.mark.parametrize("name", sorted(KIT_ENVIRONMENTS))
@pytest.mark.parametrize("context_mode", ["memory", "full_history"])
def test_train_cli_trains_on_a_kit_environment(recipe, tmp_path, capsys, name, context_mode):
    cls = KIT_ENVIRONMENTS[name][0].__name__
    rows = kit_rows(tmp_path / "rows", name, capsys) + "/train.jsonl"
    settings = {"environment": f"mempo_trl.kit.envs.{cls}", "dataset_name": rows, "context_mode": context_mode}
    assert main(["train", "--config", recipe(**settings)]) == 0
    metrics = json.loads((tmp_path / "out" / "mempo_metrics.json").read_text())
    assert metrics["episode/turns"] >= 1 and "tokens/prompt_per_round" in metrics
    assert ("rewards/SafeEnv/mean" in metrics) == (name == "safe")
    assert ("episode/em" in metrics) == (name == "keyvault")
    saved = json.loads((tmp_path / "out" / "mempo_agent.json").read_text())
    assert saved["instruction"] == ENVIRONMENT_INSTRUCTION and saved["context_mode"] == context_mode
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"from mempo_trl.kit.envs import {cls}" in card and f"environment_factory={cls})" in card


def test_train_cli_refuses_bad_environment_recipes_before_training(recipe, tmp_path, capsys):
    keyvault = "mempo_trl.kit.envs.KeyVaultEnv"
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"boxes": 3}) + "\n")
    assert main(["train", "--config", recipe(environment=keyvault, dataset_name=str(rows), heldout_questions=3)]) == 2
    assert f"mempo-trl eval --environment {keyvault}" in capsys.readouterr().err
    assert main(["train", "--config", recipe(environment=keyvault, dataset_name=str(rows))]) == 2
    err = capsys.readouterr().err
    assert "error: train_dataset row 0: KeyVaultEnv.reset(**row) failed" in err and "Traceback" not in err
