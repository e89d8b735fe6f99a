"""A small agent that can learn the demo world on CPU: a bigger world, three disjoint splits, an SFT warm start
with TRL's `SFTTrainer`, and a held-out evaluation with memory recall.

- `write_learner_world` generates one seeded world (`mempo_trl.kit.demo_world`) with enough questions for three
  disjoint sets: ``warm`` (SFT warm start), ``rl`` (MemPO) and ``test`` (held-out evaluation, never trained on);
- `build_learner` builds a few-M-parameter Qwen2-shaped model with the kit's own tokenizer (MemPO tags are
  single tokens, `mempo_trl.kit.tiny`) and warm-starts it with `sft_warm_start` on the oracle turns of the
  ``warm`` rows, leaving the memory imperfect on purpose (`MEM_DROP`); `derive_learner` continues a warm start with
  other settings (a more forgetful memory);
- `heldout_eval` plays the held-out rows greedily and reports EM, F1, per question type, format, tokens and
  ``memory_recall`` (the share of the facts a question needs that are in the episode's last ``<mem>``);
  `HeldOutEvalCallback` runs it before, during and after training;
- `headroom` measures what RL can gain before any is spent: why the greedy episodes miss (`failure_kind`), and
  how often sampled episodes of a row disagree (the GRPO groups that carry a reward signal); `memory_signal`, how
  much remembering a fact raises P(gold), the memory reward's raw material, per question type;
- `shipped_learner` is a learner shipped with the package, warm-started and made forgetful, from which RL gains
  in minutes (`model_name_or_path: learner` of `mempo-trl train`, the quick start).
"""

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

from transformers import TrainerCallback

from mempo_trl.context import DEFAULT_INSTRUCTION, DEFAULT_SYSTEM_PROMPT


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
tokens, which made the warm start learn to copy them from its context; an SFT step on 16 rounds takes ~1.7 s on one
CPU core."""

LEARNER_INSTRUCTION = "Question: {question}"
"""The learner's user message: the question alone. The protocol is learned from the warm start, and a context about
half as long (the default instruction is ~80 tokens) makes every SFT and RL step cheaper on CPU."""

MEM_DROP = 0.3
"""Probability that the oracle's ``<mem>`` leaves out a fact (`oracle_episode_turns`): the warm-started model
forgets facts that comparison and multi-objective answers need, which the memory advantage can repair."""


@dataclass
class WarmSettings:
    """The SFT warm start of `build_learner`: `SFTTrainer` steps, batch size, learning rate, seed, ``mem_drop``,
    the number of warm rows used (all by default) and the instruction (RL and evaluation must use the same)."""

    steps: int = 3000
    batch_size: int = 16
    lr: float = 3e-3
    seed: int = 0
    mem_drop: float = MEM_DROP
    max_warm_rows: int | None = None
    instruction: str = LEARNER_INSTRUCTION


def shipped_learner() -> Path:
    """The learner shipped with the package (`model_name_or_path: learner` of `mempo-trl train`).

    It is the experiment's warm start (3,000 SFT steps, `MEM_DROP`) continued for 300 steps with ``mem_drop=0.6``
    (`derive_learner`; ``warm_start.json`` in the directory says how): greedy held-out EM 0.285 and memory recall
    0.105 on the first 100 test rows of `LEARNER_WORLD`, whose comparisons mostly run out of turns re-searching what
    the memory dropped, a choice RL fixes in minutes. It reads `LEARNER_INSTRUCTION` (saved in its
    ``mempo_agent.json``), and knows only the `LEARNER_WORLD` (`write_learner_world`).

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
    from mempo_trl.kit.demo_world import _write_jsonl, generate_world

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
    _write_jsonl(paths.corpus, generated.passages)
    _write_jsonl(paths.test, rows[:n_test])
    _write_jsonl(paths.rl, rows[n_test : n_test + n_rl])
    _write_jsonl(paths.warm, rows[n_test + n_rl :])
    marker.write_text(json.dumps(settings, indent=2))
    return paths


def sft_warm_start(
    model_dir: str | Path,
    rows: Sequence[dict],
    retriever,
    settings: WarmSettings,
    max_turns: int = 8,
    use_cpu: bool = True,
) -> dict:
    """Warm-start the model in ``model_dir`` with TRL's `SFTTrainer` on the oracle turns of ``rows``; save it back.

    One prompt/completion example per round (`mempo_trl.kit.warmstart.sft_examples`: the context rebuilt exactly
    as training rebuilds it, the loss on the completion only). Rows the oracle cannot play (a comparison whose
    passage the retriever misses, or a row needing more than ``max_turns`` turns) are skipped. Returns the stats,
    also written to ``warm_start.json``. ``use_cpu=False`` trains on the accelerator when there is one.
    """
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from mempo_trl.kit.warmstart import WARM_START_FILE, sft_examples
    from mempo_trl.loading import load_tokenizer

    start = time.perf_counter()
    model_dir = Path(model_dir)
    tokenizer = load_tokenizer(model_dir)
    rows = list(rows)[: settings.max_warm_rows]
    examples, skipped = [], 0
    for n, row in enumerate(rows):
        try:
            examples += sft_examples(
                [row], retriever, tokenizer, mem_drop=settings.mem_drop, seed=settings.seed + n,
                instruction=settings.instruction, max_turns=max_turns,
            )  # fmt: skip
        except ValueError:
            skipped += 1
    dataset = Dataset.from_dict(
        {"input_ids": [p + c for p, c in examples], "labels": [[-100] * len(p) + c for p, c in examples]}
    )
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    args = SFTConfig(
        output_dir=str(model_dir / "sft"),
        max_steps=settings.steps,
        per_device_train_batch_size=settings.batch_size,
        learning_rate=settings.lr,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, settings.steps // 30),
        weight_decay=0.0,
        max_grad_norm=1.0,
        seed=settings.seed,
        use_cpu=use_cpu,
        bf16=False,
        logging_steps=max(1, settings.steps // 60),
        save_strategy="no",
        report_to="none",
        max_length=None,
        dataset_num_proc=None,
        disable_tqdm=True,  # random batches: length-grouped ones learned to copy from the context more slowly
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    result = trainer.train()
    trainer.model.save_pretrained(model_dir)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    stats = {
        "steps": settings.steps,
        "rows": len(rows) - skipped,
        "skipped_rows": skipped,
        "examples": len(examples),
        "initial_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else result.training_loss,
        "seconds": time.perf_counter() - start,
    }
    (model_dir / WARM_START_FILE).write_text(json.dumps({"settings": asdict(settings), "stats": stats}, indent=2))
    return stats


def build_learner(
    output_dir: str | Path, paths: LearnerPaths, settings: WarmSettings | None = None, model_seed: int = 0
) -> Path:
    """Build the learner model (`LEARNER_SIZE`, tokenizer trained on the world's corpus) and warm-start it.

    A directory whose ``warm_start.json`` records the same settings and data is returned as it is.
    """
    from mempo_trl.data import read_jsonl
    from mempo_trl.kit.tiny import build_tiny_model
    from mempo_trl.kit.warmstart import WARM_START_FILE
    from mempo_trl.retrieval import BM25Retriever

    settings = settings or WarmSettings()
    out = Path(output_dir)
    digest = hashlib.sha256(b"".join(Path(p).read_bytes() for p in paths)).hexdigest()
    key = {"model_seed": model_seed, "size": LEARNER_SIZE, "warm": asdict(settings), "data_sha256": digest}
    marker = out / WARM_START_FILE
    if marker.is_file() and json.loads(marker.read_text()).get("learner") == key:
        return out
    corpus = read_jsonl(paths.corpus)
    build_tiny_model(out, seed=model_seed, corpus_texts=[p["contents"] for p in corpus], **LEARNER_SIZE)
    retriever = BM25Retriever.from_corpus(str(paths.corpus))
    sft_warm_start(out, read_jsonl(paths.warm), retriever, settings)
    record = json.loads(marker.read_text())
    marker.write_text(json.dumps({**record, "learner": key}, indent=2))
    return out


def derive_learner(base_dir: str | Path, output_dir: str | Path, paths: LearnerPaths, settings: WarmSettings) -> Path:
    """Continue the warm start of ``base_dir`` (a `build_learner` directory) with ``settings`` into ``output_dir``.

    For a warm start that differs in one behaviour without the full SFT from scratch, e.g. a higher ``mem_drop``: a
    few hundred more SFT steps on the oracle rounds of the ``warm`` rows make the memory drop facts more often while
    the rest of the protocol stays as learned. Cached like `build_learner` (same base, settings and data).
    """
    import shutil

    from mempo_trl.data import read_jsonl
    from mempo_trl.kit.warmstart import WARM_START_FILE
    from mempo_trl.retrieval import BM25Retriever

    base, out = Path(base_dir), Path(output_dir)
    digest = hashlib.sha256(b"".join(Path(p).read_bytes() for p in paths)).hexdigest()
    base_key = json.loads((base / WARM_START_FILE).read_text()).get("learner")
    key = {"base": base_key, "warm": asdict(settings), "data_sha256": digest}
    marker = out / WARM_START_FILE
    if marker.is_file() and json.loads(marker.read_text()).get("derived") == key:
        return out
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(base, out, ignore=shutil.ignore_patterns("sft"))
    retriever = BM25Retriever.from_corpus(str(paths.corpus))
    sft_warm_start(out, read_jsonl(paths.warm), retriever, settings)
    record = json.loads(marker.read_text())
    marker.write_text(json.dumps({**record, "derived": key}, indent=2))
    return out


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


def _play(
    model,
    tokenizer,
    rows: Sequence[dict],
    retriever,
    temperature: float = 0.0,
    max_turns: int = 4,
    topk: int = 3,
    max_new_tokens: int = 96,
    context_mode: str = "memory",
    instruction: str = DEFAULT_INSTRUCTION,
    system_prompt: str = DEFAULT_SYSTEM_PROMPT,
):
    """One episode per row (`mempo_trl.evaluation.evaluate`), greedy when ``temperature == 0``."""
    from mempo_trl.agent import MemPOAgent
    from mempo_trl.context import TurnProtocol
    from mempo_trl.evaluation import evaluate
    from mempo_trl.generation import HFGenerator

    protocol = TurnProtocol(
        system_prompt=system_prompt,
        instruction=instruction,
        max_turns=max_turns,
        retrieval_topk=topk,
        context_mode=context_mode,
        max_completion_length=max_new_tokens,
    )
    generator = HFGenerator(model, tokenizer, max_new_tokens, temperature=temperature, batch_size=32)
    return evaluate(MemPOAgent(tokenizer, retriever, generator, protocol), rows, progress=False)


FAILURE_KINDS = ("correct", "no_answer", "invalid_format", "not_retrieved", "forgotten", "miscopied", "wrong_choice")
"""What `failure_kind` returns, in the order it checks."""


def failure_kind(record: dict, needed: Sequence[str] = (), memory_context: bool = True) -> str:
    """Why an episode (a `mempo_trl.evaluation.evaluate` record) missed, the first of `FAILURE_KINDS` that applies.

    ``needed``: the values the answer turn must see (`answer_time_facts`); default: the gold answer (any alias).

    - ``correct``: EM 1; ``no_answer``: well-formed turns, but no answer within ``max_turns`` (still searching);
      ``invalid_format``: a malformed turn;
    - ``not_retrieved``: a needed value is in none of the retrieved passages;
    - ``forgotten`` (memory context only): all were retrieved, but one is in neither the memory nor the search result
      that the answer turn saw (the previous round's), so the memory dropped it;
    - ``miscopied``: a part of the answer (multi-objective answers are ``;``-separated) is in neither the passages nor
      the question: a name or number copied wrong;
    - ``wrong_choice``: every part is a value of the passages or the question, just not the right one.

    Example:
        >>> info = "<information>Doc 1(Title: Seikeis) Seikeis was founded in 1492.</information>"
        >>> rounds = [{"mem": "Nothing yet.", "information": info}, {"mem": "Seikeis: 1492.", "information": None}]
        >>> record = {"question": "When was Seikeis founded?", "golden_answers": ["1492"], "em": 0.0,
        ...           "format_valid": True, "answer": "1409", "rounds": rounds}
        >>> failure_kind(record), failure_kind({**record, "answer": "Seikeis"})
        ('miscopied', 'wrong_choice')
        >>> failure_kind({**record, "rounds": [{"mem": "", "information": None}]})
        'not_retrieved'
        >>> rounds = [{"mem": "", "information": info}, {"mem": "", "information": "<information>x</information>"}]
        >>> failure_kind({**record, "rounds": [*rounds, {"mem": "", "information": None}]})
        'forgotten'
    """
    import re

    rounds = record["rounds"]
    if record["em"] == 1.0:
        return "correct"
    if record["answer"] is None and all(r.get("valid", True) for r in rounds):
        return "no_answer"
    if not record["format_valid"]:
        return "invalid_format"
    passages = " ".join(r.get("information") or "" for r in rounds)

    def within(value: str, text: str) -> bool:  # as whole words, case and punctuation aside
        words = " ".join(re.findall(r"\w+", value.lower()))
        return bool(words) and f" {words} " in " " + " ".join(re.findall(r"\w+", text.lower())) + " "

    groups = [[value] for value in needed] or [list(record["golden_answers"])]
    if not all(any(within(v, passages) for v in group) for group in groups):
        return "not_retrieved"
    seen = f"{rounds[-2].get('mem') or ''} {rounds[-2].get('information') or ''}" if len(rounds) > 1 else ""
    if memory_context and not all(any(within(v, seen) for v in group) for group in groups):
        return "forgotten"
    parts = [part for part in record["answer"].split(";") if part.strip()]
    copied = all(within(part, passages + " " + record["question"]) for part in parts)
    return "wrong_choice" if parts and copied else "miscopied"


def answer_time_facts(row: dict, needed: Sequence[str]) -> list[str]:
    """The values a demo-world row's answer turn must see, from its ``needed`` facts (`needed_facts`): all but a
    bridge's.

    A 2-hop answer needs only the second hop's value; a comparison both compared values; a multi-objective row every
    sub-answer. Empty (meaning: the gold answer) when ``needed`` is.
    """
    return list(needed[-1:] if row.get("data_source") == "demo_2hop" else needed)


def headroom(
    model, tokenizer, rows: Sequence[dict], retriever, samples: int = 4, temperature: float = 1.0, **episode: Any
) -> dict[str, Any]:
    """What RL can gain on ``rows``, measured before training.

    Greedy: ``greedy_em`` and the share of rows per `failure_kind` (``failures``, with `answer_time_facts`). Sampled (``samples`` episodes
    per row at ``temperature``, seeds 0..samples-1): ``mean_at_1`` (mean EM), ``pass_at_k`` (share of rows right at
    least once) and ``mixed_groups`` (share of rows whose samples disagree: the GRPO groups that carry an outcome
    signal). The same keys per question type in ``by_type``. ``episode``: `heldout_eval`'s episode settings.
    """
    import torch

    greedy = _play(model, tokenizer, rows, retriever, **episode).records
    memory_context = episode.get("context_mode", "memory") == "memory"
    kinds = [
        failure_kind(r, answer_time_facts(row, needed_facts(row, retriever)), memory_context)
        for row, r in zip(rows, greedy)
    ]
    sampled = []
    for seed in range(samples):
        torch.manual_seed(seed)
        sampled.append([r["em"] for r in _play(model, tokenizer, rows, retriever, temperature, **episode).records])

    def summary(index: list[int]) -> dict[str, Any]:
        n = max(1, len(index))
        kinds_here = [kinds[i] for i in index]
        wins = [sum(run[i] for run in sampled) for i in index]
        return {
            "rows": len(index),
            "greedy_em": sum(greedy[i]["em"] for i in index) / n,
            "mean_at_1": sum(wins) / (n * samples),
            "pass_at_k": sum(w > 0 for w in wins) / n,
            "mixed_groups": sum(0 < w < samples for w in wins) / n,
            "failures": {kind: kinds_here.count(kind) / n for kind in FAILURE_KINDS},
        }

    types: dict[str, list[int]] = {}
    for i, record in enumerate(greedy):
        types.setdefault(record["data_source"], []).append(i)
    return {
        "samples": samples,
        "temperature": temperature,
        **summary(list(range(len(rows)))),
        "by_type": {source: summary(index) for source, index in sorted(types.items())},
    }


def memory_signal(
    model,
    tokenizer,
    rows: Sequence[dict],
    retriever,
    threshold: float | None = None,
    instruction: str = DEFAULT_INSTRUCTION,
    system_prompt: str = DEFAULT_SYSTEM_PROMPT,
) -> dict[str, Any]:
    """How much a memory's content moves P(gold), the quantity the memory reward is made of, per question type.

    For each row, the gold answer is scored (`mempo_trl.scoring.answer_token_logps`, then
    `mempo_trl.memory.answer_probability` with ``threshold``) after the memory context the trainer scores P_mem in
    (``system + user(question)`` + a ``<mem>`` block), with the memory holding: every fact the row's hops find
    (`mempo_trl.kit.warmstart.hop_facts`, ``p_all``), each fact but one (``p_drop``: mean over the facts), or
    nothing (``p_none``: ``Nothing yet.``). ``fact_value = p_all - p_drop`` is what keeping one more fact earns in
    memory reward: near 0 on a type, the memory advantage has nothing to teach there. Rows without hops, or
    whose hops do not retrieve their facts, are skipped. Returns the means overall and per ``data_source``, with ``rows``.
    """
    from mempo_trl.context import initial_messages, render_prompt
    from mempo_trl.kit.warmstart import NOTHING_YET
    from mempo_trl.memory import answer_probability
    from mempo_trl.scoring import ScoringItem, answer_token_logps, gold_answer_tokens, memory_context_ids

    items, owners = [], []  # owners[i]: (row index, "all" | "drop" | "none")
    for index, row in enumerate(rows):
        facts = found_facts(row, retriever)
        if not facts:
            continue
        base = render_prompt(tokenizer, initial_messages(row["question"], system_prompt, instruction))
        answer_ids, answer_mask = gold_answer_tokens(tokenizer, row["golden_answers"], row.get("sub_answers") or None)
        memories = [("all", facts), *(("drop", facts[:i] + facts[i + 1 :]) for i in range(len(facts))), ("none", [])]
        for kind, kept in memories:
            context = memory_context_ids(tokenizer, base, f"<mem> {' '.join(kept) or NOTHING_YET} </mem>")
            items.append(ScoringItem(context, answer_ids, answer_mask))
            owners.append((index, kind))
    logps, mask = answer_token_logps(model, items, tokenizer.pad_token_id)
    probs = answer_probability(logps, mask, threshold).tolist()
    per_row: dict[int, dict[str, list[float]]] = {}
    for (index, kind), prob in zip(owners, probs):
        per_row.setdefault(index, {}).setdefault(kind, []).append(prob)

    def summary(indices: list[int]) -> dict[str, Any]:
        n = max(1, len(indices))
        mean = {k: sum(sum(per_row[i][k]) / len(per_row[i][k]) for i in indices) / n for k in ("all", "drop", "none")}
        return {"rows": len(indices), "p_all": mean["all"], "p_drop": mean["drop"], "p_none": mean["none"],
                "fact_value": mean["all"] - mean["drop"]}  # fmt: skip

    types: dict[str, list[int]] = {}
    for index in per_row:
        types.setdefault(rows[index].get("data_source", "all"), []).append(index)
    return {
        "threshold": threshold,
        **summary(list(per_row)),
        "by_type": {source: summary(indices) for source, indices in sorted(types.items())},
    }


def heldout_eval(model, tokenizer, rows: Sequence[dict], retriever, **episode: Any) -> dict[str, Any]:
    """Greedy evaluation of ``rows`` (`mempo_trl.evaluation.evaluate`), with ``memory_recall`` overall and per type.

    ``episode``: ``max_turns`` (4), ``topk`` (3), ``max_new_tokens`` (96), ``context_mode`` ("memory"),
    ``instruction`` and ``system_prompt`` (the defaults of `mempo_trl.context`). Returns ``evaluate``'s overall metrics (``em``, ``f1``, ``format_valid``, ``total_tokens_per_question``,
    ``peak_context_tokens``, ...) plus ``memory_recall`` and ``failures`` (the share of rows per `failure_kind`),
    and ``by_type``: ``em``, ``f1``, ``memory_recall`` and ``failures`` per ``data_source``.
    """
    import math

    result = _play(model, tokenizer, rows, retriever, **{**episode, "temperature": 0.0})
    memory_context = episode.get("context_mode", "memory") == "memory"
    recalls: dict[str, list[float]] = {}
    kinds: dict[str, list[str]] = {}
    for row, record in zip(rows, result.records):
        mems = [r["mem"] for r in record["rounds"] if r["mem"] is not None]
        needed = needed_facts(row, retriever)  # one retrieval per row serves recall and the failure kind
        recall = memory_recall(mems[-1] if mems else None, needed)
        if not math.isnan(recall):
            recalls.setdefault(record["data_source"], []).append(recall)
        kind = failure_kind(record, answer_time_facts(row, needed), memory_context)
        kinds.setdefault(record["data_source"], []).append(kind)

    def shares(found: list[str]) -> dict[str, float]:
        return {kind: found.count(kind) / max(1, len(found)) for kind in FAILURE_KINDS}

    overall = result.metrics["overall"]
    keys = ("em", "f1", "format_valid", "turns_per_question", "total_tokens_per_question", "peak_context_tokens")
    metrics = {k: overall[k] for k in keys}
    every = [r for values in recalls.values() for r in values]
    metrics["memory_recall"] = sum(every) / len(every) if every else math.nan
    metrics["failures"] = shares([kind for found in kinds.values() for kind in found])
    metrics["by_type"] = {
        source: {
            "em": m["em"],
            "f1": m["f1"],
            "memory_recall": sum(recalls.get(source, [])) / max(1, len(recalls.get(source, []))),
            "failures": shares(kinds.get(source, [])),
        }
        for source, m in result.metrics["by_data_source"].items()
    }
    return metrics


class HeldOutEvalCallback(TrainerCallback):
    """Evaluates the trained model on held-out rows (`heldout_eval`) before training, every ``eval_every`` steps
    (0: never in between) and after training; ``curve`` holds ``{"step", **metrics}`` per evaluation and
    ``on_result`` (if given) is called with the curve after each one."""

    def __init__(self, tokenizer, rows, retriever, eval_every: int = 0, on_result=None, **eval_kwargs):
        self.tokenizer, self.rows, self.retriever = tokenizer, list(rows), retriever
        self.eval_every, self.on_result, self.eval_kwargs = eval_every, on_result, eval_kwargs
        self.curve: list[dict] = []

    def _evaluate(self, step: int, model) -> None:
        if self.curve and self.curve[-1]["step"] == step:
            return
        start = time.perf_counter()
        metrics = heldout_eval(model, self.tokenizer, self.rows, self.retriever, **self.eval_kwargs)
        self.curve.append({"step": step, **metrics, "eval_seconds": time.perf_counter() - start})
        if self.on_result is not None:
            self.on_result(self.curve)

    def before_after(self) -> str:
        """One line: held-out EM (and format, memory recall) of the first and the last evaluation.

        Example:
            >>> callback = HeldOutEvalCallback(None, [{}, {}], None)
            >>> callback.curve = [{"step": 0, "em": 0.1, "format_valid": 0.5, "memory_recall": 0.25},
            ...                   {"step": 30, "em": 0.2, "format_valid": 0.75, "memory_recall": 0.5}]
            >>> callback.before_after()  # doctest: +ELLIPSIS
            'held-out EM (2 questions, greedy): 0.100 before training (step 0) -> 0.200 after (step 30) | format ...'
        """
        first, last = self.curve[0], self.curve[-1]
        return (
            f"held-out EM ({len(self.rows)} questions, greedy): {first['em']:.3f} before training (step "
            f"{first['step']}) -> {last['em']:.3f} after (step {last['step']}) | format {first['format_valid']:.3f} -> "
            f"{last['format_valid']:.3f} | memory recall {first['memory_recall']:.3f} -> {last['memory_recall']:.3f}"
        )

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero:
            self._evaluate(state.global_step, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.eval_every and state.global_step % self.eval_every == 0 and state.is_world_process_zero:
            self._evaluate(state.global_step, model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero:
            self._evaluate(state.global_step, model)
