"""TRL's transformers continuous-batching generation (`use_transformers_continuous_batching`) stops MemPO turns at
``</search>`` / ``</answer>``: `ContinuousBatchingStops` on transformers' own request state, the trainer's wiring, and
one real `generate_batch` run.
"""

import pytest
from datasets import Dataset
from helpers import EchoRetriever, cpu_config
from transformers import GenerationConfig
from transformers.generation.continuous_batching import RequestState, RequestStatus

from mempo_trl import MemPOTrainer
from mempo_trl.kit.tiny import load_tiny
from mempo_trl.loading import load_tokenizer
from mempo_trl.stopping import ContinuousBatchingStops


TURN = "<mem>alpha</mem>\n<think>search</think>\n<search>alpha</search>"
CHATTER = "<information>Doc 1(Title: invented) more</information>"


def _decoding_request(max_new_tokens=64, eos=None):
    state = RequestState(request_id="r", initial_tokens=[1, 2], max_new_tokens=max_new_tokens, eos_token_id=eos)
    state.status = RequestStatus.DECODING
    return state


def _feed(state, ids) -> int | None:
    """Feed ``ids`` one by one as continuous batching does; the 1-based count at which the request completed."""
    for n, token in enumerate(ids, start=1):
        if state.update_and_check_completion(token, None):
            return n
    return None


@pytest.mark.parametrize("tokenizer_name", ["tiny", "qwen2.5", "smollm2"])
def test_a_request_ends_on_the_token_completing_the_action_tag(tokenizer_name, tiny_model_dir, request):
    if tokenizer_name == "smollm2":
        tokenizer = request.getfixturevalue("smollm2_tokenizer")
    else:
        model_dir = tiny_model_dir if tokenizer_name == "tiny" else request.getfixturevalue("qwen_model_dir")
        tokenizer = load_tokenizer(model_dir)
    stops = ContinuousBatchingStops(tokenizer)
    ids = tokenizer(TURN + CHATTER, add_special_tokens=False)["input_ids"]
    # The shortest prefix whose text holds the whole turn: the tag's last token (under Qwen2.5, `><` with the chatter).
    kept = next(k for k in range(1, len(ids) + 1) if tokenizer.decode(ids[:k]).startswith(TURN))
    with stops.active():
        state = _decoding_request()
        assert _feed(state, ids) == kept
        assert state.status == RequestStatus.FINISHED and state.generated_tokens == ids[:kept]
        answer = tokenizer("<mem>m</mem><answer>Rome</answer> and more", add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(answer[: _feed(_decoding_request(), answer)]).endswith("</answer>")
        # eos and the token budget still end requests as before.
        assert _feed(_decoding_request(eos=ids[3]), ids) == 4
        assert _feed(_decoding_request(max_new_tokens=5), ids) == 5
        # </mem> and </think> close tags too, but not actions.
        assert (
            _feed(
                _decoding_request(), tokenizer("<mem>a</mem><think>b</think> x", add_special_tokens=False)["input_ids"]
            )
            is None
        )
    assert _feed(_decoding_request(), ids) is None  # restored: transformers alone does not stop on strings


def test_trainer_generates_under_the_stops_with_continuous_batching(tiny_model_dir, tmp_path, monkeypatch):
    model, tokenizer = load_tiny(tiny_model_dir)
    args = cpu_config(tmp_path, per_device_train_batch_size=2, max_turns=1, use_transformers_continuous_batching=True)
    dataset = Dataset.from_list([{"question": "Where is Alpha?", "golden_answers": ["Paris"]}])
    trainer = MemPOTrainer(model, EchoRetriever(), args=args, train_dataset=dataset, processing_class=tokenizer)
    original = RequestState.update_and_check_completion
    seen = []

    def single_turn(prompt_ids, *args, **kwargs):
        seen.append(RequestState.update_and_check_completion is not original)
        return [tokenizer(TURN, add_special_tokens=False)["input_ids"] for _ in prompt_ids], None

    monkeypatch.setattr(trainer, "_generate_single_turn", single_turn)
    completions, _ = trainer._generate_turns([[1, 2, 3], [4, 5]])
    assert seen == [True] and len(completions) == 2
    assert RequestState.update_and_check_completion is original
    assert trainer.action_stopping_criteria is None  # `generate` is not what runs


@pytest.mark.slow
def test_generate_batch_stops_each_request_at_its_stop_string(tiny_model_dir):
    """A real continuous-batching run on the CPU, greedy; the stop string is what the model writes at tokens 9-10 of
    the first prompt (found with plain `generate`)."""
    import torch

    model, tokenizer = load_tiny(tiny_model_dir)
    model.eval()
    prompts = [
        tokenizer(f"<|im_start|>user\nq{k}<|im_end|>\n", add_special_tokens=False)["input_ids"] for k in range(4)
    ]
    config = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=-1, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        greedy = model.generate(torch.tensor([prompts[0]]), generation_config=config)[0, len(prompts[0]) :].tolist()
    stop = tokenizer.decode(greedy[8:10])
    assert stop
    stops = ContinuousBatchingStops(tokenizer, stops=(stop,))
    with stops.active():
        outputs = model.generate_batch(prompts, generation_config=config, progress_bar=False, warmup=False)
    lengths = []
    for output in outputs.values():
        ids = list(output.generated_tokens)
        first = next((k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k])), None)
        assert len(ids) == (first or 24)  # ended on the token that completed the stop string, or ran to the budget
        lengths.append(len(ids))
    assert min(lengths) <= 10  # the first prompt stopped there
