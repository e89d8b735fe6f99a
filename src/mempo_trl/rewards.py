"""Outcome scores: SQuAD answer normalisation (after Unicode NFKC) with Search-R1 ``qa_em`` semantics, token F1,
multi-objective rows."""

import logging
import re
import string
import unicodedata
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mempo_trl.turns import parse_turn, split_answers


logger = logging.getLogger(__name__)


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation after a Unicode one: NFKC (``"Cafe\u0301"`` is ``"Café"``, full-width ``"Ｐａｒｉｓ"`` is
    ``"Paris"``, ``"ﬁ"`` is ``"fi"``) and format characters dropped (zero-width spaces, soft hyphens), then lower-case,
    drop punctuation and articles, collapse white space. ASCII text normalises exactly as SQuAD's.

    >>> normalize_answer("  The Eiffel-Tower, Paris! ")
    'eiffeltower paris'
    >>> normalize_answer("Ｐａｒｉｓ\u200b") == normalize_answer("Paris")
    True
    """
    s = unicodedata.normalize("NFKC", s)
    s = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION and unicodedata.category(ch) != "Cf")
    return " ".join(_ARTICLES.sub(" ", s).split())


def _aliases(golden_answers: str | Sequence[str]) -> list[str]:
    """The accepted answers as a list; anything but a string or a list of strings raises `TypeError`."""
    aliases = [golden_answers] if isinstance(golden_answers, str) else golden_answers
    if not isinstance(aliases, Sequence) or not all(isinstance(g, str) for g in aliases):
        raise TypeError(
            f"golden answers must be a string or a list of strings, got {golden_answers!r:.200}. Check the "
            "'golden_answers' column (mempo_trl.load_qa validates it)."
        )
    return list(aliases)


def _check_batch(completions: Any, **columns: Any) -> None:
    """Raise `TypeError`/`ValueError` unless `completions` and every given column are lists of the same length."""
    if not isinstance(completions, Sequence) or isinstance(completions, str):
        raise TypeError(f"completions must be a list (one per trajectory), got {type(completions).__name__}.")
    for name, column in columns.items():
        if column is None:
            continue
        if not isinstance(column, Sequence) or isinstance(column, str):
            raise TypeError(f"{name} must be a list (one entry per completion), got {type(column).__name__}.")
        if len(column) != len(completions):
            raise ValueError(
                f"{name} has {len(column)} entries but there are {len(completions)} completions; reward functions "
                "get one entry per completion (TRL passes each dataset column that way)."
            )


def exact_match(prediction: str | None, golden_answers: str | Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised alias, else 0.0 (0.0 for ``None``).

    >>> exact_match("the Paris", ["paris", "Paris, France"])
    1.0
    """
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(g) == pred for g in _aliases(golden_answers)))


def sub_exact_match(prediction: str | None, golden_answers: str | Sequence[str]) -> float:
    """1.0 if any normalised alias is a substring of the normalised prediction (Search-R1 ``subem_check``).

    An alias that normalises to the empty string only matches an empty prediction.

    >>> sub_exact_match("It is Paris.", ["paris"])
    1.0
    """
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    for g in _aliases(golden_answers):
        gold = normalize_answer(g)
        if (gold in pred) if gold else not pred:
            return 1.0
    return 0.0


def _token_f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str | None, golden_answers: str | Sequence[str]) -> float:
    """SQuAD token F1 of the normalised texts, max over aliases; two empty texts score 1.0.

    >>> round(f1_score("Paris France", ["paris"]), 4)
    0.6667
    """
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction).split()
    return max((_token_f1(pred, normalize_answer(g).split()) for g in _aliases(golden_answers)), default=0.0)


@dataclass(frozen=True)
class OutcomeScore:
    """Outcome metrics of one trajectory; ``per_question_em`` has one entry per (sub-)question."""

    em: float
    f1: float
    sub_em: float
    per_question_em: tuple[float, ...]


def outcome_score(
    answer: str | None,
    golden_answers: str | Sequence[str],
    sub_answers: Sequence[Sequence[str]] | None = None,
    format_valid: bool = True,
) -> OutcomeScore:
    """Score a final answer; all zeros if the format is invalid or there is no answer.

    Multi-objective rows (non-empty ``sub_answers``): the answer is split on ``;``, part ``i`` is scored against
    ``sub_answers[i]`` (a missing part scores 0) and ``em``/``f1``/``sub_em`` are means over the questions.

    >>> outcome_score("Ulm; Bob", [], [["Ulm"], ["Max"]])
    OutcomeScore(em=0.5, f1=0.5, sub_em=0.5, per_question_em=(1.0, 0.0))
    """
    parts = part_scores(answer, golden_answers, sub_answers, format_valid)
    ems, f1s, subs = (tuple(column) for column in zip(*parts))
    n = len(parts)
    return OutcomeScore(sum(ems) / n, sum(f1s) / n, sum(subs) / n, ems)


def part_scores(
    answer: str | None,
    golden_answers: str | Sequence[str],
    sub_answers: Sequence[Sequence[str]] | None = None,
    format_valid: bool = True,
) -> list[tuple[float, float, float]]:
    """``(em, f1, sub_em)`` of every question of a row: one entry, or one per part of a multi-objective row (the
    answer split on ``;``, a missing part scoring 0); all zeros if the format is invalid or there is no answer.

    `outcome_score` averages them (each part's share); the all-parts scores of evaluation take their minimum.

    >>> part_scores("Ulm; Max Born", [], [["Ulm"], ["Max"]])
    [(1.0, 1.0, 1.0), (0.0, 0.6666666666666666, 1.0)]
    """
    questions = list(sub_answers) if sub_answers else [golden_answers]
    if not format_valid or answer is None:
        return [(0.0, 0.0, 0.0)] * len(questions)
    parts = split_answers(answer) if sub_answers else [answer]
    preds = [parts[i] if i < len(parts) else None for i in range(len(questions))]
    return [(exact_match(p, g), f1_score(p, g), sub_exact_match(p, g)) for p, g in zip(preds, questions)]


def episode_outcome(episode: Any) -> OutcomeScore | None:
    """`outcome_score` of a finished `mempo_trl.rollout.Episode`'s answer against its golds, None without gold.

    `MemPOTrainer` calls it once per episode and step: the reward functions get it as the ``outcome`` column and the
    ``episode/*`` metrics read it (`episode_metrics`).
    """
    golds = episode.golden_answers
    if golds is None:
        return None
    return outcome_score(episode.answer, golds, episode.row.get("sub_answers") or None, episode.format_valid)


def episode_metrics(episode: Any, outcome: OutcomeScore | None = None) -> dict[str, float]:
    """The numbers training logs (as ``episode/<name>``) and evaluation reports for one finished episode.

    ``em``/``f1``/``sub_em`` come from ``outcome`` (`episode_outcome`, scored here when not given; absent when the
    episode has no gold), then the rollout's own numbers (`mempo_trl.rollout.Episode.metrics`).
    """
    outcome = outcome if outcome is not None else episode_outcome(episode)
    scores = {} if outcome is None else {"em": outcome.em, "f1": outcome.f1, "sub_em": outcome.sub_em}
    return {**scores, **episode.metrics()}


def reward_inputs(
    rows: Sequence[dict], episodes: Sequence[Any], outcomes: Sequence[OutcomeScore | None], stats: Sequence[dict]
) -> list[dict]:
    """What the reward functions get of each finished episode besides its prompt and completion: its dataset row,
    ``trajectory`` (all turn texts), ``format_valid`` (from its `episode_metrics` ``stats``), ``outcome`` (its
    `episode_outcome`) and, when the row has none, the episode's ``golden_answers`` (an environment's; None: no gold,
    the outcome reward gives None)."""
    inputs = []
    for row, episode, outcome, stat in zip(rows, episodes, outcomes, stats):
        reward_input = {
            **row,
            "trajectory": [r.text for r in episode.rounds],
            "format_valid": bool(stat["format_valid"]),
            "outcome": outcome,
        }
        if reward_input.get("golden_answers") is None:
            reward_input["golden_answers"] = episode.golden_answers
        inputs.append(reward_input)
    return inputs


def _completion_text(completion: Any) -> str:
    """Text of a completion: a string, or the content of the last message of a conversational completion."""
    if isinstance(completion, str):
        return completion
    if not completion:
        return ""
    content = completion[-1].get("content") or ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _episode_scores(completions, golden_answers, sub_answers, format_valid, outcome) -> list[OutcomeScore | None]:
    """`outcome_score` of each completion, parsed as the episode's final turn (see `mempo_outcome_reward`); an entry
    of ``outcome`` (the trainer's `episode_outcome`) is taken as it is; None where ``golden_answers`` has none (an
    environment episode without gold, whose own reward scores it)."""
    _check_batch(
        completions, golden_answers=golden_answers, sub_answers=sub_answers, format_valid=format_valid, outcome=outcome
    )
    scores = []
    for i, completion in enumerate(completions):
        if outcome is not None and outcome[i] is not None:
            scores.append(outcome[i])
            continue
        if golden_answers[i] is None:
            scores.append(None)
            continue
        turn = parse_turn(_completion_text(completion))
        answer = turn.content if turn.valid and turn.action == "answer" else None
        valid = True if format_valid is None else bool(format_valid[i])
        subs = sub_answers[i] if sub_answers is not None else None
        scores.append(outcome_score(answer, golden_answers[i], subs, format_valid=valid))
    return scores


def mempo_outcome_reward(
    prompts: list[Any],
    completions: list[Any],
    golden_answers: list[Sequence[str]],
    sub_answers: list[Sequence[Sequence[str]] | None] | None = None,
    format_valid: list[bool] | None = None,
    outcome: list[OutcomeScore | None] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """TRL reward function: exact match of the answer in each completion (``outcome_score(...).em``); None (TRL: not
    scored) where the trajectory has no gold answer (a row of an environment that owns its reward).

    Each completion (a string, or chat messages whose last message is used) is parsed as the episode's final turn;
    its answer counts only if that turn is a valid answer turn and ``format_valid[i]`` (when given, e.g. the
    validity of all earlier rounds) is true. An ``outcome`` entry (`MemPOTrainer` passes each episode's
    `episode_outcome`, scored once per step) is used as that completion's score. ``prompts`` and extra dataset columns
    in ``kwargs`` are ignored.

    >>> done = "<mem>m</mem><think>t</think><answer>Ulm</answer>"
    >>> mempo_outcome_reward(["q", "q"], [done, [{"role": "assistant", "content": "Ulm"}]], [["ulm"], ["ulm"]])
    [1.0, 0.0]
    """
    scores = _episode_scores(completions, golden_answers, sub_answers, format_valid, outcome)
    return [None if score is None else score.em for score in scores]


def mempo_all_parts_reward(
    prompts: list[Any],
    completions: list[Any],
    golden_answers: list[Sequence[str]],
    sub_answers: list[Sequence[Sequence[str]] | None] | None = None,
    format_valid: list[bool] | None = None,
    outcome: list[OutcomeScore | None] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """TRL reward function: 1 when every part of a multi-objective answer is an exact match, else 0 (None without a
    gold answer, as `mempo_outcome_reward`).

    `mempo_outcome_reward` gives each part its share (K parts: ``1/K`` each), so one search and one right value
    already earns ``1/K``; this reward pays only for the whole answer. Rows without ``sub_answers`` score as there.

    >>> done = "<mem>m</mem><think>t</think><answer>Ulm; Bob</answer>"
    >>> mempo_all_parts_reward(["q", "q"], [done, done], [[], []], [[["Ulm"], ["Bob"]], [["Ulm"], ["Max"]]])
    [1.0, 0.0]
    """
    scores = _episode_scores(completions, golden_answers, sub_answers, format_valid, outcome)
    return [None if score is None else float(all(score.per_question_em)) for score in scores]


def mempo_format_reward(
    prompts: list[Any], completions: list[Any], format_valid: list[bool], **kwargs: Any
) -> list[float]:
    """Optional TRL reward function: 1.0 for an episode whose every turn was valid and that ended on an answer.

    Not part of MemPO's outcome (which already scores 0 on any invalid turn); add it next to
    `mempo_outcome_reward` (``reward_funcs=[mempo_outcome_reward, mempo_format_reward]``, with ``reward_weights``)
    to give GRPO a signal while a small model still rarely answers right. ``format_valid`` is passed by
    `MemPOTrainer` for every trajectory.

    >>> mempo_format_reward(["q", "q"], ["", ""], format_valid=[True, False])
    [1.0, 0.0]
    """
    _check_batch(completions, format_valid=format_valid)
    return [float(bool(valid)) for valid in format_valid]


def announce_reward_format(reward_funcs) -> None:
    """Warn once, naming them, that the caller's reward functions (``reward_funcs`` as given: a function, a model or
    id, or a list) get conversational completions, not TRL's standard-format strings (docs/training.md)."""
    import torch

    funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    own = (mempo_outcome_reward, mempo_all_parts_reward, mempo_format_reward)
    custom = [f.__name__ for f in funcs if callable(f) and not isinstance(f, torch.nn.Module) and f not in own]
    if custom:
        logger.warning(
            "Reward functions %s receive TRL's conversational format, as for a chat dataset: `prompts` are the "
            "episode's first messages and each completion is [{'role': 'assistant', 'content': <last turn>}] (read "
            "completion[0]['content']; a function written for strings would measure the list); `trajectory` holds "
            "every turn's text (docs/training.md, 'Reward functions').",
            ", ".join(custom),
        )
