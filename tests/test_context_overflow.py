"""Contexts longer than the generation backend takes or the context budget allows (`context_overflow`,
`max_context_tokens`): the episode ends, or the `<information>` blocks are cut; never a crash. Unit tests on the
rollout, then the trainer on TRL's vLLM colocate path with a fake engine that rejects long prompts as vLLM does, and
the budget through a scripted trainer step and agent episodes."""

import dataclasses
import json

import fake_vllm
import pytest
from datasets import Dataset
from helpers import EchoRetriever, cpu_config

from mempo_trl import MemPOAgent, MemPOTrainer
from mempo_trl.agent import AgentResult
from mempo_trl.context import (
    DEFAULT_INSTRUCTION,
    DEFAULT_SYSTEM_PROMPT,
    initial_messages,
    render_information,
    render_prompt,
)
from mempo_trl.evaluation import episode_record, evaluate
from mempo_trl.kit.tiny import load_tiny
from mempo_trl.protocol import PROTOCOL_FILE, TurnProtocol
from mempo_trl.retrieval import Passage
from mempo_trl.rollout import RolloutEngine, memory_scoring_items


LONG = " ".join(f"word{i}" for i in range(120))


class Retriever:
    """A long passage for queries with "long" in them, a short one otherwise."""

    def search(self, queries, topk):
        return [[Passage(id=q, title=q, text=LONG if "long" in q else "short")] for q in queries]


def turn(k, t, action="search"):
    return f"<mem>m{k}{t}</mem><think>t</think><{action}>{'long' if k == 0 else 'brief'} {t}</{action}>"


def play(tokenizer, limit, mode, context_mode="memory"):
    """Episode 0 searches with long results, episode 1 with short ones; both answer in round 3."""
    prompts_seen = []

    def generate(prompts):
        prompts_seen.extend(prompts)
        outs = []
        for ids in prompts:
            text = tokenizer.decode(ids, skip_special_tokens=False)
            k = 0 if "Q0" in text else 1
            t = text.count("<mem>m") + 1 if context_mode == "full_history" else (2 if "<mem>m" in text else 1)
            if context_mode == "memory" and f"<mem>m{k}2" in text:
                t = 3
            outs.append(tokenizer(turn(k, t, "answer" if t == 3 else "search"), add_special_tokens=False)["input_ids"])
        return outs, None

    protocol = TurnProtocol(max_turns=3, context_mode=context_mode, context_overflow=mode)
    engine = RolloutEngine(tokenizer, protocol, Retriever(), max_prompt_length=limit)
    rows = [{"question": f"Q{k}?", "golden_answers": ["x"]} for k in range(2)]
    episodes = engine.play(rows, generate).episodes
    return episodes, prompts_seen


@pytest.fixture(scope="module", params=["tiny", "qwen2.5", "smollm2"])
def tokenizer(request, tiny_model_dir):
    """The tiny tokenizer and the real ones (context budgets count their tokens)."""
    if request.param == "tiny":
        return load_tiny(tiny_model_dir)[1]
    return request.getfixturevalue("qwen_tokenizer" if request.param == "qwen2.5" else "smollm2_tokenizer")


def _limit(tokenizer):
    """Room for a round-2 context with a short result, not with the long one."""
    return len(render_prompt(tokenizer, initial_messages("Q0?"))) + 160


def test_overflow_ends_the_episode(tokenizer):
    limit = _limit(tokenizer)
    episodes, prompts = play(tokenizer, limit, "end_episode")
    assert max(len(p) for p in prompts) <= limit
    assert [len(ep.rounds) for ep in episodes] == [1, 3]
    assert [ep.context_overflow for ep in episodes] == [True, False]
    assert episodes[0].answer is None and episodes[1].answer is not None


@pytest.mark.parametrize("context_mode", ["memory", "full_history"])
def test_overflow_cuts_the_information_block(tokenizer, context_mode):
    limit = _limit(tokenizer)
    episodes, prompts = play(tokenizer, limit, "truncate_information", context_mode)
    assert max(len(p) for p in prompts) <= limit
    assert [len(ep.rounds) for ep in episodes] == [3, 3]
    assert not any(ep.context_overflow for ep in episodes)
    first, second = (episodes[0].shown_information(t) for t in range(2))
    assert first.endswith(" ...</information>") and "word119" not in first
    if context_mode == "memory":
        assert "word0" in first and "word0" in second
        assert first in tokenizer.decode(prompts[2], skip_special_tokens=False)
    else:  # the oldest block is cut first: round 1's result is emptied before round 2's is cut
        assert first == "<information> ...</information>" and second.endswith(" ...</information>")
        assert first in tokenizer.decode(prompts[-2], skip_special_tokens=False)
    assert episodes[1].rounds[0].information.endswith("short</information>")  # untouched
    assert episodes[1].cut_information == {}


def test_a_cut_result_is_shown_short_and_kept_whole_in_its_record(tokenizer):
    episodes, prompts = play(tokenizer, _limit(tokenizer), "truncate_information")
    episode = episodes[0]
    full = render_information([Passage(id="long 1", title="long 1", text=LONG)])
    assert episode.rounds[0].information == full  # the record: what the retriever returned
    shown = episode.shown_information(0)
    assert shown == episode.cut_information[0] and shown.endswith(" ...</information>") and len(shown) < len(full)
    round2 = tokenizer.decode(prompts[2], skip_special_tokens=False)  # episode 0's round-2 context
    assert shown in round2 and full not in round2
    assert episode.history()[0] == (episode.rounds[0].text, shown)
    (pair, _) = memory_scoring_items(episode, tokenizer)  # P_full is scored after the context the model saw
    assert pair.round_index == 1 and shown in tokenizer.decode(pair.full.context_ids, skip_special_tokens=False)
    # The trajectories file and `AgentResult` show what the contexts showed.
    assert episode_record(episode)["rounds"][0]["information"] == shown
    assert AgentResult.from_episode(episode).turns[0]["information"] == shown


def test_a_round_record_is_frozen_and_a_training_row_refers_to_it(tiny_model_dir):
    tokenizer = load_tiny(tiny_model_dir)[1]
    engine = RolloutEngine(tokenizer, TurnProtocol(max_turns=3), EchoRetriever())
    rollout = engine.play(
        [{"question": "Where?"}], lambda prompts: ([scripted_turn(tokenizer, p) for p in prompts], None)
    )
    record = rollout.episodes[0].rounds[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.information = "<information>rewritten</information>"
    assert record.information == "<information>Doc 1(Title: T alpha) about alpha</information>"
    row = rollout.rows[0]
    assert row.record is record and (row.episode_index, row.round_index) == (0, 0)
    assert (row.prompt_ids, row.completion_ids, row.logprobs) == (record.prompt_ids, record.completion_ids, None)
    assert (row.truncated, row.memory) == (False, "<mem>one</mem>")
    first, last = row.mem_span
    assert tokenizer.decode(row.completion_ids[first : last + 1]) == "<mem>one</mem>"


def test_first_context_too_long_is_an_error_naming_the_question(tokenizer):
    with pytest.raises(ValueError, match="Q0"):
        play(tokenizer, 20, "end_episode")


@pytest.mark.parametrize("mode", ["end_episode", "truncate_information"])
def test_trainer_on_vllm_never_sends_a_prompt_over_the_limit(tiny_model_dir, tmp_path, monkeypatch, mode):
    for name, value in fake_vllm.colocate_env().items():
        monkeypatch.setenv(name, value)  # TRL's colocate init writes these; monkeypatch restores them
    monkeypatch.setattr(fake_vllm, "SERVER_MODEL_DIR", [])
    fake_vllm.install(tiny_model_dir)
    model, tokenizer = load_tiny(tiny_model_dir)
    args = cpu_config(
        tmp_path,
        max_turns=4,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=200 + 32,
        context_overflow=mode,
        disable_tqdm=True,
    )
    dataset = Dataset.from_list([{"question": f"Q{k} where?", "golden_answers": [f"A{k}"]} for k in (2, 3)])
    retriever = Retriever()
    retriever.search = lambda queries, topk: [[Passage(id=q, title=q, text=LONG)] for q in queries]
    trainer = MemPOTrainer(model, retriever, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    engine = fake_vllm.engine_of(trainer)  # it raises on a prompt longer than vllm_max_model_length, as vLLM
    logged = trainer.state.log_history[0]
    if mode == "end_episode":
        assert logged["episode/context_overflow"] == 1.0  # every episode searched and overflowed in round 2
        assert logged["episode/turns"] == 1.0 and engine.counters.generate_calls == 1
    else:
        assert logged["episode/context_overflow"] == 0.0
        assert logged["episode/turns"] == 3.5  # Q2 answers in round 3, Q3 in round 4 (fake_vllm.end_round)
        assert engine.counters.generate_calls == 4 and logged["episode/em"] == 1.0


# The context budget (`max_context_tokens`): a scripted policy searches twice, then answers.
BUDGET_TURNS = [
    "<mem>one</mem><think>t</think><search>alpha</search>",
    "<mem>two</mem><think>t</think><search>beta</search>",
    "<mem>three</mem><think>t</think><answer>Paris</answer>",
]


def scripted_turn(tokenizer, prompt_ids):
    """The next scripted turn: round 3 once turn 2 is in the context, round 2 once turn 1 is, else round 1."""
    text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
    t = 2 if BUDGET_TURNS[1] in text else 1 if BUDGET_TURNS[0] in text else 0
    return tokenizer(BUDGET_TURNS[t], add_special_tokens=False)["input_ids"]


def budget_and_full_round3(tokenizer) -> tuple[int, int]:
    """By hand, in ChatML: the budget is the longest memory-mode context (round 2: question + turn 1 + result 1,
    round 3: question + turn 2 + result 2); full history's round 3 holds both turns and results, so it is longer."""
    base = (
        f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{DEFAULT_INSTRUCTION.format(question='Where?')}<|im_end|>\n"
    )

    def block(turn, query):
        return (
            f"<|im_start|>assistant\n{turn}<|im_end|>\n<|im_start|>user\n<tool_response>\n"
            f"<information>Doc 1(Title: T {query}) about {query}</information>\n</tool_response><|im_end|>\n"
        )

    one, two, gen = block(BUDGET_TURNS[0], "alpha"), block(BUDGET_TURNS[1], "beta"), "<|im_start|>assistant\n"
    length = [
        len(tokenizer(text, add_special_tokens=False)["input_ids"])
        for text in (base + one + gen, base + two + gen, base + one + two + gen)
    ]
    return max(length[:2]), length[2]


@pytest.mark.parametrize("context_mode", ["memory", "full_history"])
def test_budget_ends_a_full_history_episode_in_a_trainer_step(tiny_model_dir, tmp_path, monkeypatch, context_mode):
    model, tokenizer = load_tiny(tiny_model_dir)
    budget, full_round3 = budget_and_full_round3(tokenizer)
    assert full_round3 > budget  # and the backend's limit (4096 - 32) is far above both
    args = cpu_config(tmp_path, context_mode=context_mode, max_context_tokens=budget)
    dataset = Dataset.from_list([{"question": "Where?", "golden_answers": ["Paris"]}] * 4)
    trainer = MemPOTrainer(model, EchoRetriever(), args=args, train_dataset=dataset, processing_class=tokenizer)
    assert trainer.protocol.max_context_tokens == budget
    sent = []

    def scripted_generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        sent.extend(prompt_ids)
        return [scripted_turn(tokenizer, ids) for ids in prompt_ids], None

    monkeypatch.setattr(trainer, "_generate_single_turn", scripted_generate)
    trainer.model.train()
    out = trainer._generate_and_score_completions(list(dataset))
    metrics = trainer._metrics["train"]
    assert max(len(ids) for ids in sent) <= budget
    if context_mode == "memory":  # the budget never binds: 3 rounds, right answer
        assert out["completion_ids"].shape[0] == 4 * 3
        assert metrics["episode/context_overflow"][-1] == 0.0 and metrics["episode/em"][-1] == 1.0
    else:  # round 3 would exceed it: the episode ends after round 2, no answer (outcome 0), counted
        assert out["completion_ids"].shape[0] == 4 * 2
        assert metrics["episode/context_overflow"][-1] == 1.0 and metrics["episode/em"][-1] == 0.0
        assert metrics["episode/turns"][-1] == 2.0


def test_budget_binds_agent_episodes_and_evaluation_reports_it(tiny_model_dir):
    tokenizer = load_tiny(tiny_model_dir)[1]
    budget, full_round3 = budget_and_full_round3(tokenizer)

    def generate(prompts):
        return [scripted_turn(tokenizer, ids) for ids in prompts], None

    protocol = TurnProtocol(max_turns=3, max_context_tokens=budget)
    agent = MemPOAgent(tokenizer, EchoRetriever(), generate, protocol)
    rows = [{"question": "Where?", "golden_answers": ["Paris"]}]
    memory, full = (evaluate(agent, rows, context_mode=mode, progress=False) for mode in ("memory", "full_history"))
    assert memory.metrics["overall"]["context_overflow"] == 0.0 and memory.metrics["overall"]["em"] == 1.0
    assert max(r["prompt_tokens"] for r in memory.records[0]["rounds"]) == budget  # a context of the budget fits
    assert full.records[0]["context_overflow"] is True and full.records[0]["num_turns"] == 2
    assert full.metrics["overall"]["context_overflow"] == 1.0 and full.metrics["overall"]["em"] == 0.0
    # The backend's own limit, when larger, does not lift the budget (the smaller one binds).
    engine = RolloutEngine(
        tokenizer, protocol.override(context_mode="full_history")[0], EchoRetriever(), max_prompt_length=4096
    )
    episodes = engine.play(rows, generate).episodes
    assert episodes[0].context_overflow and len(episodes[0].rounds) == 2
    # truncate_information, the protocol's other rule: 3 tokens over, round 1's result is cut and the episode answers.
    for overflow, answer in (("end_episode", None), ("truncate_information", "Paris")):
        cut = TurnProtocol(
            max_turns=3, max_context_tokens=full_round3 - 3, context_mode="full_history", context_overflow=overflow
        )
        (episode,) = RolloutEngine(tokenizer, cut, EchoRetriever()).play(rows, generate).episodes
        assert (episode.context_overflow, episode.answer) == (answer is None, answer)
    assert episode.shown_information(0).endswith(" ...</information>")


def test_first_context_over_the_budget_is_an_error_naming_it(tokenizer):
    engine = RolloutEngine(tokenizer, TurnProtocol(max_context_tokens=10), Retriever(), max_prompt_length=4000)
    with pytest.raises(ValueError, match="max_context_tokens=10: raise it"):
        engine.play([{"question": "Q0?"}], lambda prompts: ([[0]] * len(prompts), None))


def test_budget_is_validated_carried_saved_and_optional(tmp_path):
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="max_context_tokens must be"):
            TurnProtocol(max_context_tokens=bad)
    with pytest.raises(ValueError, match="max_context_tokens must be a positive integer"):
        cpu_config(tmp_path, max_context_tokens=0)
    with pytest.raises(ValueError, match="max_context_tokens must be an integer"):
        cpu_config(tmp_path, max_context_tokens=2.5)
    assert cpu_config(tmp_path).max_context_tokens is None
    config = cpu_config(tmp_path, max_context_tokens=700, context_overflow="truncate_information")
    protocol = TurnProtocol.from_config(config)
    assert (protocol.max_context_tokens, protocol.context_overflow) == (700, "truncate_information")
    protocol.save(tmp_path)
    assert TurnProtocol.from_pretrained(tmp_path) == protocol
    old = {
        k: v
        for k, v in json.loads((tmp_path / PROTOCOL_FILE).read_text()).items()
        if k not in ("max_context_tokens", "context_overflow")
    }
    (tmp_path / PROTOCOL_FILE).write_text(json.dumps(old))  # a file saved before the budget existed
    loaded = TurnProtocol.from_pretrained(tmp_path)
    assert (loaded.max_context_tokens, loaded.context_overflow) == (None, "end_episode")
    assert loaded.context_limit(3584) == 3584 and protocol.context_limit(3584) == 700
    assert protocol.context_limit(None) == 700 and TurnProtocol().context_limit(None) is None
