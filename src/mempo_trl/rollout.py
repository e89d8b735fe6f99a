"""Multi-turn episodes with the MemPO context rebuild (docs/algorithm.md, "Turn protocol", "Context rebuild").

`RolloutEngine.play` plays a batch of episodes round by round: it renders each active episode's context with
`mempo_trl.context`, asks a generation function for one turn per episode, cuts each turn after its action,
parses it with `mempo_trl.turns.parse_turn`, runs the round's tool actions, and ends an episode on ``<answer>``,
on an invalid turn, or at ``max_turns``. The environment is either the built-in search task (``<search>`` actions,
all of a round answered with one batched retriever call) or a TRL-style environment (`mempo_trl.environments`: one
instance per episode, ``reset(**row)``, one ``<tool_call>`` per turn run on that instance). The generation function
is the only backend-specific piece: the trainer passes TRL's generation (HF or vLLM), the evaluator its own, so that
training, evaluation and inference see exactly the same contexts. `play` returns a frozen `Rollout`: the episodes, whose
rounds are frozen `RoundRecord`s, and one `TrainingRow` per round, referring to its record.
"""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Any

from tokenizers import Tokenizer

from mempo_trl.context import (
    MemoryScoringPair,
    ScoringItem,
    gold_answer_encoding,
    memory_context_ids,
    render_prompt,
    round_messages,
    shown_rounds,
)
from mempo_trl.data import DataError
from mempo_trl.environments import EnvironmentFactory
from mempo_trl.offsets import locate_char_span, token_char_offsets
from mempo_trl.protocol import TurnProtocol
from mempo_trl.retrieval.base import RetrieverOutage
from mempo_trl.tasks import Task, make_task
from mempo_trl.turns import ACTION_STOPS, Turn, parse_turn


GenerateFn = Callable[[list[list[int]]], tuple[list[list[int]], list[list[float]] | None]]
"""Maps prompts (token id lists) to one completion each (token id lists) and, optionally, their sampling log-probs.
One whose ``takes_messages`` attribute is true (a chat endpoint, `mempo_trl.endpoint`) is also given each prompt's
context messages, as ``messages=``; one whose ``takes_episodes`` attribute is true (a scripted teacher,
`mempo_trl.oracle.OracleTeacher`) each prompt's `Episode`, as ``episodes=``."""


@dataclass(frozen=True)
class RoundRecord:
    """One generated turn: the context it was sampled from and what came out. Frozen: the rollout replaces a record
    (`dataclasses.replace`) to add the round's result, and never rewrites one.

    ``mem_span`` holds the inclusive token indices of the ``<mem>...</mem>`` block inside ``completion_ids``;
    ``result`` is the text of the round's action result as the task returned it (`Task.act`) and ``information``
    the message the task renders it as (`Task.render_result`: the ``<information>`` block of a search, the text a
    tool returned), both None when the round ran no action. What later contexts show of it can be shorter
    (`Episode.shown_information`).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    turn: Turn
    mem_span: tuple[int, int] | None
    truncated: bool
    logprobs: list[float] | None = None
    information: str | None = None
    result: str | None = None


@dataclass
class Episode:
    """A question (or an environment's task) and the rounds played on it so far.

    ``environment`` is the TRL-style environment instance the episode plays (None for the search task) and ``tools``
    the JSON schemas of its tools, rendered in every context of the episode. ``cut_information`` maps a round's
    index to the shortened message that contexts show in place of its record's ``information``, for the rounds whose
    result ``context_overflow="truncate_information"`` cut (`RolloutEngine.fit_prompt`); ``cut_results`` maps it to
    the text kept of the result.
    """

    row: dict
    base_messages: list[dict[str, str]]
    rounds: list[RoundRecord] = field(default_factory=list)
    finished: bool = False
    context_overflow: bool = False
    question: str = ""
    environment: Any = None
    tools: list[dict] | None = None
    action_metric: str = "searches"
    cut_information: dict[int, str] = field(default_factory=dict)
    cut_results: dict[int, str] = field(default_factory=dict)

    @property
    def golden_answers(self) -> list[str] | None:
        """The gold answers: the row's ``golden_answers``, else the environment's ``golden_answers`` attribute (read
        after ``reset``), else None (no target: no exact match, no memory reward)."""
        golds = self.row.get("golden_answers")
        if golds is None:
            golds = getattr(self.environment, "golden_answers", None)
        if golds is None:
            return None
        return [golds] if isinstance(golds, str) else list(golds)

    @property
    def format_valid(self) -> bool:
        """Every round parsed as a valid turn and the episode ended on an answer."""
        return bool(self.rounds) and all(r.turn.valid for r in self.rounds) and self.answer is not None

    @property
    def answer(self) -> str | None:
        """The final answer, or None when the episode did not end on a valid ``<answer>``."""
        last = self.rounds[-1].turn if self.rounds else None
        return last.content if last is not None and last.valid and last.action == "answer" else None

    @property
    def num_searches(self) -> int:
        """Tool actions that were run: searches the retriever answered, or environment tool calls (an action written
        in the last allowed round is never run)."""
        return sum(1 for r in self.rounds if r.information is not None)

    def metrics(self) -> dict[str, float]:
        """The rollout's own numbers for one finished episode (the outcome ones, ``em``/``f1``/``sub_em``, are scored
        downstream: `mempo_trl.rewards.episode_metrics` puts them in front of these).

        ``format_valid``, ``answer_rate``, ``context_overflow`` are 0/1; ``turns`` counts rounds, and
        ``action_metric`` (the task's: ``searches``, ``tool_calls``) the actions that were run.
        """
        return {
            "format_valid": float(self.format_valid),
            "answer_rate": float(self.answer is not None),
            "turns": float(len(self.rounds)),
            self.action_metric: float(self.num_searches),
            "context_overflow": float(self.context_overflow),
        }

    def shown_information(self, round_index: int) -> str | None:
        """The result of round ``round_index`` (0-based) as later contexts show it: the record's ``information``, or
        its shortened text when the context was cut (``cut_information``)."""
        return self.cut_information.get(round_index, self.rounds[round_index].information)

    def history(self) -> list[tuple[str, str]]:
        """``(output, shown information)`` of every round that searched, oldest first: what contexts are rebuilt
        from (`shown_information`)."""
        return [(r.text, self.shown_information(t)) for t, r in enumerate(self.rounds) if r.information is not None]


@dataclass
class RolloutTimings:
    generation: float = 0.0
    retrieval: float = 0.0


def _special_ids(tokenizer) -> set[int]:
    """Ids that ``decode(..., skip_special_tokens=True)`` drops."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if isinstance(backend, Tokenizer):
        return {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
    return set(getattr(tokenizer, "all_special_ids", ()))


def cut_after_action(
    completion_ids: list[int], tokenizer, eos_token_ids: Sequence[int], stops: Sequence[str] = ACTION_STOPS
) -> tuple[list[int], str, bool]:
    """Apply the turn boundary policy: ``(kept ids, turn text, truncated)``.

    A turn ends after its first action stop (``</search>`` or ``</answer>``; an environment's are `TOOL_STOPS`). The kept ids run up to and including the token that
    completes the tag: when that token also holds what follows (``>`` + ``<`` is one Qwen token ``><``), it stays, as
    sampled, so that the training row keeps on-policy log-probs. The turn text (what is parsed, rebuilt into later
    contexts and rewarded) is the decoded text (special tokens skipped) cut exactly at the tag, so a turn is never
    invalid because of what follows its action. Without an action tag, everything is kept; the completion is
    *truncated* when it does not end on an eos token either (it hit the length budget).

    Example:
        >>> ids = qwen("<mem>m</mem><think>t</think><search>q</search><information>").input_ids  # doctest: +SKIP
        >>> kept, text, _ = cut_after_action(ids, qwen, [151645])  # doctest: +SKIP
        >>> qwen.decode(kept[-1:]), text[-9:]  # doctest: +SKIP
        ('><', '</search>')
    """
    kept, text, truncated, _ = _cut_turn(completion_ids, tokenizer, eos_token_ids, stops)
    return kept, text, truncated


def _cut_turn(
    completion_ids: list[int], tokenizer, eos_token_ids: Sequence[int], stops: Sequence[str]
) -> tuple[list[int], str, bool, Callable[[int, int], tuple[int, int] | None]]:
    """`cut_after_action`, plus a function that maps a ``[start, end)`` char span of the turn text to the inclusive
    span of the kept ids that hold it (None when no token does): the turn is decoded once, for both."""
    special = _special_ids(tokenizer)
    plain = [i for i, token in enumerate(completion_ids) if token not in special]
    text, offsets = token_char_offsets([completion_ids[i] for i in plain], tokenizer)

    def token_span(start: int, end: int) -> tuple[int, int] | None:
        span = locate_char_span(offsets, start, end)
        return None if span is None else (plain[span[0]], plain[span[1]])

    ends = [text.find(stop) + len(stop) for stop in stops if stop in text]
    if not ends:
        truncated = not completion_ids or completion_ids[-1] not in eos_token_ids
        return completion_ids, text, truncated, token_span
    cut = min(ends)
    last = next(k for k, (start, end) in enumerate(offsets) if start < cut <= end)
    return completion_ids[: plain[last] + 1], text[:cut], False, token_span


def memory_scoring_items(
    episode: Episode, tokenizer, chat_template_kwargs: dict | None = None
) -> list[MemoryScoringPair]:
    """The (full, mem) scoring pair of every round t >= 2 of ``episode`` that wrote a well-formed ``<mem>``; none
    when the episode has no gold answer (`Episode.golden_answers`). Contexts render the episode's tools, if any, and
    ``chat_template_kwargs`` (`render_prompt`)."""
    golds = episode.golden_answers
    if golds is None:
        return []
    answer_ids, answer_mask, parts = gold_answer_encoding(tokenizer, golds, episode.row.get("sub_answers") or None)
    answer_parts = tuple(parts)
    base_ids = episode.rounds[0].prompt_ids if episode.rounds else []  # round 1's context: system + user(question)
    history = episode.history()
    pairs = []
    for t, record in enumerate(episode.rounds):
        if t == 0 or record.turn.mem_chars is None or len(history) < t:
            continue
        full_messages = round_messages(episode.base_messages, history[:t], "full_history")
        full_ids = render_prompt(tokenizer, full_messages, episode.tools, chat_template_kwargs)
        start, end = record.turn.mem_chars
        mem_ids = memory_context_ids(tokenizer, base_ids, record.text[start:end])
        pairs.append(
            MemoryScoringPair(
                round_index=t,
                full=ScoringItem(full_ids, answer_ids, answer_mask),
                mem=ScoringItem(mem_ids, answer_ids, answer_mask),
                answer_parts=answer_parts,
            )
        )
    return pairs


@dataclass(frozen=True)
class TrainingRow:
    """One round of one episode as a training row: what the rollout hands to every later stage of a training step.

    ``episode_index`` indexes this process's episodes and ``round_index`` is 0-based (metric names count from 1);
    ``record`` is the round's `RoundRecord`: ``prompt_ids``, ``completion_ids``, ``logprobs``, ``truncated`` and
    ``mem_span`` (the inclusive token span of the ``<mem>`` block in ``completion_ids``) read its fields, and
    ``memory`` is the text of that block; ``scoring`` holds the two contexts and the gold answer of the memory reward
    (`memory_scoring_items`), None for a round that is not scored.
    """

    episode_index: int
    round_index: int
    record: RoundRecord
    scoring: MemoryScoringPair | None

    # Plain attribute reads of the record (`attrgetter`: no rollout code runs when a later stage reads them).
    prompt_ids = property(attrgetter("record.prompt_ids"))
    completion_ids = property(attrgetter("record.completion_ids"))
    logprobs = property(attrgetter("record.logprobs"))
    truncated = property(attrgetter("record.truncated"))
    mem_span = property(attrgetter("record.mem_span"))

    @property
    def memory(self) -> str | None:
        """The text of the round's ``<mem>`` block, None without one."""
        span = self.record.turn.mem_chars
        return None if span is None else self.record.text[span[0] : span[1]]


def training_rows(
    episodes: Sequence[Episode], tokenizer, score_memory: bool, chat_template_kwargs: dict | None = None
) -> tuple[TrainingRow, ...]:
    """One `TrainingRow` per round of ``episodes``, in episode then round order; with ``score_memory``, the rounds
    `memory_scoring_items` picks carry their scoring contexts (rendered with ``chat_template_kwargs``)."""
    rows = []
    for e, episode in enumerate(episodes):
        pairs = {}
        if score_memory:
            pairs = {p.round_index: p for p in memory_scoring_items(episode, tokenizer, chat_template_kwargs)}
        rows += [TrainingRow(e, t, record, pairs.get(t)) for t, record in enumerate(episode.rounds)]
    return tuple(rows)


@dataclass(frozen=True)
class Rollout:
    """What `RolloutEngine.play` returns: this process's finished ``episodes`` (in the order of its input rows), one
    `TrainingRow` per round of them (``rows``, in episode then round order) and the seconds spent generating and
    retrieving (``timings``). Evaluation and inference read the episodes; later stages of a training step read the
    rows and the episodes' answers, and none of them calls back into the rollout."""

    episodes: tuple[Episode, ...]
    rows: tuple[TrainingRow, ...]
    timings: RolloutTimings

    def splice(self, fresh: "Rollout", take: Sequence[bool]) -> "Rollout":
        """This rollout with the episodes ``take`` marks (one flag per episode) and their rows replaced by those of
        ``fresh``, a rollout of as many episodes; the timings add up."""
        episodes = tuple(b if t else a for a, b, t in zip(self.episodes, fresh.episodes, take))
        rows = [row for row in self.rows if not take[row.episode_index]]
        rows += [row for row in fresh.rows if take[row.episode_index]]
        rows.sort(key=lambda row: (row.episode_index, row.round_index))
        timings = RolloutTimings(
            self.timings.generation + fresh.timings.generation, self.timings.retrieval + fresh.timings.retrieval
        )
        return Rollout(episodes, tuple(rows), timings)


class RolloutEngine:
    """Plays MemPO episodes of a `Task` (a retriever's search task, a TRL-style environment, ...); generation is
    delegated to a `GenerateFn`.

    Args:
        tokenizer: the policy's tokenizer (with a chat template).
        protocol: the `TurnProtocol` (prompts, ``max_turns``, ``retrieval_topk``, ``context_mode``: ``"memory"``
            (MemPO) or ``"full_history"`` (Search-R1 baseline, TRL's append-only context), the context budget
            ``max_context_tokens`` and ``context_overflow``), as the task plays it (`Task.protocol`).
        retriever: any object with ``search(queries: list[str], topk: int) -> list[list[Passage]]``: the search task
            (`mempo_trl.tasks.SearchTask`).
        environment_factory: instead of a retriever, a TRL-style environment class or factory, or as in TRL a dict
            of them by name (`mempo_trl.tasks.EnvironmentTask`).
        task: instead of either, any `mempo_trl.tasks.Task`.
        eos_token_ids: the ids that end a turn (`TurnProtocol.stop_token_ids`); a turn that ends otherwise is
            truncated.
        max_prompt_length: the longest context (tokens) the generation backend takes; ``None``: no limit. With the
            protocol's ``max_context_tokens``, the smaller one binds (`TurnProtocol.context_limit`).

    The protocol's ``context_overflow`` says what happens to a longer context: ``"end_episode"`` ends the episode
    before the round (``Episode.context_overflow``); ``"truncate_information"`` first cuts the tail of the
    results in the context (oldest first: the text the task returned is cut by tokens and the task renders what is
    left, `Task.render_result`; the shortened message is what later contexts show, `Episode.cut_information`, while
    the record keeps the full result) and ends the episode only when that is not enough. A round-1 context (no information yet) that does not fit is an error.
    """

    def __init__(
        self,
        tokenizer,
        protocol: TurnProtocol,
        retriever=None,
        eos_token_ids: Sequence[int] = (),
        max_prompt_length: int | None = None,
        environment_factory: EnvironmentFactory | None = None,
        task: Task | None = None,
    ):
        try:
            self.task = make_task(retriever, environment_factory, task)
        except ValueError as err:
            raise ValueError(f"RolloutEngine {err}") from None
        self.tokenizer = tokenizer
        self.protocol = self.task.protocol(protocol)
        self.eos_token_ids = list(eos_token_ids)
        self.max_prompt_length = max_prompt_length

    def new_episodes(self, rows: Sequence[dict]) -> list[Episode]:
        """The episodes of ``rows``, started by the task (`Task.start`)."""
        rows = [dict(row) for row in rows]
        return [
            Episode(
                row,
                self.protocol.initial_messages(start.question),
                question=start.question,
                environment=start.environment,
                tools=start.tools,
                action_metric=self.task.action_metric,
            )
            for row, start in zip(rows, self.task.start(rows))
        ]

    def _limit_hint(self, limit: int) -> str:
        """Which setting the context limit ``limit`` comes from, and how to raise it."""
        if limit == self.protocol.max_context_tokens:
            return f"max_context_tokens={limit}: raise it"
        return (
            f"{limit} the generation backend takes (vllm_max_model_length or max_position_embeddings, minus "
            "max_completion_length): raise the limit or lower max_completion_length"
        )

    def check_first_contexts(self, rows, source_name: str, margin: int = 16) -> None:
        """Raise `DataError` naming the row when a question's first context (system prompt and instruction with the
        question, rendered with the chat template) is longer than the context limit `fit_prompt` applies: checked
        when the data is loaded, not at the step that draws the row; only for a task that knows its questions
        before an episode starts (`Task.questions`: not an environment's, which come from its ``reset``).

        Questions are tokenised in one batch; a row whose question tokens plus the template's come within
        ``margin`` of the limit is rendered whole and measured exactly.
        """
        limit = self.protocol.context_limit(self.max_prompt_length)
        questions = self.task.questions(rows) if limit is not None and len(rows) else None
        if questions is None:
            return
        template = len(self.render(self.protocol.initial_messages("")))
        lengths = self.tokenizer(questions, add_special_tokens=False)["input_ids"]
        for index, (question, ids) in enumerate(zip(questions, lengths)):
            if template + len(ids) + margin <= limit:
                continue
            length = len(self.render(self.protocol.initial_messages(question)))
            if length > limit:
                row_id = rows[index].get("id", index)
                raise DataError(
                    f"{source_name}, row {index + 1} (id {row_id!r}): the first context of question "
                    f"{question[:80]!r} is {length} tokens, more than {self._limit_hint(limit)}; or shorten or "
                    "remove the row."
                )

    def render(self, messages: list[dict[str, str]], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a context: `render_prompt` with the protocol's ``chat_template_kwargs``."""
        return render_prompt(self.tokenizer, messages, tools, self.protocol.chat_template_kwargs)

    def context_messages(self, episode: Episode) -> list[dict[str, str]]:
        """Messages of the episode's next round (docs/algorithm.md, "Context rebuild")."""
        return self.protocol.round_messages(episode.base_messages, episode.history())

    def fit_prompt(self, episode: Episode) -> list[int] | None:
        """Token ids of the episode's next context, within ``max_prompt_length`` and the protocol's
        ``max_context_tokens``; None when the episode ends on it.

        See ``context_overflow`` in the class docstring.
        """
        ids = self.render(self.context_messages(episode), episode.tools)
        limit = self.protocol.context_limit(self.max_prompt_length)
        if limit is None or len(ids) <= limit:
            return ids
        if not episode.rounds:
            raise ValueError(
                f"The first context of question {episode.question[:80]!r} is {len(ids)} tokens, more than "
                f"{self._limit_hint(limit)}."
            )
        if self.protocol.context_overflow == "truncate_information":
            searched = [t for t, r in enumerate(episode.rounds) if r.information is not None]
            for t in shown_rounds(searched, self.protocol.context_mode):
                kept = episode.cut_results.get(t, episode.rounds[t].result or "")
                body = self.tokenizer(kept, add_special_tokens=False)["input_ids"]
                while len(ids) > limit and body:
                    body = body[: max(0, len(body) - (len(ids) - limit))]
                    episode.cut_results[t] = self.tokenizer.decode(body)
                    episode.cut_information[t] = self.task.render_result(f"{episode.cut_results[t]} ...")
                    ids = self.render(self.context_messages(episode), episode.tools)
                if len(ids) <= limit:
                    return ids
        episode.finished = episode.context_overflow = True
        return None

    def play(
        self,
        rows: Sequence[dict],
        generate: GenerateFn,
        global_active: Callable[[int], int] | None = None,
        score_memory: bool = False,
    ) -> Rollout:
        """Play one episode per row to the end: the episodes, their training rows (`training_rows`) and the timings,
        for evaluation, inference and training alike.

        Args:
            rows: dicts with at least ``question`` (search task), or the keyword arguments of the environment's
                ``reset``.
            generate: the generation backend.
            global_active: for multi-process runs, maps this process's number of active episodes to the number over
                all processes; while it is positive, a process without active episodes still calls ``generate`` (on
                one placeholder prompt) so that every process issues the same generation calls (vLLM server and
                ZeRO-3 generation are collectives).
            score_memory: the rounds the memory reward scores carry both of their contexts (``TrainingRow.scoring``,
                rendered with the protocol's ``chat_template_kwargs``).

        Raises:
            RetrieverOutage: the retriever stayed unreachable. The process that lost it ends its episodes and keeps
                taking part in the rounds; after the last one, every process learns (through ``global_active``)
                whether any process lost it, and all of them raise together, so a caller can save a checkpoint.
        """
        episodes = self.new_episodes(rows)
        timings = RolloutTimings()
        outage: RetrieverOutage | None = None
        for round_index in range(self.protocol.max_turns):
            active, prompts = [], []
            for ep in episodes:
                prompt_ids = None if ep.finished else self.fit_prompt(ep)
                if prompt_ids is not None:
                    active.append(ep)
                    prompts.append(prompt_ids)
            if global_active is not None:
                if global_active(len(active)) == 0:
                    break
            elif not active:
                break
            start = time.perf_counter()
            placeholder = [self.render(episodes[0].base_messages, episodes[0].tools)]
            if getattr(generate, "takes_messages", False):  # a chat endpoint: the same contexts, as messages
                contexts = [self.context_messages(ep) for ep in active] or [episodes[0].base_messages]
                completions, logprobs = generate(prompts or placeholder, messages=contexts)
            elif getattr(generate, "takes_episodes", False):  # a scripted teacher: it reads each episode's row
                completions, logprobs = generate(prompts or placeholder, episodes=active)
            else:
                completions, logprobs = generate(prompts or placeholder)
            timings.generation += time.perf_counter() - start
            searches: list[tuple[Episode, str]] = []
            for i, (ep, prompt_ids) in enumerate(zip(active, prompts)):
                record = self._make_record(prompt_ids, completions[i], None if logprobs is None else logprobs[i])
                ep.rounds.append(record)
                last_round = round_index + 1 == self.protocol.max_turns
                if record.turn.valid and record.turn.action != "answer" and not last_round:
                    searches.append((ep, record.turn.content))
                else:
                    ep.finished = True
            if searches:
                start = time.perf_counter()
                try:
                    environments, contents = [ep.environment for ep, _ in searches], [c for _, c in searches]
                    results = self.task.act(environments, contents, self.protocol.retrieval_topk)
                except RetrieverOutage as e:
                    outage, results = e, []
                    for ep in episodes:
                        ep.finished = True
                timings.retrieval += time.perf_counter() - start
                for (ep, _), result in zip(searches, results):
                    ep.rounds[-1] = replace(ep.rounds[-1], information=self.task.render_result(result), result=result)
        for ep in episodes:
            ep.finished = True
        lost = global_active(int(outage is not None)) if global_active is not None else int(outage is not None)
        if lost:
            raise outage or RetrieverOutage(f"{lost} other process(es) lost the retrieval server (see their log).")
        return Rollout(
            tuple(episodes),
            training_rows(episodes, self.tokenizer, score_memory, self.protocol.chat_template_kwargs),
            timings,
        )

    def _make_record(self, prompt_ids: list[int], completion_ids: list[int], logprobs: list[float] | None):
        completion_ids, text, truncated, token_span = _cut_turn(
            list(completion_ids), self.tokenizer, self.eos_token_ids, self.protocol.stops
        )
        if logprobs is not None:
            logprobs = list(logprobs[: len(completion_ids)])
        turn = parse_turn(text, self.protocol.actions)
        problem = self.task.action_problem(turn.content) if turn.valid and turn.action != "answer" else None
        if problem is not None:
            turn = Turn(False, problem, turn.mem, None, None, None, turn.mem_chars)
        mem_span = token_span(*turn.mem_chars) if turn.mem_chars is not None else None
        return RoundRecord(
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            text=text,
            turn=turn,
            mem_span=mem_span,
            truncated=truncated,
            logprobs=logprobs,
        )
