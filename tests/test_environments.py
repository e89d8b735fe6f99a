"""TRL-style environments (`mempo_trl.environments`): the convention, the rollout, and MemPOTrainer on them.

The trainer tests replace generation by the kit's oracle policies and the answer scorer by a table, so contexts,
rewards and advantages are checked by hand; `test_environments_cli.py` trains the real tiny model.
"""

import logging
import statistics

import pytest
import torch
from datasets import Dataset
from helpers import cpu_config, scripted_scorers

from mempo_trl import MemPOTrainer
from mempo_trl.context import (
    CONTEXT_RULES,
    ENVIRONMENT_INSTRUCTION,
    initial_messages,
    register_context_rule,
    render_prompt,
    round_messages,
)
from mempo_trl.environments import (
    EnvironmentConventionError,
    call_tool,
    check_environment,
    environment_tools,
    parse_tool_call,
    tool_schemas,
)
from mempo_trl.kit.envs import (
    KeyVaultEnv,
    OracleGenerator,
    SafeEnv,
    key_vault_oracle,
    key_vault_rows,
    safe_oracle,
    safe_rows,
)
from mempo_trl.kit.tiny import load_tiny
from mempo_trl.offsets import locate_mem_span
from mempo_trl.protocol import TurnProtocol
from mempo_trl.rewards import episode_metrics
from mempo_trl.rollout import RolloutEngine
from mempo_trl.turns import TOOL_ACTIONS, parse_turn


class Counter:
    """A documented tool environment; counts how many instances were built."""

    built = 0

    def __init__(self):
        Counter.built += 1
        self.total = 0

    def reset(self, start: int = 0, **row) -> str:
        self.total = start
        return f"The counter starts at {start}."

    def add(self, amount: int) -> str:
        """Add to the counter.

        Args:
            amount: how much to add.
        """
        self.total += amount
        return f"The counter is at {self.total}."

    def fail(self) -> str:
        """A tool that always raises."""
        raise RuntimeError("the counter is jammed")

    def get_reward(self) -> float:
        return float(self.total)

    def _helper(self):
        return None

    @property
    def doubled(self) -> int:
        return 2 * self.total


class Undocumented:
    def reset(self, **row):
        return ""

    def act(self, x):
        return x


# ---------------------------------------------------------------------------------------------------- the convention


def test_tools_are_the_public_methods_but_reset_and_get_reward_as_in_trl():
    assert [tool.__name__ for tool in environment_tools(Counter())] == ["add", "fail"]
    (add, fail) = tool_schemas(Counter())
    assert add["function"]["name"] == "add"
    assert add["function"]["parameters"]["properties"]["amount"] == {
        "type": "integer",
        "description": "how much to add.",
    }


def test_a_tool_without_a_schema_or_an_environment_without_reset_fails_fast_naming_it():
    with pytest.raises(EnvironmentConventionError, match=r"Undocumented\.act is a tool"):
        check_environment(Undocumented)

    class NoReset:
        def act(self) -> str:
            """Act."""

    with pytest.raises(EnvironmentConventionError, match="NoReset has no `reset"):
        check_environment(NoReset)


def test_tool_calls_parse_as_json_and_failures_are_reported_to_the_model_as_trl_does():
    assert parse_tool_call('{"name": "add", "arguments": {"amount": 2}}') == ("add", {"amount": 2})
    assert parse_tool_call('{"name": "add", "arguments": "{\\"amount\\": 2}"}') == ("add", {"amount": 2})
    assert parse_tool_call('{"name": "fail"}') == ("fail", {})
    for bad in ("add(2)", '{"arguments": {}}', '["add"]', '{"name": "add", "arguments": [1]}'):
        assert parse_tool_call(bad) is None, bad
    env = Counter()
    env.reset(start=1)
    assert call_tool(env, "add", {"amount": 2}) == "The counter is at 3."
    assert call_tool(env, "fail", {}) == str({"error": "the counter is jammed"})
    assert call_tool(env, "reset", {}) == str({"error": "Tool reset not found."})
    assert call_tool(env, "add", {"amount": 1, "extra": 0}).startswith("{'error': ")


def test_the_tool_action_is_a_tool_call_tag_and_search_turns_parse_as_before():
    turn = '<mem>m</mem><think>t</think><tool_call>{"name": "add"}</tool_call>'
    assert parse_turn(turn, TOOL_ACTIONS).action == "tool_call"
    assert parse_turn(turn).reason == "text outside tags after the last block"  # search: <tool_call> is text
    search = "<mem>m</mem><think>t</think><search>q</search>"
    assert parse_turn(search, TOOL_ACTIONS).reason == "text outside tags after the last block"
    assert parse_turn("<mem>m</mem><think>t</think><answer>7</answer>", TOOL_ACTIONS).content == "7"


# ---------------------------------------------------------------------------------------------------- the rollout


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_tiny(tiny_model_dir)


def engine(tokenizer, factory, context_mode="memory", max_turns=8):
    protocol = TurnProtocol(max_turns=max_turns, context_mode=context_mode)
    return RolloutEngine(tokenizer, protocol, environment_factory=factory, eos_token_ids=[tokenizer.eos_token_id])


@pytest.mark.parametrize("context_mode", ["memory", "full_history"])
def test_key_vault_episodes_rebuild_the_context_from_the_task_the_last_turn_and_its_tool_result(tiny, context_mode):
    _, tokenizer = tiny
    rows = key_vault_rows(3, seed=0, num_boxes=4)
    episodes = (
        engine(tokenizer, KeyVaultEnv, context_mode).play(rows, OracleGenerator(tokenizer, key_vault_oracle)).episodes
    )
    for row, ep in zip(rows, episodes):
        env = KeyVaultEnv()
        task = env.reset(**row)
        assert ep.question == task and ep.golden_answers == env.golden_answers
        assert ep.tools == tool_schemas(env)
        assert len(ep.rounds) == 5 and ep.answer == env.golden_answers[0]
        assert episode_metrics(ep)["em"] == 1.0 and episode_metrics(ep)["tool_calls"] == 4.0
        base = initial_messages(task, instruction=ENVIRONMENT_INSTRUCTION)
        history = []
        for t, record in enumerate(ep.rounds):
            kept = history if context_mode == "full_history" else history[-1:]
            assert record.prompt_ids == render_prompt(tokenizer, round_messages(base, kept, "full_history"), ep.tools)
            if t < 4:
                box = parse_tool_call(record.turn.content)[1]["box"]
                assert record.information == env.open_box(box)
                history.append((record.text, record.information))
    lengths = [len(r.prompt_ids) for r in episodes[0].rounds]
    if context_mode == "memory":  # one turn + one result: the context stays within a few tokens
        assert max(lengths[1:]) - min(lengths[1:]) < 20
    else:
        assert all(b - a > 50 for a, b in zip(lengths, lengths[1:]))


def test_a_malformed_tool_call_ends_the_episode_and_an_unknown_tool_answers_with_an_error(tiny):
    _, tokenizer = tiny
    script = iter(
        [
            '<mem>a</mem><think>t</think><tool_call>{"name": "mul", "arguments": {}}</tool_call>',
            "<mem>b</mem><think>t</think><tool_call>add(2)</tool_call>",
        ]
    )

    def generate(prompts):
        return [tokenizer(next(script), add_special_tokens=False)["input_ids"] for _ in prompts], None

    (ep,) = engine(tokenizer, Counter).play([{"start": 1}], generate).episodes
    assert ep.rounds[0].information == str({"error": "Tool mul not found."})
    assert not ep.rounds[1].turn.valid and "not a JSON call" in ep.rounds[1].turn.reason
    assert ep.rounds[1].turn.mem == "b" and ep.rounds[1].mem_span is not None
    assert ep.rounds[1].information is None and not ep.format_valid


def test_environment_instances_are_built_once_and_reset_for_every_episode(tiny):
    _, tokenizer = tiny
    Counter.built = 0
    rollout = engine(tokenizer, Counter, max_turns=1)
    answer = "<mem>m</mem><think>t</think><answer>1</answer>"

    def generate(prompts):
        return [tokenizer(answer, add_special_tokens=False)["input_ids"] for _ in prompts], None

    for _ in range(3):
        episodes = rollout.play([{"start": k} for k in range(4)], generate).episodes
    assert Counter.built == 4  # the probe, then three more for a batch of four
    assert [ep.environment.total for ep in episodes] == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------------- the trainer


def p_of_context(model, context: str) -> float:
    """The scripted P(gold | context): the memory context (it ends with the round's <mem>) gives 0.1 + 0.25 per code
    the memory holds (``box=code``); the full context 0.2 + 0.2 per box result it holds."""
    if context.endswith("</mem>"):
        return 0.1 + 0.25 * context[context.rindex("<mem>") :].count("=")
    return 0.2 + 0.2 * context.count("holds code")


def make_trainer(tiny_model_dir, tmp_path, monkeypatch, factory, rows, context_mode="memory", **kwargs):
    model, tokenizer = load_tiny(tiny_model_dir)
    args = cpu_config(
        tmp_path,
        max_completion_length=64,
        max_turns=6,
        memory_threshold=None,
        context_mode=context_mode,
    )
    trainer = MemPOTrainer(
        model,
        environment_factory=factory,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        **kwargs,
    )
    policy = key_vault_oracle if factory is KeyVaultEnv else safe_oracle
    oracle = OracleGenerator(tokenizer, policy)
    monkeypatch.setattr(trainer, "_generate_single_turn", lambda prompt_ids, *a, **k: oracle(prompt_ids))
    answer_logps, shared_logps = scripted_scorers(tokenizer, p_of_context)
    monkeypatch.setattr("mempo_trl.memory_scoring.answer_token_logps", answer_logps)
    monkeypatch.setattr("mempo_trl.memory_scoring.shared_prefix_answer_logps", shared_logps)
    return trainer, tokenizer


def test_mempo_on_key_vault_scores_the_memory_against_the_environments_gold(tiny_model_dir, tmp_path, monkeypatch):
    rows = key_vault_rows(2, seed=0, num_boxes=3)
    trainer, tokenizer = make_trainer(tiny_model_dir, tmp_path, monkeypatch, KeyVaultEnv, rows)
    assert trainer.args.instruction == ENVIRONMENT_INSTRUCTION and trainer.reward_func_names == [
        "mempo_outcome_reward"
    ]
    scored_items = []
    real_score = trainer._score_items
    monkeypatch.setattr(trainer, "_score_items", lambda items, *a: scored_items.extend(items) or real_score(items, *a))
    trainer.model.train()
    out = trainer._generate_and_score_completions([row for row in rows for _ in range(2)])

    # 4 episodes x 4 rounds (3 boxes, then the answer); rounds 2-4 are scored against the environment's gold.
    assert out["completion_ids"].shape[0] == 16
    env = KeyVaultEnv()
    env.reset(**rows[0])
    gold_ids = tokenizer(f"<answer> {env.golden_answers[0]} </answer>", add_special_tokens=False)["input_ids"]
    assert scored_items[0].answer_ids == gold_ids and len(scored_items) == 2 * 4 * 3
    # Both scoring contexts render the tools, as the generation contexts do.
    assert all(
        tokenizer.decode(item.context_ids).count("Open a box and read the code inside") == 1 for item in scored_items
    )
    metrics = trainer._metrics["train"]
    assert metrics["episode/em"][-1] == 1.0 and metrics["rewards/mempo_outcome_reward/mean"][-1] == 1.0
    assert metrics["memory/scored_rounds"][-1] == 12
    # Round t's <mem> holds t-1 codes (P_mem = 0.1 + 0.25 (t-1)) and the history before it t-1 results
    # (P_full = 0.2 + 0.2 (t-1)): rewards -0.05, 0, +0.05 for rounds 2, 3, 4.
    rewards = {2: -0.05, 3: 0.0, 4: 0.05}
    for t, reward in rewards.items():
        assert metrics[f"memory/reward/round_{t}"][-1] == pytest.approx(reward, abs=1e-6)
    # Every trajectory is right: zero outcome advantage. The memory pool of a question is its 2 x 3 scored rounds.
    std = statistics.stdev(list(rewards.values()) * 2)
    for i in range(16):
        t = i % 4 + 1
        ids = out["completion_ids"][i][out["completion_mask"][i].bool()].tolist()
        expected = torch.zeros(out["advantages"].shape[1])
        if t > 1:
            start, end = locate_mem_span(ids, tokenizer, TOOL_ACTIONS)
            expected[start : end + 1] = rewards[t] / (std + 1e-6)
        torch.testing.assert_close(out["advantages"][i], expected, rtol=1e-4, atol=1e-5)


def test_full_history_on_key_vault_appends_every_turn_and_scores_no_memory(tiny_model_dir, tmp_path, monkeypatch):
    rows = key_vault_rows(2, seed=0, num_boxes=3)
    trainer, tokenizer = make_trainer(tiny_model_dir, tmp_path, monkeypatch, KeyVaultEnv, rows, "full_history")
    trainer.model.train()
    out = trainer._generate_and_score_completions([row for row in rows for _ in range(2)])
    metrics = trainer._metrics["train"]
    assert out["completion_ids"].shape[0] == 16 and metrics["episode/em"][-1] == 1.0
    assert "memory/reward" not in metrics and metrics["memory/scored_rounds"][-1] == 0
    last_prompt = tokenizer.decode(out["prompt_ids"][3][out["prompt_mask"][3].bool()])
    assert last_prompt.count("holds code") == 3  # round 4 of episode 1 sees the three results


@pytest.fixture
def last_two():
    """A context rule added as a user would: one `register_context_rule` call (removed after the test)."""
    register_context_rule("last_two", lambda rounds: rounds[-2:], "the last two rounds")
    yield "last_two"
    CONTEXT_RULES.pop("last_two"), CONTEXT_RULES.helps.pop("last_two")


def test_a_user_added_context_rule_shows_its_rounds_and_scores_memory(tiny_model_dir, tmp_path, monkeypatch, last_two):
    rows = key_vault_rows(2, seed=0, num_boxes=3)
    trainer, tokenizer = make_trainer(tiny_model_dir, tmp_path, monkeypatch, KeyVaultEnv, rows, last_two)
    trainer.model.train()
    out = trainer._generate_and_score_completions([row for row in rows for _ in range(2)])
    metrics = trainer._metrics["train"]
    assert (
        metrics["episode/em"][-1] == 1.0 and metrics["memory/scored_rounds"][-1] == 12 and "memory/reward" in metrics
    )
    last_prompt = tokenizer.decode(out["prompt_ids"][3][out["prompt_mask"][3].bool()])
    assert last_prompt.count("holds code") == 2  # round 4 of episode 1 sees the last two results


def test_safe_env_owns_the_reward_and_trains_on_the_outcome_only_with_a_warning(
    tiny_model_dir, tmp_path, monkeypatch, caplog
):
    rows = safe_rows(2, seed=0)
    trainer, _ = make_trainer(tiny_model_dir, tmp_path, monkeypatch, SafeEnv, rows)
    assert trainer.reward_func_names == ["SafeEnv"]
    trainer.model.train()
    with caplog.at_level(logging.WARNING, logger="mempo_trl.trainer"):
        trainer._generate_and_score_completions([row for row in rows for _ in range(2)])
        trainer._generate_and_score_completions([row for row in rows for _ in range(2)])
    warnings = [r for r in caplog.records if "no gold answer" in r.getMessage()]
    assert len(warnings) == 1 and "SafeEnv" in warnings[0].getMessage()
    metrics = trainer._metrics["train"]
    assert metrics["rewards/SafeEnv/mean"][-1] == 1.0 and metrics["episode/format_valid"][-1] == 1.0
    assert "episode/em" not in metrics and "memory/reward" not in metrics
    assert metrics["memory/scored_rounds"][-1] == 0 and metrics["episode/tool_calls"][-1] == 4.0


def test_an_environment_trainer_fails_fast_on_bad_rows_and_missing_rewards(tiny_model_dir, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"row 0: KeyVaultEnv\.reset\(\*\*row\) failed"):
        make_trainer(tiny_model_dir, tmp_path, monkeypatch, KeyVaultEnv, [{"boxes": 3}])

    class Quiet(Counter):
        get_reward = None

    with pytest.raises(ValueError, match="row 0 has no `golden_answers` and Quiet sets none"):
        make_trainer(tiny_model_dir, tmp_path, monkeypatch, Quiet, [{"start": 1}])
    with pytest.raises(ValueError, match="exactly one of `retriever`"):
        MemPOTrainer(load_tiny(tiny_model_dir)[0], object(), environment_factory=KeyVaultEnv)


def test_the_docs_example_environment_follows_the_convention(tiny):
    from pathlib import Path

    text = Path(__file__).parents[1].joinpath("docs", "environments.md").read_text(encoding="utf-8")
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    namespace = {}
    exec(code.split("rows = ")[0], namespace)  # the imports and the class, not the training run
    notebook = check_environment(namespace["NotebookEnv"])
    assert [schema["function"]["name"] for schema in tool_schemas(notebook)] == ["read_page"]
    _, tokenizer = tiny

    def generate(prompts):
        turn = '<mem>m</mem><think>t</think><tool_call>{"name": "read_page", "arguments": {"page": 2}}</tool_call>'
        return [tokenizer(turn, add_special_tokens=False)["input_ids"] for _ in prompts], None

    (ep,) = engine(tokenizer, namespace["NotebookEnv"], max_turns=2).play([{"pages": [3, 8, 5]}], generate).episodes
    assert ep.golden_answers == ["16"] and ep.rounds[0].information == "Page 2 says 8."
