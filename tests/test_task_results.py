"""A task renders (and, with ``context_overflow="truncate_information"``, shortens) its own results: the rollout cuts
the result a task returned by tokens and asks the task to render what is left, so that a plain-text result (a
TRL-style environment's tool) keeps its first characters and gains no tags, and a search result keeps its
``<information>`` block. Played through the real rollout, for the search task and an environment task."""

from helpers import turn

from mempo_trl.kit.tiny import load_tiny
from mempo_trl.protocol import TurnProtocol
from mempo_trl.retrieval import Passage
from mempo_trl.rollout import RolloutEngine
from mempo_trl.tasks import EnvironmentTask, SearchTask


LONG = " ".join(f"word{i}" for i in range(120))


class Notes:
    """An environment whose one tool returns a long plain-text result."""

    def reset(self, **row) -> str:
        return "Read the note."

    def read(self, page: int) -> str:
        """Read a page.

        Args:
            page: the page number.
        """
        return f"RESULT: {LONG}"


class Retriever:
    def search(self, queries, topk):
        return [[Passage(id=q, title="T", text=f"RESULT: {LONG}")] for q in queries]


CALL = '<tool_call>{"name": "read", "arguments": {"page": 1}}</tool_call>'


def _play(tokenizer, task, action_turn):
    """Round 1 acts (a long result), round 2 answers. Played twice: without a budget, then with one halfway between
    the two contexts' lengths, which leaves room for part of the result only."""
    lengths = []

    def generate(prompts):
        lengths.extend(len(ids) for ids in prompts)
        texts = [tokenizer.decode(ids) for ids in prompts]
        turns = [turn("Paris", "answer", "Paris") if "RESULT" in text else action_turn for text in texts]
        return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in turns], None

    rows = [{"question": "Where?", "golden_answers": ["Paris"]}]
    RolloutEngine(tokenizer, TurnProtocol(max_turns=3), task=task).play(rows, generate)
    budget = (lengths[0] + lengths[1]) // 2
    protocol = TurnProtocol(max_turns=3, context_overflow="truncate_information", max_context_tokens=budget)
    (episode,) = RolloutEngine(tokenizer, protocol, task=task).play(rows, generate).episodes
    assert max(lengths[2:]) <= budget
    return episode


def test_a_plain_text_result_is_cut_at_its_end_and_not_wrapped(tiny_model_dir):
    tokenizer = load_tiny(tiny_model_dir)[1]
    episode = _play(tokenizer, EnvironmentTask(Notes), "<mem>m</mem><think>t</think>" + CALL)
    assert episode.rounds[0].information == f"RESULT: {LONG}"  # the record keeps the result whole
    shown = episode.shown_information(0)
    assert shown.startswith("RESULT: word0 word1") and shown.endswith(" ...") and "word119" not in shown
    assert "<information>" not in shown and "</information>" not in shown
    assert episode.answer == "Paris" and not episode.context_overflow


def test_a_search_result_is_cut_inside_its_information_block(tiny_model_dir):
    tokenizer = load_tiny(tiny_model_dir)[1]
    episode = _play(tokenizer, SearchTask(Retriever()), turn("m", "search", "where"))
    assert episode.rounds[0].information == f"<information>Doc 1(Title: T) RESULT: {LONG}</information>"
    shown = episode.shown_information(0)
    assert shown.startswith("<information>Doc 1(Title: T) RESULT: word0") and shown.endswith(" ...</information>")
    assert "word119" not in shown and shown.count("<information>") == 1
    assert episode.answer == "Paris" and not episode.context_overflow
