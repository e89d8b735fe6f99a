"""Contexts longer than the generation backend takes (`context_overflow`): the episode ends, or the
`<information>` blocks are cut; never a crash. Unit tests on the rollout, then the trainer on TRL's vLLM colocate
path with a fake engine that rejects long prompts as vLLM does."""

import fake_vllm
import pytest
from datasets import Dataset
from helpers import cpu_config

from mempo_trl import MemPOTrainer
from mempo_trl.context import TurnProtocol, initial_messages, render_prompt
from mempo_trl.kit.tiny import load_tiny
from mempo_trl.retrieval import Passage
from mempo_trl.rollout import RolloutEngine


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

    protocol = TurnProtocol(max_turns=3, context_mode=context_mode)
    engine = RolloutEngine(tokenizer, protocol, Retriever(), max_prompt_length=limit, context_overflow=mode)
    rows = [{"question": f"Q{k}?", "golden_answers": ["x"]} for k in range(2)]
    episodes, _ = engine.run(rows, generate)
    return episodes, prompts_seen


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tiny(tiny_model_dir)[1]


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
    first, second = (r.information for r in episodes[0].rounds[:2])
    assert first.endswith(" ...</information>") and "word119" not in first
    if context_mode == "memory":
        assert "word0" in first and "word0" in second
        assert first in tokenizer.decode(prompts[2], skip_special_tokens=False)  # the record is what was shown
    else:  # the oldest block is cut first: round 1's result is emptied before round 2's is cut
        assert first == "<information> ...</information>" and second.endswith(" ...</information>")
        assert first in tokenizer.decode(prompts[-2], skip_special_tokens=False)
    assert episodes[1].rounds[0].information.endswith("short</information>")  # untouched


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
