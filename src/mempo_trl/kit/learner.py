"""A small agent that can learn the demo world on CPU: a bigger world, three disjoint splits, a warm-started learner
and the quick start's held-out memory recall.

- `write_learner_world` generates one seeded world (`mempo_trl.kit.demo_world`) with enough questions for three
  disjoint sets: ``warm`` (SFT warm start), ``rl`` (MemPO) and ``test`` (held-out evaluation, never trained on);
- `LEARNER_SIZE` says the learner: a few-M-parameter Qwen2-shaped model with the kit's own
  tokenizer (MemPO tags are single tokens, `mempo_trl.kit.tiny`), warm-started
  (`mempo_trl.kit.warmstart.sft_warm_start`) on the oracle turns of the ``warm`` rows, its memory imperfect on
  purpose (`MEM_DROP`); the lab builds it (`lab/learning.py`);
- `memory_recall_metric` is the per-row held-out metric of the quick start (`mempo-trl train --heldout_questions`,
  `mempo_trl.callbacks.HeldOutEvalCallback`): EM, F1 and ``memory_recall``, the share of the facts a demo-world
  question needs that are in the episode's last ``<mem>``; `heldout_eval` evaluates a model with it (the quick
  start notebook);
- `shipped_learner` is a learner shipped with the package, warm-started and made forgetful, from which RL gains
  in minutes (`model_name_or_path: learner` of `mempo-trl train`, the quick start).

The lab (``lab/``, outside the package) builds these models and analyses them (``lab/analytics.py``: why episodes
miss, the headroom before RL, the memory signal).
"""

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple


LEARNER_WORLD = {"seed": 1, "num_entities": 400, "num_questions": 3000}
"""The world of the learning experiment: ~820 passages, 3000 questions (30% 1-hop, 30% 2-hop, 20% comparison,
20% multi-objective)."""

SPLIT_SIZES = {"test": 300, "rl": 800}
"""Held-out and RL rows; every other row of the world is a warm-start row."""

LEARNER_SIZE = {
    "vocab_size": 8192,
    "hidden_size": 128,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 512,
}
"""About 1.4 M parameters. The 8,192-token vocabulary (trained on the world's corpus) makes most names one or two
tokens, which made the warm start learn to copy them from its context."""

LEARNER_INSTRUCTION = "Question: {question}"
"""The learner's user message: the question alone. The protocol is learned from the warm start, and a context about
half as long (the default instruction is ~80 tokens) makes every SFT and RL step cheaper on CPU."""

MEM_DROP = 0.3
"""Probability that the oracle's ``<mem>`` leaves out a fact (`oracle_episode_turns`): the warm-started model
forgets facts that comparison and multi-objective answers need, which the memory advantage can repair."""


def shipped_learner() -> Path:
    """The learner shipped with the package (`model_name_or_path: learner` of `mempo-trl train`).

    It is the experiment's warm start (the lab's, ``lab/learning.py``) continued with ``mem_drop=0.6`` (`lab/learning.py`;
    ``warm_start.json`` in the directory says how): its memory drops most facts, so its comparisons mostly run out
    of turns re-searching them, a choice RL fixes in minutes (its held-out numbers: ``lab/learning.md``). It reads
    `LEARNER_INSTRUCTION` (saved in its ``mempo_agent.json``), and knows only the `LEARNER_WORLD`
    (`write_learner_world`).

    Example:
        >>> (shipped_learner() / "model.safetensors").is_file()
        True
    """
    from importlib import resources

    return Path(str(resources.files("mempo_trl.kit") / "learner_model"))


class LearnerPaths(NamedTuple):
    """The files of `write_learner_world`: the corpus and the three disjoint QA splits."""

    corpus: Path
    warm: Path
    rl: Path
    test: Path


def write_learner_world(out_dir: str | Path, world: dict | None = None, sizes: dict | None = None) -> LearnerPaths:
    """Generate the learning world and write ``corpus.jsonl``, ``warm.jsonl``, ``rl.jsonl`` and ``test.jsonl``.

    The world's rows come shuffled; the first ``sizes["test"]`` are held out, the next ``sizes["rl"]`` are the RL
    rows and the rest warm-start rows, so the three sets share no question. Files already written with the same
    settings are reused.

    Example:
        >>> import tempfile
        >>> paths = write_learner_world(tempfile.mkdtemp(), {"seed": 1, "num_entities": 60, "num_questions": 90},
        ...                             {"test": 20, "rl": 30})
        >>> [sum(1 for _ in open(p)) for p in paths[1:]]
        [40, 30, 20]
    """
    from mempo_trl.kit.demo_world import generate_world, write_jsonl

    world, sizes = world or LEARNER_WORLD, sizes or SPLIT_SIZES
    out = Path(out_dir)
    paths = LearnerPaths(out / "corpus.jsonl", out / "warm.jsonl", out / "rl.jsonl", out / "test.jsonl")
    marker = out / "world.json"
    settings = {"world": world, "sizes": sizes}
    try:
        saved = json.loads(marker.read_text()) if marker.is_file() else None
    except ValueError:  # empty or cut short (a kill or a full disk while it was written): write the world again
        saved = None
    if saved == settings and all(p.is_file() for p in paths):
        return paths
    generated = generate_world(**world)
    rows = generated.questions
    n_test, n_rl = sizes["test"], sizes["rl"]
    if n_test + n_rl >= len(rows):
        raise ValueError(f"the world has {len(rows)} questions, too few for {n_test} test + {n_rl} RL rows")
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(paths.corpus, generated.passages)
    write_jsonl(paths.test, rows[:n_test])
    write_jsonl(paths.rl, rows[n_test : n_test + n_rl])
    write_jsonl(paths.warm, rows[n_test + n_rl :])
    marker.write_text(json.dumps(settings, indent=2))
    return paths


def found_facts(row: dict, retriever, topk: int = 10) -> list[str]:
    """What a row's hops find, as ``"Subject: value."`` (`mempo_trl.kit.warmstart.hop_facts` over ``topk`` results).

    Empty for a row without hops, or when the retriever does not return a comparison's passage within ``topk``.
    """
    from mempo_trl.kit.warmstart import hop_facts

    if not row.get("hop_queries"):
        return []
    try:
        return hop_facts(row, retriever.search(list(row["hop_queries"]), topk))
    except ValueError:
        return []


def needed_facts(row: dict, retriever, topk: int = 10) -> list[str]:
    """The values a row's answer needs, one per hop (`mempo_trl.kit.warmstart.hop_facts`), e.g. ``["Sedo", "634,400"]``.

    Empty when `found_facts` is.
    """
    return [fact.split(": ", 1)[1].rstrip(".") for fact in found_facts(row, retriever, topk)]


def memory_recall(mem: str | None, facts: Sequence[str]) -> float:
    """Share of ``facts`` whose normalised text is in the normalised ``mem`` (0.0 without a memory).

    Example:
        >>> memory_recall("Tisdin Purbro: Sedo. Sedo: 634,400.", ["Sedo", "634,400"])
        1.0
        >>> memory_recall("Tisdin Purbro: Sedo.", ["Sedo", "634,400"])
        0.5
    """
    from mempo_trl.rewards import normalize_answer

    if not facts:
        return float("nan")
    text = f" {normalize_answer(mem or '')} "
    return sum(f" {normalize_answer(fact)} " in text for fact in facts) / len(facts)


def memory_recall_metric(retriever):
    """The quick start's per-row held-out metric (a `mempo_trl.evaluation.RowMetric`): EM and F1
    (`mempo_trl.evaluation.exact_match_f1`) and ``memory_recall`` of the episode's last ``<mem>`` against the
    row's `needed_facts` (NaN, not counted, for a row without hops).

    Example:
        >>> metric = memory_recall_metric(retriever)  # doctest: +SKIP
        >>> HeldOutEvalCallback(tokenizer, rows, retriever, row_metric=metric)  # doctest: +SKIP
    """
    from mempo_trl.evaluation import exact_match_f1

    def metric(row: dict, record: dict) -> dict[str, Any]:
        mems = [r["mem"] for r in record["rounds"] if r["mem"] is not None]
        recall = memory_recall(mems[-1] if mems else None, needed_facts(row, retriever))
        return {**exact_match_f1(row, record), "memory_recall": recall}

    return metric


def heldout_eval(model, tokenizer, rows: Sequence[dict], retriever, protocol=None) -> dict[str, Any]:
    """The quick start's held-out evaluation of ``model`` (the notebook's before and after): greedy episodes of
    ``protocol`` (`mempo_trl.evaluation.evaluate_model`) summed up with `memory_recall_metric`
    (`mempo_trl.evaluation.heldout_metrics`: EM, F1, format, tokens, ``memory_recall``, and ``by_type``)."""
    from mempo_trl.evaluation import evaluate_model, heldout_metrics

    result = evaluate_model(model, tokenizer, rows, retriever, protocol)
    return heldout_metrics(result, rows, memory_recall_metric(retriever))
