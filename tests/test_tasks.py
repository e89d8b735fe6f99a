"""The task seam (`mempo_trl.tasks.Task`): a third kind of task is one class, here `GlossaryTask`, whose rows carry
their own glossary; the rollout, the trainer and the agent play it without knowing it."""

import pytest
from datasets import Dataset
from helpers import cpu_config, play_script, turn

from mempo_trl import MemPOTrainer
from mempo_trl.agent import MemPOAgent
from mempo_trl.kit.tiny import load_tiny
from mempo_trl.protocol import TurnProtocol
from mempo_trl.rewards import episode_metrics, mempo_outcome_reward
from mempo_trl.rollout import RolloutEngine
from mempo_trl.tasks import EnvironmentTask, SearchTask, TaskStart, make_task


class GlossaryTask:
    """Each row holds a ``glossary`` (term -> text); ``<search> term </search>`` reads it, one lookup per action."""

    action = "search"
    action_metric = "lookups"
    can_refill = False
    passes_environments = False

    def protocol(self, protocol):
        return protocol

    def prepare(self, reward_funcs, train_dataset, eval_dataset):
        return reward_funcs or [mempo_outcome_reward], train_dataset, eval_dataset

    def questions(self, rows):
        return None

    def start(self, rows):
        return [TaskStart(row["question"], environment=row["glossary"]) for row in rows]

    def act(self, environments, contents, topk):
        return [glossary.get(term, "unknown term") for glossary, term in zip(environments, contents)]

    def render_result(self, result):
        return f"<information>{result}</information>"

    def action_problem(self, content):
        return None


GLOSSARY = {"alpha": "Alpha lies in Paris.", "beta": "Beta lies in Rome."}
GOLDS = {"Where is Alpha?": ["Paris"], "Where is Beta?": ["Rome"]}
ROWS = [{"question": question, "golden_answers": golds, "glossary": GLOSSARY} for question, golds in GOLDS.items()]


@pytest.fixture
def tiny(tiny_model_dir):
    return load_tiny(tiny_model_dir)


def test_the_rollout_plays_a_third_task_through_the_seam(tiny):
    """Its actions read the row's glossary; the episode counts them under the task's own metric name."""
    _, tokenizer = tiny
    script = {
        "Where is Alpha?": [turn("m", "search", "alpha"), turn("Paris", "answer", "Paris")],
        "Where is Beta?": [turn("m", "search", "gamma"), turn("?", "answer", "Rome")],
    }

    def generate(prompts):
        texts = [tokenizer.decode(ids) for ids in prompts]
        scripts = [next(s for q, s in script.items() if q in text) for text in texts]
        turns = [s[1] if "<information>" in text else s[0] for s, text in zip(scripts, texts)]
        return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in turns], None

    engine = RolloutEngine(tokenizer, TurnProtocol(max_turns=3), task=GlossaryTask())
    episodes = engine.play(ROWS, generate).episodes
    assert [ep.rounds[0].information for ep in episodes] == [
        "<information>Alpha lies in Paris.</information>",
        "<information>unknown term</information>",
    ]
    assert [ep.answer for ep in episodes] == ["Paris", "Rome"]
    assert episodes[0].metrics()["lookups"] == 1.0 and "searches" not in episodes[0].metrics()
    assert episode_metrics(episodes[1])["em"] == 1.0


def test_the_trainer_trains_a_third_task_and_refuses_refill_for_it(tiny, tmp_path, monkeypatch):
    model, tokenizer = tiny
    dataset = Dataset.from_list(ROWS)
    args = cpu_config(tmp_path, per_device_train_batch_size=4, max_turns=3)
    trainer = MemPOTrainer(model, args=args, train_dataset=dataset, processing_class=tokenizer, task=GlossaryTask())
    play_script(trainer, tokenizer, monkeypatch)
    trainer.train()
    metrics = trainer.state.log_history[0]
    assert metrics["episode/lookups"] > 0 and "episode/searches" not in metrics
    trainer.create_model_card()  # a task without `usage`: the card keeps TRL's quick start
    card = (tmp_path / "README.md").read_text()
    assert "## Quick start" in card and "MemPOAgent" not in card.split("## Quick start")[1].split("##")[0]
    with pytest.raises(ValueError, match="dynamic_sampling='refill' plays further prompts, which GlossaryTask cannot"):
        refill = cpu_config(tmp_path, dynamic_sampling="refill")
        MemPOTrainer(model, args=refill, train_dataset=dataset, processing_class=tokenizer, task=GlossaryTask())


def test_exactly_one_task_is_given(tiny):
    _, tokenizer = tiny
    with pytest.raises(ValueError, match="exactly one of `retriever`"):
        RolloutEngine(tokenizer, TurnProtocol(), retriever=object(), task=GlossaryTask())
    assert isinstance(make_task(retriever=object()), SearchTask)
    assert isinstance(MemPOAgent(tokenizer, None, generator=None, task=GlossaryTask()).task, GlossaryTask)
    with pytest.raises(ValueError, match="exactly one of"):
        make_task()


def test_the_environment_task_plays_tool_calls(tiny):
    from mempo_trl.kit.envs import KeyVaultEnv

    task = EnvironmentTask(KeyVaultEnv)
    assert (task.action, task.protocol(TurnProtocol()).stops) == ("tool_call", ("</tool_call>", "</answer>"))
    assert task.action_problem("open(B3)") is not None and task.action_problem('{"name": "f"}') is None


def test_each_task_reads_its_rows_and_writes_its_quick_start(tmp_path):
    """What `mempo-trl train` and the model card ask a task, with no "is there an environment?" of their own: how its
    rows are read, whether the held-out evaluation plays it, and the card's quick start."""
    import json

    from mempo_trl.commands.recipe import ScriptArguments, task_class
    from mempo_trl.kit.envs import KeyVaultEnv

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question": "Where is Alpha?", "golden_answers": ["Paris"], "seed": 3}) + "\n")
    assert task_class(ScriptArguments()) is SearchTask and SearchTask.heldout
    assert task_class(ScriptArguments(environment="mempo_trl.kit.envs.KeyVaultEnv")) is EnvironmentTask
    assert not EnvironmentTask.heldout
    assert EnvironmentTask.read_rows(str(rows), "test")[0]["seed"] == 3  # reset rows: every field kept, no split
    assert SearchTask.read_rows(str(rows), str(rows))[0]["question"] == "Where is Alpha?"  # a split that is a file

    info = {"retriever_arg": "http://h:8000", "example_question": "Where is Alpha?"}
    search = SearchTask(retriever=object()).usage("you/agent", info)
    assert 'from_pretrained("you/agent", retriever="http://h:8000")' in search
    assert "mempo-trl ask 'Where is Alpha?' --model_name_or_path you/agent --retriever_url http://h:8000" in search
    environment = EnvironmentTask(KeyVaultEnv).usage("you/agent", info)
    assert "from mempo_trl.kit.envs import KeyVaultEnv" in environment
    assert 'from_pretrained("you/agent", environment_factory=KeyVaultEnv)' in environment
    assert "retriever" not in environment
