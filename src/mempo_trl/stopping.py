"""Ending a turn on its action tag during generation, whatever the tag's tokenization.

The trainer (TRL's HF generate and transformers continuous batching) and `mempo_trl.generation.HFGenerator` stop
each sequence once it has written one of a `mempo_trl.protocol.TurnProtocol`'s ``stops`` (``</search>``,
``</answer>``; an environment's ``</tool_call>``); vLLM takes them as stop strings.
"""

from collections.abc import Sequence
from contextlib import contextmanager

from mempo_trl.turns import ACTION_STOPS


def action_stopping_criteria(tokenizer, stops: Sequence[str] = ACTION_STOPS):
    """Stopping criteria for `model.generate` that end each sequence on its own once it has written ``</search>`` or
    ``</answer>`` (``stops``; an environment's are `mempo_trl.turns.TOOL_STOPS`), whatever their tokenization
    (the token completing the tag may also hold what follows, e.g. ``><``).

    Build it once per tokenizer (it indexes the whole vocabulary) and pass it as
    ``generate(..., stopping_criteria=...)``.

    Example:
        >>> model.generate(input_ids, stopping_criteria=action_stopping_criteria(tokenizer))  # doctest: +SKIP
    """
    from transformers import StoppingCriteriaList, StopStringCriteria

    return StoppingCriteriaList([StopStringCriteria(tokenizer, list(stops))])


class ContinuousBatchingStops:
    """Stop strings for transformers' continuous batching (`model.generate_batch`, which TRL runs for
    ``use_transformers_continuous_batching``): it stops a request only on an eos id or at its token budget, and takes
    no stopping criteria. While `active()` is entered, a request also ends as soon as its generated text holds
    ``</search>`` or ``</answer>`` (the token completing the tag is kept, as with `action_stopping_criteria`).

    This patches `transformers.generation.continuous_batching.RequestState.update_and_check_completion` (transformers
    5.23-5.25), the one place where continuous batching decides that a request is complete, and restores it on exit.
    Only a token whose text holds a tag's last character triggers a look at the last tokens' text.

    Example:
        >>> stops = ContinuousBatchingStops(tokenizer)  # doctest: +SKIP
        >>> with stops.active():  # doctest: +SKIP
        ...     outputs = model.generate_batch(prompt_ids, generation_config=config)
    """

    def __init__(self, tokenizer, stops: Sequence[str] = ACTION_STOPS):
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        last_chars = {stop[-1] for stop in self.stops}
        vocab = range(len(tokenizer))
        texts = tokenizer.batch_decode([[i] for i in vocab])
        self.closing_ids = frozenset(i for i, text in zip(vocab, texts) if any(c in text for c in last_chars))
        # Enough tokens to hold the longest tag, however it is split (every token holds at least one character).
        self.tail_tokens = max(len(stop) for stop in self.stops) + 1

    def ends_turn(self, generated: Sequence[int]) -> bool:
        """True when the last generated token completes an action tag (``generated`` holds no earlier tag)."""
        if not generated or generated[-1] not in self.closing_ids:
            return False
        tail = self.tokenizer.decode(list(generated[-self.tail_tokens :]))
        return any(stop in tail for stop in self.stops)

    @contextmanager
    def active(self):
        """Make continuous batching end requests on the tags while the block runs."""
        from transformers.generation.continuous_batching import RequestState, RequestStatus

        original = RequestState.update_and_check_completion
        stops = self

        def update_and_check_completion(state, token_id, logprob):
            if original(state, token_id, logprob):
                return True
            if stops.ends_turn(state.generated_tokens):
                state.status = RequestStatus.FINISHED
                return True
            return False

        RequestState.update_and_check_completion = update_and_check_completion
        try:
            yield
        finally:
            RequestState.update_and_check_completion = original
