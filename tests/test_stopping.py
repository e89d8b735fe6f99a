"""HF generation stops at ``</search>`` / ``</answer>`` as strings, per sequence, under Qwen2.5's real tokenizer.

A random Qwen2.5-shaped model is scripted (its logits are overwritten) to write a turn and then keep talking; the
trainer's HF generation (TRL's `_generate_single_turn`) and the evaluation `HFGenerator` must both stop right after
the token that completes the action tag, each sequence on its own.
"""

import pytest
import torch
from datasets import Dataset
from helpers import EchoRetriever, cpu_config
from transformers import Qwen2ForCausalLM

from mempo_trl import MemPOTrainer
from mempo_trl.context import initial_messages, render_prompt
from mempo_trl.generation import HFGenerator
from mempo_trl.loading import load_tokenizer
from mempo_trl.protocol import TurnProtocol
from mempo_trl.rollout import RolloutEngine


CHATTER = "<information>Doc 1(Title: invented) and so on and so on</information>\n" * 4


class _FreeHead(torch.nn.Module):
    """Stands in for the 151,936-row LM head, whose logits the script overwrites anyway (keeps the tests fast)."""

    def __init__(self, vocab_size):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, hidden):
        return hidden.new_zeros(*hidden.shape[:-1], self.vocab_size)


def script_model(model, continuation_for):
    """Make greedy `model.generate` write `continuation_for(prompt_ids)` for every row, then eos."""
    model.lm_head = _FreeHead(model.config.vocab_size)
    forward = model.forward
    state = {}

    def scripted(*args, input_ids=None, **kwargs):
        out = forward(*args, input_ids=input_ids, **kwargs)
        if input_ids.shape[1] > 1:  # prefill: remember each row's script (prompts are left-padded)
            pad = model.generation_config.pad_token_id
            state["step"], state["scripts"] = (
                0,
                [continuation_for([t for t in row if t != pad]) for row in input_ids.tolist()],
            )
        n = state["step"]
        state["step"] += 1
        logits = torch.full_like(out.logits, -1e4)
        for i, script in enumerate(state["scripts"]):
            logits[i, -1, script[n] if n < len(script) else model.generation_config.eos_token_id[0]] = 1e4
        out.logits = logits
        return out

    model.forward = scripted
    return model


TURNS = {
    "Where is Alpha?": "<mem>nothing</mem>\n<think>search</think>\n<search>alpha</search>",
    "Where is Beta?": "<mem>beta</mem><think>know it</think><answer>Rome</answer>",
    "Where is Gamma?": "<mem>gamma</mem><think>hmm</think>" + "still thinking " * 20,  # no action: runs to the cap
}


def _continuation(tokenizer):
    def continuation_for(prompt_ids):
        text = tokenizer.decode(prompt_ids)
        question = next(q for q in TURNS if q in text)
        return tokenizer(TURNS[question] + CHATTER, add_special_tokens=False).input_ids

    return continuation_for


def _kept(tokenizer, turn):
    ids = tokenizer(turn + CHATTER, add_special_tokens=False).input_ids
    return next(ids[:k] for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).startswith(turn))


def test_hf_generator_stops_each_sequence_at_its_action_string(qwen_model_dir):
    tokenizer = load_tokenizer(qwen_model_dir)
    model = script_model(Qwen2ForCausalLM.from_pretrained(qwen_model_dir), _continuation(tokenizer))
    prompts = [render_prompt(tokenizer, initial_messages(q)) for q in TURNS]
    completions, _ = HFGenerator(model, tokenizer, max_new_tokens=48, batch_size=3)(prompts)
    pad = tokenizer.pad_token_id
    alpha, beta, gamma = ([t for t in c if t != pad] for c in completions)
    assert alpha == _kept(tokenizer, TURNS["Where is Alpha?"])
    assert tokenizer.convert_ids_to_tokens(alpha[-1:]) == ["><"]  # `>` + `<` of the chatter: kept as sampled
    assert beta == _kept(tokenizer, TURNS["Where is Beta?"])
    assert tokenizer.convert_ids_to_tokens(beta[-1:]) == ["><"]
    assert len(gamma) == 48


@pytest.fixture
def qwen_trainer(qwen_model_dir, tmp_path):
    tokenizer = load_tokenizer(qwen_model_dir)
    model = script_model(Qwen2ForCausalLM.from_pretrained(qwen_model_dir), _continuation(tokenizer))
    dataset = Dataset.from_list([{"question": q, "golden_answers": ["x"], "data_source": "demo"} for q in TURNS])
    args = cpu_config(
        tmp_path,
        per_device_train_batch_size=3,
        num_generations=3,
        max_completion_length=48,
        max_turns=1,
    )
    return MemPOTrainer(model, EchoRetriever(), args=args, train_dataset=dataset, processing_class=tokenizer)


def test_trainer_hf_generation_stops_at_action_strings(qwen_trainer, monkeypatch):
    trainer = qwen_trainer
    tokenizer = trainer.processing_class
    generated = []
    single_turn = trainer._generate_single_turn

    def recording(*args, **kwargs):
        completions, logprobs = single_turn(*args, **kwargs)
        generated.extend(len(c) for c in completions)
        return completions, logprobs

    monkeypatch.setattr(trainer, "_generate_single_turn", recording)
    rows = [{"question": q, "golden_answers": ["x"]} for q in TURNS]
    episodes = trainer.rollout_engine.play(rows, trainer._generate_turns).episodes
    alpha, beta, gamma = (ep.rounds[0] for ep in episodes)
    assert alpha.turn.valid and beta.turn.valid and not gamma.turn.valid
    assert alpha.completion_ids == _kept(tokenizer, TURNS["Where is Alpha?"])
    assert beta.completion_ids == _kept(tokenizer, TURNS["Where is Beta?"])
    assert gamma.truncated and len(gamma.completion_ids) == 48
    # TRL keeps each completion up to its first eos (the pad after a string stop): at most one token past the tag.
    assert generated[0] <= len(alpha.completion_ids) + 1 and generated[1] <= len(beta.completion_ids) + 1
    assert "generate" not in vars(trainer.model)  # the binding is undone after each call


def test_rollout_cuts_vllm_style_outputs_by_the_same_policy(real_tokenizer):
    """vLLM stops on the strings and returns every sampled id up to the one completing the tag (plus eos)."""
    tok = real_tokenizer
    turn = TURNS["Where is Beta?"]
    sampled = _kept(tok, turn) + [tok.eos_token_id]
    engine = RolloutEngine(tok, TurnProtocol(max_turns=1), EchoRetriever(), eos_token_ids=[tok.eos_token_id])
    (episode,) = engine.play(
        [{"question": "Where is Beta?"}], lambda prompts: ([sampled], [[-0.5] * len(sampled)])
    ).episodes
    record = episode.rounds[0]
    assert record.text == turn and record.turn.valid and record.completion_ids == sampled[:-1]
    assert record.logprobs == [-0.5] * len(record.completion_ids)
