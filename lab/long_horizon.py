"""Long-horizon proof: MemPO against its ablations as the number of objectives K grows.

Each question asks K facts about K different entities (`horizon_world.generate_horizon_world`), so an
agent searches K times and answers with values it found up to K turns earlier: the memory must keep them, while
full history keeps every passage. The splits (warm start, RL, validation, test) share no question and no
asked-about entity. The learner (`mempo_trl.kit.learner.LEARNER_SIZE`, its vocabulary trained on this world's corpus
without the asked-about names, so that held-out names split into pieces the warm data shows: `VOCABULARY_SIZE`) is
pretrained on a copy task (`induction_pretraining`), then SFT-warm-started with `SFTTrainer` on oracle episodes
of the warm rows with a forgetful memory (`WARM["mem_drop"]`; fresh names and values, the loss on every token:
`WARM`); every arm then trains from it with the same budget on the RL rows (all K mixed):

- `mempo`: memory context + memory advantage (divided by the batch's std: `ARMS`); `outcome_only`: memory context,
  `memory_coef: 0`; `outcome_only_dynamic`: outcome-only with dynamic sampling (`dynamic_sampling: refill`);
- `full_history`: full-history GRPO (`context_mode: full_history`).

RL episodes search the corpus without the passages that name a validation or test entity (`rl_corpus`), evaluation
the whole corpus; every trained policy is evaluated in both context modes (`after_by_mode`; ``after`` is its own).

Each run is evaluated greedily per K on one split (`--split test` for published numbers, touched only by the
published command; `--split validation` for choosing settings) before and after training. Resumable: a run writes
`runs/<split>/<arm>_s<seed>/run.json` when it ends and a rerun with the same settings skips it, so a later session adds
seeds; a run stopped midway resumes from its newest checkpoint (every `CHECKPOINT_EVERY` steps). The default settings
also keep each finished run's record in git (`--records`, default ``lab/results/long_horizon_runs/<sha>/<split>/``,
``<sha>`` the first 12 digits of the warm start's sha256, `warm_fingerprint`): a session on a fresh machine takes every
kept run of its warm start instead of training it again. The kit learner's warm start of the default settings is kept
in git too (`COMMITTED_WARM`, its files checked by sha256), so every machine trains from the same one: rebuilt, it
differs between CPUs with other float kernels. Each warm start's runs are kept apart and a summary never mixes two;
the default runs refuse to start without the committed `--tune` choice of their settings (`read_tuned`). `--jobs N` trains N
runs side by side as processes (on one GPU with `--device cuda`), which end with the experiment however it ends (a
SIGKILL too). Run directories stay out of git (default `--out runs/long_horizon`); the published configuration (no
`--set`, `--split test`, not `--quick`, no `--passage_words`, no
`--outcome_reward`)
writes its summary and figure to `lab/results/long_horizon.json` / `.png`, any other next to its runs.

    python lab/long_horizon.py --tune --seeds 0 1                  # each arm's settings, chosen on validation
    python lab/long_horizon.py --seeds 0 1 2 3 4 --jobs 2          # the published experiment (resumable)
    python lab/long_horizon.py --split validation --set learning_rate=3e-4   # choosing a setting
    python lab/long_horizon.py --quick --out outputs/long_horizon_quick      # CI smoke: tiny world, 1 step
    python lab/long_horizon.py --warm_only --split validation   # can the warm start play it? (no RL)

``--tune`` gives every arm the same validation budget before the test split is touched: it trains each arm at every
`TUNE_GRID` point (with the given seeds) on the validation split, into ``runs/validation_tune/``, and writes each arm's
point of best validation EM (mean over K and seeds) with every point's score to
``lab/results/long_horizon_tuned.json`` (default settings; any other next to its runs). Later runs of the same
settings, on either split, train each arm at its chosen point (`read_tuned`); without that file, at `BUDGET`'s.

``--warm_only`` builds the world and the warm start, evaluates the warm model per K in both context modes and
measures what a remembered fact is worth to it (`memory_signal`), and writes ``<out>/warm_check_<split>.json``; with
the default settings and ``--out``, also ``lab/results/long_horizon_warm_check_<split>.json`` (with its command),
which the README cites. Every run also prints the scripted perfect agent's token ratio, memory over full history,
per K on its split (`oracle_context_tokens`: the bound a memory agent that solves the task can reach), kept in the
summary and the warm check as ``scripted_oracle_tokens``.

``--learner smollm2`` replaces the kit learner (the default) with SmolLM2-135M-Instruct, fully fine-tuned
(`SMOLLM2_WARM`) twice, with the forgetful memory (the memory arms' start) and in full-history contexts (the
``full_history`` arm's start), in the world where full history is costly: ``--passage_words`` defaults to
`SMOLLM2_PASSAGE_WORDS` for it. Its world, warm starts and runs go to ``<out>/passage_words_N/smollm2/``, its summary
to ``long_horizon_smollm2.json`` / ``.png`` (``lab/results/`` only for its published configuration: no ``--set``,
``--split test``, the default passages); ``--warm_only`` checks both starts in both context modes.

    python lab/long_horizon.py --learner smollm2 --warm_only --split validation
    python lab/long_horizon.py --learner smollm2 --seeds 0 1 2

Three options, off by default (the default settings, and so the cached warm start and the finished runs, are
unchanged):

- a context budget, ``--set max_context_tokens=N`` (`MemPOConfig.max_context_tokens`): no round's context may be
  longer than N tokens; a longer one ends the episode (outcome 0; ``context_overflow`` per K and arm) or, with
  ``--set context_overflow=truncate_information``, cuts the results first. It is part of the shared budget, so every
  arm trains and is evaluated under it (`turn_protocol`); it binds full history at large K long before memory.
  It shares the world and the warm start of ``--out``; its runs go to ``runs/<split>_max_context_tokens_N/``, its
  summary and warm check to ``*_max_context_tokens_N.json`` (`budget_suffix`), so those without a budget stay;
- wiki-length passages, ``--passage_words N``: every passage padded to ~N words with filler sentences about its title
  (`bench_context_tokens.wiki_length_corpus`); with ``retrieval_topk`` 3, ``--passage_words 100`` gives
  wiki-length results (~100 words, top-3). It changes the world, so the world, the warm start (built anew), the runs
  and the summary go to ``<out>/passage_words_N/``, apart from the default ones, and ``settings["world"]`` holds it.
- ``--outcome_reward all_parts``: every arm trains on `mempo_all_parts_reward` (1 only when all K parts are right)
  instead of each part's share, which pays ``1/K`` for one search and one right value (`OUTCOME_REWARDS`); runs and
  summary get the suffix ``_all_parts``, and ``settings["outcome_reward"]`` holds it.

    python lab/long_horizon.py --split validation --set max_context_tokens=1024
    python lab/long_horizon.py --split validation --passage_words 100   # -> runs/long_horizon/passage_words_100/
    python lab/long_horizon.py --split validation --outcome_reward all_parts   # -> runs/validation_all_parts/
"""

import argparse
import collections
import json
import math
import multiprocessing
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

import learning
from learning import _machine, _versions, parse_overrides

from mempo_trl.context import COMPARED_CONTEXT_MODES as CONTEXT_MODES  # the two reference rules
from mempo_trl.kit.learner import LEARNER_INSTRUCTION


WORLD = {
    "seed": 2,
    "num_entities": 240,
    "rows_per_horizon": {"warm": 300, "rl": 120, "validation": 30, "test": 50},
    "horizons": [1, 2, 4, 6, 8],
}
"""The world (`generate_horizon_world` arguments): ~500 passages; rows per split and K."""

REPORTED_HORIZONS = (2, 4, 8)
"""The K whose targets the summary checks (every K of the world is evaluated)."""

WARM = {
    "steps": 1500,
    "batch_size": 16,
    "lr": 3e-3,
    "seed": 0,
    "mem_drop": 0.3,
    "instruction": LEARNER_INSTRUCTION,
    "fresh_names": 2,
    "fresh_values": True,
    "prompt_loss": True,
    "induction_steps": 3000,
}
"""The SFT warm start (`mempo_trl.kit.warmstart.WarmSettings`) on the oracle episodes of the warm rows: each fact is
left out of the oracle's memory with probability ``mem_drop``, so the warm model forgets values a long answer needs.
``fresh_names``: each warm row is used that many times, every made-up word of its episode (question, searches,
passages) renamed to a fresh one each time (`fresh_name_rows`), so no name repeats and the model can only learn to
copy names, not to recall them: with the warm pool's 77 names as they are, a warm start answered warm rows (K = 1,
EM 0.80) by searching for a warm name it had memorised whatever the question asked, and held-out ones not at all (EM
0.00; lab/learning.md). ``fresh_values``: each copy also redraws every value its row asks (`fresh_value`), in its
answers and passages, so no asked value can be recalled either (with the values kept, the fresh-name copies wrote
warm values with confidence: `value_copy_nll` 4.05 nats per token). ``prompt_loss``: the loss on every token of the
context, not only the completion's (`mempo_trl.kit.warmstart.sft_dataset`): the passages repeat each name, and a
model trained to predict them learns to copy (`name_copy_nll` on validation names: 2.86 / 2.86 nats after 3,000
completion-only steps, 0.40 / 0.14 after 1,500 with it). Check it with ``--warm_only`` before any RL: with all of
these the learner copies names but not values (`value_copy_nll` ~1.74; lab/learning.md). ``induction_steps``: the
model built from scratch first learns to copy (`induction_pretraining.induction_pretrain`, a copy task of random
tokens), the skill a pretrained language model brings: without it the lookup a memory needs (the value that follows
*this* name, after a ``:`` every fact shares) is not learned from the episodes (`lab/induction.py`)."""

VOCABULARY_SIZE = 1024
"""Upper bound of the learner's vocabulary, trained on the corpus without the asked-about names (`vocabulary_texts`):
small enough that a held-out name splits into pieces the warm data shows (`name_token_coverage` 0.99 on this world's
validation and test names, 6.2-6.6 tokens per name; the 8,192 bound gives 0.91-0.94 at 4.2-4.6 tokens, and a
vocabulary trained with the names 0.71-0.73; lab/learning.md)."""

OUTCOME_REWARDS = {"each_part": "mempo_outcome_reward", "all_parts": "mempo_all_parts_reward"}
"""``--outcome_reward``: the `mempo_trl.rewards` function every arm trains on. Evaluation always reports EM with each
part's share (`mempo_outcome_reward`)."""

CHECKPOINT_EVERY = 10
"""RL steps between the checkpoints of a run (the newest kept): a stopped run resumes from the newest one."""

ARMS = {
    **learning.ARMS,
    "mempo": {"memory_scale_rewards": "batch"},
    "outcome_only_dynamic": {"memory_coef": 0.0, "dynamic_sampling": "refill"},
}
"""The arms: MemPOConfig overrides of `BUDGET`. MemPO divides its memory advantage by the batch's std instead of each
question's (`memory_scale_rewards`), chosen on validation: with the per-question std, seed 0 stopped answering
(lab/learning.md, "The long-horizon experiment"). ``outcome_only_dynamic`` is outcome-only with DAPO's dynamic
sampling (`MemPOConfig.dynamic_sampling`): its all-equal groups are replaced by groups of further RL prompts, so that
a step where every answer scores the same still trains; it is the fair baseline for MemPO's claim that the memory
advantage gives a gradient there. A run is keyed by `run_settings`, so changing one arm redoes only its runs."""

COMPARED_ARMS = ("mempo", "outcome_only", "full_history")
"""The arms `targets` compares."""

HELD_OUT_SPLITS = ("validation", "test")
"""The splits whose entities RL episodes cannot retrieve (`rl_corpus`)."""

TUNE_GRID = ({"learning_rate": 1e-4}, {"learning_rate": 3e-4}, {"learning_rate": 1e-3})
"""``--tune``: the settings every arm is tried at on the validation split, the same grid and seeds for each arm, so
each gets the same validation budget; the arm's own settings (`ARMS`) hold on top of each point."""

RL_CORPUS = "corpus without the passages that name a validation or test entity"
"""What RL episodes search (`rl_corpus`); part of every run's key (`run_settings`). Evaluation searches the whole
corpus."""

BUDGET = {
    "max_steps": 60,
    "per_device_train_batch_size": 16,
    "num_generations": 4,
    "learning_rate": 3e-4,
    "max_completion_length": 192,
    "max_turns": 10,
    "retrieval_topk": 3,
    "temperature": 0.7,
    "beta": 0.0,
    "loss_type": "dapo",
    "instruction": LEARNER_INSTRUCTION,
}
"""What every arm gets; ``max_turns`` = the largest K + 2; an 8-objective answer turn is up to ~170 tokens."""

QUICK = {
    "world": {
        "seed": 2,
        "num_entities": 60,
        "rows_per_horizon": {"warm": 6, "rl": 4, "validation": 2, "test": 2},
        "horizons": [1, 4],
    },
    "warm": {"steps": 2, "batch_size": 4, "induction_steps": 2},
    "budget": {"max_steps": 1, "per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 48},
}

LEARNERS = ("kit", "smollm2")

COMMITTED_WARM = Path("lab/results/long_horizon_warm")
"""The kit learner's warm start of the default settings, kept in git (weights, tokenizer, `WARM_MANIFEST`): every
machine trains from the same one instead of rebuilding it (43 min), since machines with other float kernels build
different ones. Relative to the repository root, where the experiment runs, as its other results are."""
WARM_MANIFEST = "manifest.json"
"""``--learner``: the kit learner built from scratch (`WARM`, the default) or SmolLM2-135M-Instruct (`SMOLLM2_WARM`)."""

SMOLLM2_WARM = {
    "steps": 300,
    "batch_size": 8,
    "lr": 3e-5,
    "seed": 0,
    "mem_drop": WARM["mem_drop"],
    "instruction": LEARNER_INSTRUCTION,
}
"""``--learner smollm2``: SmolLM2-135M-Instruct (`mempo_trl.kit.smollm2`, built offline from its wheel) is
pretrained, so it needs no copy task, no made-up-name copies and no vocabulary of its own; it is fully fine-tuned
(`WarmSettings`, TRL's `SFTTrainer`, no LoRA) on the oracle episodes of the warm rows twice: with the forgetful
memory (``mem_drop``; the start of the memory arms) and in full-history contexts (the ``full_history`` arm's
start)."""

SMOLLM2_CHECKPOINT_EVERY = 20
"""SFT steps between the checkpoints of a SmolLM2 warm start (the newest kept, ~1.6 GB with its optimizer): a stopped
warm start resumes from it."""

SMOLLM2_PASSAGE_WORDS = 100
"""``--learner smollm2`` plays the world where full history is costly: wiki-length results (``--passage_words``
defaults to 100 for it, and its published configuration is that one)."""

QUICK_SMOLLM2 = {
    "world": {
        "seed": 2,
        "num_entities": 60,
        "rows_per_horizon": {"warm": 2, "rl": 2, "validation": 1, "test": 1},
        "horizons": [1, 2],
    },
    "warm": {"steps": 1, "batch_size": 2},
    "budget": {"max_steps": 1, "per_device_train_batch_size": 2, "num_generations": 2, "max_completion_length": 48},
}
"""``--quick --learner smollm2``: 1 SFT step per start, 1 RL step, 2 evaluated questions (K = 1 and 2)."""

_WORDS = re.compile(r"\w+")


def _within(value: str, text: str) -> bool:
    """``value`` occurs in ``text`` as whole words, case and punctuation aside."""
    words = " ".join(_WORDS.findall(value.lower()))
    return bool(words) and f" {words} " in " " + " ".join(_WORDS.findall(text.lower())) + " "


def recall_where_needed(record: dict, values: list[str]) -> float | None:
    """Share of the values found before the last search that the memory of the last round's context still holds.

    The last round sees the previous turn (its ``<mem>``) and that turn's search result; a value retrieved in an
    earlier round and absent from that result reaches the last round only through the memory. None when no value
    depends on the memory (fewer than two rounds, or every needed value is in the latest result).

    Example:
        >>> info = lambda text: f"<information>Doc 1(Title: x) {text}</information>"
        >>> rounds = [{"mem": "Nothing yet.", "information": info("A was born in 1801.")},
        ...           {"mem": "A: 1801.", "information": info("B was born in 1802.")},
        ...           {"mem": "B: 1802.", "information": info("C was born in 1803.")},
        ...           {"mem": "A: 1801. B: 1802. C: 1803.", "information": None}]
        >>> recall_where_needed({"rounds": rounds}, ["1801", "1802", "1803"])
        0.5
    """
    rounds = record["rounds"]
    if len(rounds) < 2:
        return None
    before = rounds[-2]
    earlier = " ".join(r.get("information") or "" for r in rounds[:-2])
    latest = before.get("information") or ""
    needed = [v for v in values if _within(v, earlier) and not _within(v, latest)]
    if not needed:
        return None
    return sum(_within(v, before.get("mem") or "") for v in needed) / len(needed)


def evaluate_horizons(model, tokenizer, rows: list[dict], retriever, budget: dict, context_mode: str) -> dict:
    """Greedy episodes of ``rows``; per K (``horizon_K``): EM, F1, tokens per question, peak context, turns, memory
    recall where it matters (`recall_where_needed`, memory context only) and the share of rows per failure kind."""
    from analytics import FAILURE_KINDS, failure_kind

    from mempo_trl.agent import MemPOAgent
    from mempo_trl.evaluation import evaluate
    from mempo_trl.generation import HFGenerator

    protocol = turn_protocol(budget, context_mode)
    generator = HFGenerator(model, tokenizer, budget["max_completion_length"], temperature=0.0, batch_size=32)
    result = evaluate(MemPOAgent(tokenizer, retriever, generator, protocol), rows, progress=False)
    memory = context_mode == "memory"
    per_k: dict[str, dict] = {}
    for source, m in result.metrics["by_data_source"].items():
        pairs = [(row, rec) for row, rec in zip(rows, result.records) if rec["data_source"] == source]
        values = [[str(answers[0]) for answers in row["sub_answers"]] for row, _ in pairs]
        recalls = [recall_where_needed(rec, v) for (_, rec), v in zip(pairs, values)] if memory else []
        recalls = [r for r in recalls if r is not None]
        kinds = [failure_kind(rec, v, memory) for (_, rec), v in zip(pairs, values)]
        per_k[source.removeprefix("horizon_")] = {
            "rows": len(pairs),
            "em": m["em"],
            "all_parts_em": statistics.fmean(float(rec["em"] == 1.0) for _, rec in pairs),
            "f1": m["f1"],
            "format_valid": m["format_valid"],
            "turns": m["turns_per_question"],
            "searches": m["searches_per_question"],
            "tokens_per_question": m["total_tokens_per_question"],
            "peak_context_tokens": m["peak_context_tokens"],
            "memory_recall": statistics.fmean(recalls) if recalls else None,
            "failures": {kind: kinds.count(kind) / len(kinds) for kind in FAILURE_KINDS},
        }
        if protocol.max_context_tokens is not None:  # only with a context budget: the default output is unchanged
            per_k[source.removeprefix("horizon_")]["context_overflow"] = m["context_overflow"]
    return per_k


def turn_protocol(budget: dict, context_mode: str):
    """The `TurnProtocol` that training builds from ``budget`` (its protocol fields: prompts, turns, top-k, turn
    length, ``max_context_tokens`` and ``context_overflow`` when set) in ``context_mode``: evaluation plays by the same
    rule as training. A bad value raises `ValueError` naming the field."""
    from dataclasses import fields

    from mempo_trl.protocol import TurnProtocol

    known = {f.name for f in fields(TurnProtocol)} - {"action"}
    return TurnProtocol(**{**{k: v for k, v in budget.items() if k in known}, "context_mode": context_mode})


def vocabulary_texts(passages: list[dict], names: list[str]) -> list[str]:
    """The texts the learner's tokenizer is trained on: the corpus with every asked-about entity's name cut out, so
    that no name becomes one token and a held-out name splits into pieces that the warm rows' names also use
    (`name_token_coverage` measures it).

    Example:
        >>> vocabulary_texts([{"contents": "Feivul Halkar was a painter."}], ["Feivul Halkar"])
        ['  was a painter.']
    """
    pattern = re.compile("|".join(re.escape(name) for name in sorted(names, key=len, reverse=True)))
    return [pattern.sub(" ", passage["contents"]) for passage in passages]


def name_token_coverage(tokenizer, names: list[str], texts: list[str]) -> float:
    """Share of the tokens of ``names`` (each after a space, as in a question) that also occur in ``texts``
    tokenized: a token that never occurs in the warm start's data keeps its random embedding and cannot be copied."""
    seen = {token for text in texts for token in tokenizer(text, add_special_tokens=False)["input_ids"]}
    tokens = [token for name in names for token in tokenizer(" " + name, add_special_tokens=False)["input_ids"]]
    return sum(token in seen for token in tokens) / max(1, len(tokens))


def _completion_nll(model, prompt: list[int], completion: list[int]) -> list[float]:
    """Teacher-forced NLL (nats) of each token of ``completion`` after ``prompt``."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion], device=model.device)).logits[0, len(prompt) - 1 : -1]
    return (-logits.float().log_softmax(-1).gather(1, torch.tensor(completion, device=model.device)[:, None]))[
        :, 0
    ].tolist()


def _find(tokens: list[int], part: list[int]) -> int:
    return next(i for i in range(len(tokens)) if tokens[i : i + len(part)] == part)


def name_copy_nll(model, tokenizer, rows: list[dict], retriever, instruction: str) -> dict:
    """Does the model copy a name from the question? Teacher-forced NLL (nats) of the asked entity's name in the first
    search of each row's oracle episode: ``first`` (the name's first token: which entity) and ``later`` (the rest,
    given the first); a model that copies scores near 0, one that guesses a made-up word ~3-4."""
    from mempo_trl.kit.warmstart import sft_examples
    from mempo_trl.oracle import subject

    first, later = [], []
    for row in rows:
        prompt, completion = sft_examples([row], retriever, tokenizer, instruction=instruction, max_turns=99)[0]
        name = tokenizer(" " + subject(row["hop_queries"][0]), add_special_tokens=False)["input_ids"]
        start = _find(completion, name)
        nll = _completion_nll(model, prompt, completion)
        first.append(nll[start])
        later += nll[start + 1 : start + len(name)]
    return {"first": statistics.fmean(first), "later": statistics.fmean(later), "rows": len(rows)}


def value_copy_nll(model, tokenizer, rows: list[dict], retriever, instruction: str) -> dict:
    """Does the model copy a value into its memory? Teacher-forced NLL (nats per token) of the first asked value of
    each row's oracle episode: ``value`` in the memory written after the first search, whose result (in the
    context) holds it; ``from_memory`` (rows with K >= 2, ``rows_from_memory`` of them) in the memory written after
    the second search, whose previous memory (in the context) holds it verbatim: the lookup by name alone. Near 0
    for a model that copies, ~2.3 per guessed digit; the space before the value is not counted."""
    from mempo_trl.kit.warmstart import sft_examples

    nlls: dict[str, list[float]] = {"value": [], "from_memory": []}
    count = 0
    for row in rows:
        examples = sft_examples([row], retriever, tokenizer, instruction=instruction, max_turns=99)
        value = tokenizer(" " + str(row["sub_answers"][0][0]), add_special_tokens=False)["input_ids"]
        skip = tokenizer.decode(value[:1]) == " "
        for key, (prompt, completion) in zip(nlls, examples[1 : 2 + (len(row["hop_queries"]) >= 2)]):
            start = _find(completion, value)
            nlls[key] += _completion_nll(model, prompt, completion)[start + skip : start + len(value)]
            count += key == "from_memory"
    return {
        "value": statistics.fmean(nlls["value"]),
        "from_memory": statistics.fmean(nlls["from_memory"]) if nlls["from_memory"] else None,
        "rows": len(rows),
        "rows_from_memory": count,
    }


def prepare(out: Path, world: dict, warm: dict, device: str, learner: str = "kit") -> tuple[dict, dict[str, Path]]:
    """Write the world's files (reused when the settings match; with ``world["passage_words"]``, every passage padded
    to that many words by `bench_context_tokens.wiki_length_corpus`) and build the warm start(s): the kit learner
    into ``out/warm_model`` (cached: same size, settings and data), SmolLM2's by `smollm2_warm_starts`. Returns the
    world's paths and the warm model each context mode's arms start from."""
    from mempo_trl.data import read_jsonl
    from mempo_trl.kit.demo_world import write_jsonl

    paths = write_world(out, world)
    if learner == "smollm2":
        warm_dirs = smollm2_warm_starts(out, paths, world, warm, device)
    else:
        warm_dir = kit_warm_start(out, paths, world, warm, device)
        warm_dirs = dict.fromkeys(CONTEXT_MODES, warm_dir)
    # not in `paths` above: the warm start's key covers the world's own files only
    pools = json.loads((out / "world" / "world.json").read_text())["pools"]
    paths["corpus_rl"] = out / "world" / "corpus_rl.jsonl"
    held_out = [name for split in HELD_OUT_SPLITS for name in pools[split]]
    write_jsonl(paths["corpus_rl"], rl_corpus(read_jsonl(paths["corpus"]), held_out))
    return paths, warm_dirs


def write_world(out: Path, world: dict) -> dict[str, Path]:
    """Write the world's corpus and splits under ``out/world`` (reused when ``world`` matches); return their paths."""
    from horizon_world import HORIZON_SPLITS

    from mempo_trl.kit.demo_world import write_jsonl

    world_dir = out / "world"
    paths = {name: world_dir / f"{name}.jsonl" for name in ("corpus", *HORIZON_SPLITS)}
    marker = world_dir / "world.json"
    if not (marker.is_file() and json.loads(marker.read_text())["world"] == world):
        generated = generate_world(world)
        passages = generated.passages
        if "passage_words" in world:
            from bench_context_tokens import wiki_length_corpus

            passages = wiki_length_corpus(passages, world["passage_words"], seed=world["seed"])
        world_dir.mkdir(parents=True, exist_ok=True)
        write_jsonl(paths["corpus"], passages)
        for name in HORIZON_SPLITS:
            write_jsonl(paths[name], generated.splits[name])
        marker.write_text(json.dumps({"world": world, "pools": generated.pools}, indent=1))
    return paths


def _data_digest(paths: dict[str, Path]) -> str:
    import hashlib

    return hashlib.sha256(b"".join(p.read_bytes() for p in paths.values())).hexdigest()


def warm_fingerprint(warm_dirs: dict[str, Path]) -> str:
    """The sha256 of the warm start(s) every run trains from (the weights of each context mode's warm model, in
    `CONTEXT_MODES` order): part of every run's key, so a kept record (``--records``) is reused only by a run from
    the very same warm start."""
    import hashlib

    digest = hashlib.sha256()
    for mode in CONTEXT_MODES:
        for weights in sorted(Path(warm_dirs[mode]).glob("*.safetensors")):
            digest.update(weights.read_bytes())
    return digest.hexdigest()


def kit_warm_start(out: Path, paths: dict[str, Path], world: dict, warm: dict, device: str) -> Path:
    """The kit learner (`LEARNER_SIZE`, `VOCABULARY_SIZE`) built and warm-started (`WARM`) in ``out/warm_model``."""
    from induction_pretraining import induction_pretrain

    from mempo_trl.checkpoints import newest_complete_checkpoint
    from mempo_trl.data import read_jsonl
    from mempo_trl.kit.learner import LEARNER_SIZE
    from mempo_trl.kit.tiny import build_tiny_model
    from mempo_trl.kit.warmstart import WARM_START_FILE, WarmSettings, sft_warm_start
    from mempo_trl.retrieval import BM25Retriever

    marker = out / "world" / "world.json"
    warm_dir = out / "warm_model"
    digest = _data_digest(paths)
    size = {**LEARNER_SIZE, "vocab_size": VOCABULARY_SIZE}
    key = {"size": size, "warm": warm, "data_sha256": digest, "vocabulary": "corpus without asked-about names"}
    warm_marker = warm_dir / WARM_START_FILE
    if restore_committed_warm(warm_dir, key):
        return warm_dir
    if not (warm_marker.is_file() and json.loads(warm_marker.read_text()).get("horizon") == key):
        # A stopped warm start resumes from its newest checkpoint, unless that was made for another key.
        started = warm_dir / "horizon_key.json"
        if not (started.is_file() and json.loads(started.read_text()) == key):
            shutil.rmtree(warm_dir / "sft", ignore_errors=True)
        corpus = read_jsonl(paths["corpus"])
        names = [name for pool in json.loads(marker.read_text())["pools"].values() for name in pool]
        build_tiny_model(warm_dir, seed=0, corpus_texts=vocabulary_texts(corpus, names), **size)
        started.write_text(json.dumps(key))
        retriever = BM25Retriever.from_corpus(str(paths["corpus"]), cache_dir=str(out / "bm25"))
        max_turns = max(world["horizons"]) + 2
        if warm.get("induction_steps") and newest_complete_checkpoint(warm_dir / "sft") is None:
            induced = induction_pretrain(warm_dir, warm["induction_steps"], seed=warm["seed"], use_cpu=device == "cpu")
            print(
                f"induction pretraining: {induced['steps']} steps, copy loss {induced['initial_loss']:.3f} -> "
                f"{induced['final_loss']:.3f} ({induced['seconds'] / 60:.1f} min)",
                flush=True,
            )
        extra = ("fresh_names", "fresh_values", "prompt_loss", "induction_steps")
        settings = {k: v for k, v in warm.items() if k not in extra}
        rows = read_jsonl(paths["warm"])
        if warm.get("fresh_names"):
            words = generate_world(world).words
            rows, retriever = fresh_name_rows(
                rows,
                retriever,
                words,
                warm["fresh_names"],
                warm["seed"],
                topk=3,
                fresh_values=warm.get("fresh_values", False),
            )
        stats = sft_warm_start(
            warm_dir,
            rows,
            retriever,
            WarmSettings(**settings),
            max_turns,
            use_cpu=device == "cpu",
            checkpoint_every=250,
            prompt_loss=warm.get("prompt_loss", False),
        )  # resumable
        print(
            f"warm start: {stats['steps']} SFT steps on {stats['examples']} rounds, loss "
            f"{stats['initial_loss']:.3f} -> {stats['final_loss']:.3f} ({stats['seconds'] / 60:.1f} min)",
            flush=True,
        )
        warm_marker.write_text(json.dumps({**json.loads(warm_marker.read_text()), "horizon": key}, indent=2))
    return warm_dir


def _file_sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def restore_committed_warm(warm_dir: Path, key: dict, committed: Path = COMMITTED_WARM) -> bool:
    """Copy the committed warm start (``committed``) into ``warm_dir`` when it was built for ``key`` (a warm start
    built on this machine is replaced by it); ``False`` when there is none or it is for other settings. Raises
    ``ValueError`` when a committed file does not match the sha256 its manifest records (a damaged or hand-edited copy
    is never trained from)."""
    manifest_path = committed / WARM_MANIFEST
    if not manifest_path.is_file():
        return False
    manifest = json.loads(manifest_path.read_text())
    if manifest["horizon"] != key:
        return False
    for name, digest in manifest["files"].items():
        if not (committed / name).is_file() or _file_sha256(committed / name) != digest:
            raise ValueError(
                f"{committed / name} does not match the sha256 in {manifest_path}: restore it with "
                f"`git checkout -- {committed}`, or delete {committed} to rebuild the warm start (43 min)"
            )
    here = {p.name for p in warm_dir.glob("*") if p.is_file()} if warm_dir.is_dir() else set()
    if set(manifest["files"]) <= here and all(_file_sha256(warm_dir / n) == d for n, d in manifest["files"].items()):
        return True
    shutil.rmtree(warm_dir, ignore_errors=True)
    warm_dir.mkdir(parents=True)
    for name in manifest["files"]:
        shutil.copyfile(committed / name, warm_dir / name)
    print(f"warm start: the committed one ({committed}, sha256 {manifest['warm_sha256'][:12]})", flush=True)
    return True


def commit_warm(warm_dir: Path, command: str, committed: Path = COMMITTED_WARM) -> None:
    """Keep the warm start of ``warm_dir`` (its top-level files: weights, config, tokenizer, `WARM_START_FILE`) in
    ``committed`` with a manifest of their sha256, its key (the ``horizon`` of `WARM_START_FILE`), the warm start's
    fingerprint and the command that built it."""
    from mempo_trl.kit.warmstart import WARM_START_FILE

    key = json.loads((warm_dir / WARM_START_FILE).read_text())["horizon"]
    files = sorted(p for p in warm_dir.iterdir() if p.is_file() and p.name != "horizon_key.json")
    committed.mkdir(parents=True, exist_ok=True)
    for path in files:
        shutil.copyfile(path, committed / path.name)
    manifest = {
        "horizon": key,
        "warm_sha256": warm_fingerprint(dict.fromkeys(CONTEXT_MODES, warm_dir)),
        "files": {p.name: _file_sha256(p) for p in files},
        "command": command,
        "machine": _machine(),
    }
    (committed / WARM_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"kept the warm start in {committed}", flush=True)


def smollm2_warm_starts(out: Path, paths: dict[str, Path], world: dict, warm: dict, device: str) -> dict[str, Path]:
    """SmolLM2-135M-Instruct (`mempo_trl.kit.smollm2.build_smollm2_model`, once into ``out/smollm2_base``) fully
    fine-tuned (`SMOLLM2_WARM`) on the oracle episodes of the warm rows in each context mode, into
    ``out/warm_model_<mode>`` (cached: same settings and data); returns them by context mode."""
    from mempo_trl.data import read_jsonl
    from mempo_trl.kit.smollm2 import build_smollm2_model
    from mempo_trl.kit.warmstart import WARM_START_FILE, WarmSettings, sft_warm_start
    from mempo_trl.retrieval import BM25Retriever

    base = out / "smollm2_base"
    if not (base / "model.safetensors").is_file():
        build_smollm2_model(base)
    digest, warm_dirs = _data_digest(paths), {}
    for mode in CONTEXT_MODES:
        warm_dir = warm_dirs[mode] = out / f"warm_model_{mode}"
        key = {"learner": "smollm2", "warm": warm, "context_mode": mode, "data_sha256": digest}
        warm_marker = warm_dir / WARM_START_FILE
        if warm_marker.is_file() and json.loads(warm_marker.read_text()).get("horizon") == key:
            continue
        # A stopped warm start resumes from its newest checkpoint, unless that was made for another key.
        started = warm_dir / "horizon_key.json"
        if not (started.is_file() and json.loads(started.read_text()) == key):
            shutil.rmtree(warm_dir, ignore_errors=True)
            shutil.copytree(base, warm_dir)
            started.write_text(json.dumps(key))
        retriever = BM25Retriever.from_corpus(str(paths["corpus"]), cache_dir=str(out / "bm25"))
        stats = sft_warm_start(
            warm_dir,
            read_jsonl(paths["warm"]),
            retriever,
            WarmSettings(**warm),
            max(world["horizons"]) + 2,
            use_cpu=device == "cpu",
            context_mode=mode,
            checkpoint_every=SMOLLM2_CHECKPOINT_EVERY,
        )
        print(
            f"warm start ({mode}): {stats['steps']} SFT steps on {stats['examples']} rounds, loss "
            f"{stats['initial_loss']:.3f} -> {stats['final_loss']:.3f} ({stats['seconds'] / 60:.1f} min)",
            flush=True,
        )
        warm_marker.write_text(json.dumps({**json.loads(warm_marker.read_text()), "horizon": key}, indent=2))
    return warm_dirs


def load_learner(path: str | Path):
    """``(model, tokenizer)`` of a warm start or checkpoint folder (either learner), the model in eval mode."""
    from transformers import AutoModelForCausalLM

    from mempo_trl.loading import load_tokenizer

    return AutoModelForCausalLM.from_pretrained(str(path)).eval(), load_tokenizer(path)


def oracle_context_tokens(rows: list[dict], retriever, tokenizer, budget: dict) -> dict:
    """The scripted perfect agent's cost per K: its episodes (`oracle_episode_turns`, every fact kept) played in both
    context modes, each round's context rebuilt as training rebuilds it (`sft_examples`); per K (``horizon_K``) the
    tokens per question (every round's prompt and turn) and the peak context in each mode, and ``ratio``: memory
    tokens over full-history tokens, the bound a memory agent that solves the task can reach. Rows the oracle cannot
    play (a missed passage) are left out."""
    from mempo_trl.kit.warmstart import sft_examples

    cells: dict[str, dict] = {}
    for row in rows:
        try:
            played = {
                mode: sft_examples(
                    [row],
                    retriever,
                    tokenizer,
                    mode,
                    budget["retrieval_topk"],
                    instruction=budget["instruction"],
                    max_turns=budget["max_turns"],
                )
                for mode in CONTEXT_MODES
            }
        except ValueError:
            continue
        cell = cells.setdefault(row["data_source"].removeprefix("horizon_"), {"rows": 0})
        cell["rows"] += 1
        for mode, examples in played.items():  # the eos that ends each SFT completion is not part of the turn
            cell[f"tokens_{mode}"] = cell.get(f"tokens_{mode}", 0) + sum(len(p) + len(c) - 1 for p, c in examples)
            cell[f"peak_{mode}"] = max(cell.get(f"peak_{mode}", 0), max(len(p) for p, _ in examples))
    for cell in cells.values():
        for mode in CONTEXT_MODES:
            cell[f"tokens_{mode}"] /= cell["rows"]
        cell["ratio"] = cell["tokens_memory"] / cell["tokens_full_history"]
    return dict(sorted(cells.items(), key=lambda item: int(item[0])))


def generate_world(world: dict):
    """The `HorizonWorld` of ``world`` (`WORLD`-shaped settings; ``passage_words`` is applied to its corpus by
    `prepare`, not here): seeded, so the same settings give the same world."""
    from horizon_world import generate_horizon_world

    arguments = {k: v for k, v in world.items() if k != "passage_words"}
    return generate_horizon_world(**{**arguments, "horizons": tuple(world["horizons"])})


class FrozenRetriever:
    """A retriever that answers the queries of a table (query -> passages) and nothing else."""

    def __init__(self, table: dict):
        self.table = table

    def search(self, queries: list[str], topk: int) -> list[list]:
        return [self.table[query][:topk] for query in queries]


def _renamer(pattern: re.Pattern, fresh):
    """A function that replaces each match of ``pattern`` by the word ``fresh()`` drew for it (one per match text)."""
    names: dict[str, str] = {}

    def rename(text: str) -> str:
        return pattern.sub(lambda m: names.get(m[0]) or names.setdefault(m[0], fresh()), text)

    return rename


_NUMBER = re.compile(r"(\d[\d,]*)(.*)")


def fresh_value(rng, answers: list[str]) -> tuple[list[str], dict[str, str]]:
    """A value drawn afresh for the answer forms ``answers`` (a `HORIZON_ATTRIBUTES` value: a number, written with or
    without thousands separators and a unit, or an occupation), and how each form of it reads in a passage.

    A number keeps its first digit and its length (a year stays a year of its century) and changes; an occupation
    becomes another of `mempo_trl.kit.demo_world`'s occupations. Returns ``(new answers, {old text: new text})`` (for
    `_revaluer`); any other value stays as it is.

    Example:
        >>> import random
        >>> answers, forms = fresh_value(random.Random(0), ["1,252 kilometres", "1252 kilometres", "1252 km", "1252"])
        >>> answers[0][0] == "1" and len(answers[0]) == len("1,252 kilometres") and answers[0] != "1,252 kilometres"
        True
        >>> [a.replace(answers[3], "N") for a in answers[1:]], sorted(forms) == ["1,252", "1252"]
        (['N kilometres', 'N km', 'N'], True)
        >>> fresh_value(random.Random(0), ["painter"])[0] != ["painter"]
        True
    """
    from mempo_trl.kit.demo_world import OCCUPATIONS

    match = _NUMBER.fullmatch(answers[0])
    if match:
        old = int(match[1].replace(",", ""))
        digits = str(old)
        new = old
        while new == old:
            new = int(digits[0] + "".join(str(rng.randrange(10)) for _ in digits[1:]))
        forms = {f"{old:,}": f"{new:,}", str(old): str(new)}
        return [_revaluer(forms)(answer) for answer in answers], forms
    if answers[0] in OCCUPATIONS:
        new_word = rng.choice([o for o in OCCUPATIONS if o != answers[0]])
        return [new_word], {answers[0]: new_word}
    return list(answers), {}


def _revaluer(forms: dict[str, str]):
    """A function that rewrites, in one pass, every whole occurrence of each key of ``forms`` to its value: a number
    not inside a longer one, a word with its article made to agree ("a painter" -> "an engineer")."""
    from mempo_trl.kit.demo_world import article

    def alternatives(keys):
        return "|".join(re.escape(key) for key in sorted(keys, key=len, reverse=True))

    numbers = [key for key in forms if key[0].isdigit()]
    words = [key for key in forms if not key[0].isdigit()]
    branches = [r"(?<![\d,])(?P<number>" + alternatives(numbers) + r")(?!,?\d)"] if numbers else []
    branches += [r"\b(?P<article>an? )?(?P<word>" + alternatives(words) + r")\b"] if words else []
    if not branches:
        return lambda text: text
    pattern = re.compile("|".join(branches))

    def replace(match: re.Match) -> str:
        found = match.groupdict()
        if found.get("number"):
            return forms[found["number"]]
        new = forms[found["word"]]
        return article(new) if found["article"] else new

    return lambda text: pattern.sub(replace, text)


def fresh_name_rows(
    rows: list[dict], retriever, words: list[str], copies: int, seed: int, topk: int, fresh_values: bool = False
):
    """``copies`` renamed copies of ``rows`` and a `FrozenRetriever` that answers their searches.

    In each copy of a row, every one of the world's made-up ``words`` in the row's question, searches and their
    ``topk`` passages (from ``retriever``) is replaced, as a whole word, by a fresh made-up word drawn for that copy
    (`mempo_trl.kit.demo_world.made_up_word`, never a word of the world nor of another copy), the same word for the
    same word throughout the episode. With ``fresh_values`` each value the row asks about is redrawn too
    (`fresh_value`), in its answers and, in every form, in its passages; else the values stay. Returns ``(rows,
    retriever)``: the oracle episodes of the renamed rows read like the originals with other names (and values).

    Example:
        >>> from mempo_trl.retrieval import Passage
        >>> row = {"id": "r", "question": "1. When was Kisek born?", "hop_queries": ["When was Kisek born?"],
        ...        "sub_questions": ["When was Kisek born?"], "sub_answers": [["1801"]]}
        >>> class One:
        ...     def search(self, queries, topk):
        ...         return [[Passage(id="0", title="Kisek", text="Kisek was born in 1801 in Hosnotrol.")]]
        >>> rows, frozen = fresh_name_rows([row], One(), ["Hosnotrol", "Kisek"], copies=1, seed=0, topk=3)
        >>> name = rows[0]["hop_queries"][0].split()[2]
        >>> name not in ("Kisek", "Hosnotrol"), rows[0]["question"] == f"1. When was {name} born?"
        (True, True)
        >>> passage = frozen.search(rows[0]["hop_queries"], 3)[0][0]
        >>> passage.title == name and passage.text.startswith(f"{name} was born in 1801 in ")
        True
        >>> rows, frozen = fresh_name_rows([row], One(), ["Hosnotrol", "Kisek"], 1, seed=0, topk=3, fresh_values=True)
        >>> year = rows[0]["sub_answers"][0][0]
        >>> year != "1801", rows[0]["golden_answers"] == [year], f"born in {year} in" in frozen.table[
        ...     rows[0]["hop_queries"][0]][0].text
        (True, True, True)
    """
    import random

    from mempo_trl.kit.demo_world import made_up_word
    from mempo_trl.retrieval import Passage

    rng, used = random.Random(seed), set(words)
    pattern = re.compile(r"\b(?:" + "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)) + r")\b")
    renamed, table = [], {}
    for copy in range(copies):
        for row in rows:
            results = retriever.search(list(row["hop_queries"]), topk)
            rename = _renamer(pattern, lambda: made_up_word(rng, used))
            new = {**row, "id": f"{row['id']}_fresh{copy}", "question": rename(row["question"])}
            for field in ("hop_queries", "sub_questions"):
                new[field] = [rename(text) for text in row[field]]
            revalue = _revaluer({})  # no values redrawn: the identity
            if fresh_values:
                drawn: dict[str, tuple] = {}  # a value asked twice in a row is redrawn once
                redrawn = [drawn.get(a[0]) or drawn.setdefault(a[0], fresh_value(rng, a)) for a in row["sub_answers"]]
                revalue = _revaluer({old: new for _, forms in redrawn for old, new in forms.items()})
                new["sub_answers"] = [answers for answers, _ in redrawn]
                new["golden_answers"] = ["; ".join(answers[0] for answers in new["sub_answers"])]
            for query, passages in zip(new["hop_queries"], results):
                table[query] = [
                    Passage(id=p.id, title=rename(p.title), text=revalue(rename(p.text))) for p in passages
                ]
            renamed.append(new)
    return renamed, FrozenRetriever(table)


def budget_suffix(budget: dict) -> str:
    """``"_max_context_tokens_N"`` with a context budget, else ``""``: runs, summary and warm check of a budget get
    their own names, while the world and the warm start are shared with the runs without one.

    Example:
        >>> budget_suffix(BUDGET), budget_suffix({**BUDGET, "max_context_tokens": 1024})
        ('', '_max_context_tokens_1024')
    """
    tokens = budget.get("max_context_tokens")
    return "" if tokens is None else f"_max_context_tokens_{tokens}"


def smollm2_warm_check(out: Path, paths: dict, warm_dirs: dict[str, Path], budget: dict, split: str) -> dict:
    """SmolLM2's warm starts (``start``: the context mode each was fine-tuned in) per K on ``split``, each in both
    context modes (`evaluate_horizons`: EM, all-parts EM, turns, searches, tokens, peak context, memory recall)."""
    from mempo_trl.data import read_jsonl
    from mempo_trl.retrieval import BM25Retriever

    retriever = BM25Retriever.from_corpus(str(paths["corpus"]), cache_dir=str(out / "bm25"))
    rows = read_jsonl(paths[split])
    check: dict[str, dict] = {}
    for start, warm_dir in warm_dirs.items():
        model, tokenizer = load_learner(warm_dir)
        check[start] = {
            mode: evaluate_horizons(model, tokenizer, rows, retriever, budget, mode) for mode in CONTEXT_MODES
        }
        for k, cell in check[start]["memory"].items():
            full = check[start]["full_history"][k]
            print(
                f"{start} start, K={k}: EM memory {cell['em']:.2f} full {full['em']:.2f} | all parts "
                f"{cell['all_parts_em']:.2f} / {full['all_parts_em']:.2f} | searches {cell['searches']:.1f} / "
                f"{full['searches']:.1f} | tokens {cell['tokens_per_question']:.0f} / {full['tokens_per_question']:.0f} "
                f"| recall {cell['memory_recall']}",
                flush=True,
            )
    return check


def warm_check(out: Path, paths: dict, warm_dir: Path, budget: dict, split: str) -> dict:
    """The warm model per K on ``split`` in both context modes, and its `memory_signal` (does a fact in the memory
    raise P(gold)?)."""
    from analytics import memory_signal

    from mempo_trl.data import read_jsonl
    from mempo_trl.retrieval import BM25Retriever

    retriever = BM25Retriever.from_corpus(str(paths["corpus"]), cache_dir=str(out / "bm25"))
    rows = read_jsonl(paths[split])
    model, tokenizer = load_learner(warm_dir)
    check = {
        mode: evaluate_horizons(model, tokenizer, rows, retriever, budget, mode) for mode in ("memory", "full_history")
    }
    check["memory_signal"] = memory_signal(model, tokenizer, rows, retriever, instruction=budget["instruction"])
    pools = json.loads((out / "world" / "world.json").read_text())["pools"]
    warm_texts = [row["question"] for row in read_jsonl(paths["warm"])]
    warm_texts += [
        p["contents"] for p in read_jsonl(paths["corpus"]) if any(n in p["contents"] for n in pools["warm"])
    ]
    check["name_token_coverage"] = name_token_coverage(tokenizer, pools[split], warm_texts)
    check["name_copy_nll"] = copy = name_copy_nll(model, tokenizer, rows, retriever, budget["instruction"])
    check["value_copy_nll"] = value = value_copy_nll(model, tokenizer, rows, retriever, budget["instruction"])
    print(
        f"{split} names: {check['name_token_coverage']:.2f} of their tokens occur in the warm data; copying one "
        f"from the question costs {copy['first']:.2f} nats (first token), {copy['later']:.2f} (later); copying a "
        f"value from a passage into the memory {value['value']:.2f} per token, from its previous memory "
        f"{value['from_memory'] if value['from_memory'] is None else round(value['from_memory'], 2)}",
        flush=True,
    )
    for k in sorted(check["memory"], key=int):
        mem, full = check["memory"][k], check["full_history"][k]
        signal = check["memory_signal"]["by_type"].get(f"horizon_{k}", {})
        print(
            f"K={k}: EM memory {mem['em']:.2f} full {full['em']:.2f} | tokens {mem['tokens_per_question']:.0f} vs "
            f"{full['tokens_per_question']:.0f} | recall {mem['memory_recall']} | fact value "
            f"{signal.get('fact_value', float('nan')):.3f}",
            flush=True,
        )
    return check


def run_settings(settings: dict, arm: str, tuned: dict | None = None) -> dict:
    """What one run of ``arm`` depends on, and is keyed by: the experiment's ``settings``, what RL searches
    (`RL_CORPUS`) and the arm's settings: ``tuned`` (a `TUNE_GRID` point), then its overrides (`ARMS`)."""
    return {**settings, "rl_corpus": RL_CORPUS, "arm": {**(tuned or {}), **ARMS[arm]}}


def read_tuned(path: Path, settings: dict, required: bool = False) -> dict:
    """Each arm's `TUNE_GRID` point chosen by ``--tune`` for ``settings`` (any split; the warm start's sha256 is not
    compared: the committed warm start is the same on every machine), from ``path``. ``{}`` when there is none (no
    file, or one written for other settings): every arm then runs at `BUDGET`'s values, unless ``required`` (the
    default settings, whose choice is committed), where that raises ``ValueError`` naming what differs."""

    def unkeyed(values: dict) -> dict:
        return {k: v for k, v in values.items() if k not in ("warm_sha256", "split")}

    if not path.is_file():
        if required:
            raise ValueError(f"{path} is missing: run `python lab/long_horizon.py --tune` first")
        return {}
    record = json.loads(path.read_text())
    if unkeyed(record["settings"]) != unkeyed(settings):
        differ = sorted(
            k
            for k in {*record["settings"], *settings} - {"warm_sha256", "split"}
            if record["settings"].get(k) != settings.get(k)
        )
        if required:
            raise ValueError(f"{path} was tuned for other settings ({', '.join(differ)} differ): rerun --tune")
        print(f"{path} was tuned for other settings ({', '.join(differ)} differ): not used", flush=True)
        return {}
    if record["settings"].get("warm_sha256") != settings.get("warm_sha256"):
        print(
            f"note: {path} was tuned on warm start {record['settings'].get('warm_sha256', '?')[:12]}, these runs "
            f"train from {settings.get('warm_sha256', '?')[:12]}",
            flush=True,
        )
    return {arm: chosen["choice"] for arm, chosen in record["arms"].items()}


def tune_choice(records: list[dict], grid: tuple[dict, ...]) -> dict:
    """Per arm, the `TUNE_GRID` point whose runs (``record["tune_point"]``: its index) have the best validation EM,
    averaged over K and seeds (the first point wins a tie), with every point's score.

    Example:
        >>> runs = [{"arm": "a", "tune_point": i, "after": {"1": {"em": em}, "4": {"em": 0.0}}}
        ...         for i, em in enumerate([0.25, 0.5, 0.5])]
        >>> tune_choice(runs, ({"lr": 1}, {"lr": 2}, {"lr": 3}))
        {'a': {'choice': {'lr': 2}, 'scores': [0.125, 0.25, 0.25]}}
    """
    chosen = {}
    for arm in dict.fromkeys(r["arm"] for r in records):
        scores = [
            statistics.fmean(
                cell["em"] for r in records if r["arm"] == arm and r["tune_point"] == i for cell in r["after"].values()
            )
            for i in range(len(grid))
        ]
        chosen[arm] = {"choice": grid[scores.index(max(scores))], "scores": scores}
    return chosen


def rl_corpus(passages: list[dict], held_out_names: list[str]) -> list[dict]:
    """The passages RL episodes search: every passage that names none of ``held_out_names`` (as a whole word, in its
    title or text), so that training cannot read a fact about an entity the evaluation asks about.

    Example:
        >>> rl_corpus([{"contents": "Kisek was born in Ulm."}, {"contents": "Bor met Kisekian."}], ["Kisek"])
        [{'contents': 'Bor met Kisekian.'}]
    """
    names = sorted(held_out_names, key=len, reverse=True)
    pattern = re.compile(r"\b(?:" + "|".join(re.escape(n) for n in names) + r")\b")
    return [p for p in passages if not pattern.search(p["contents"])]


def job_pool(workers: int):
    """A spawn pool of ``workers`` processes that end with this one, however it ends (SIGKILL too): a killed
    experiment leaves no worker training on (`end_with`)."""
    return multiprocessing.get_context("spawn").Pool(workers, initializer=end_with, initargs=(os.getpid(),))


def end_with(parent: int) -> None:
    """A pool worker's initializer: receive SIGTERM (and end) when ``parent`` dies (`mempo_trl.processes`)."""
    from mempo_trl.processes import PARENT_PID_ENV, end_with_parent

    os.environ[PARENT_PID_ENV] = str(parent)
    end_with_parent()


def run_one(job: dict) -> dict:
    """Train one (arm, seed) from the warm start, evaluate per K before and after; write ``run.json``."""
    import torch

    import mempo_trl.rewards
    from mempo_trl import MemPOConfig, MemPOTrainer
    from mempo_trl.checkpoints import newest_complete_checkpoint
    from mempo_trl.data import load_qa, read_jsonl
    from mempo_trl.retrieval import BM25Retriever

    torch.set_num_threads(1)  # small tensors: one thread is fastest, and runs share the machine
    arm, seed, settings, run_dir = job["arm"], job["seed"], job["settings"], Path(job["run_dir"])
    key = job["key"]
    budget, cuda = {**settings["budget"], **key["arm"]}, job["device"] == "cuda"
    context_mode = budget.get("context_mode", "memory")
    retriever = BM25Retriever.from_corpus(job["paths"]["corpus"], cache_dir=job["bm25"])
    rows = read_jsonl(job["paths"][settings["split"]])
    model, tokenizer = load_learner(job["warm_dir"])
    if cuda:
        model.to("cuda")
    run_dir.mkdir(parents=True, exist_ok=True)
    warm_eval = run_dir.parent / f"warm_eval_{context_mode}.json"
    if warm_eval.is_file() and json.loads(warm_eval.read_text())["settings"] == settings:
        before = json.loads(warm_eval.read_text())["eval"]
    else:
        before = evaluate_horizons(model, tokenizer, rows, retriever, budget, context_mode)
        warm_eval.write_text(json.dumps({"settings": settings, "eval": before}, indent=1))
    model.train()
    config = MemPOConfig(
        output_dir=str(run_dir),
        **budget,
        seed=seed,
        use_cpu=not cuda,
        bf16=cuda,
        activation_checkpointing=False,
        report_to="none",
        save_strategy="steps",
        save_steps=CHECKPOINT_EVERY,
        save_total_limit=1,
        logging_steps=1,
        disable_tqdm=True,
    )
    reward = getattr(mempo_trl.rewards, OUTCOME_REWARDS[settings.get("outcome_reward", "each_part")])
    rl_retriever = BM25Retriever.from_corpus(job["paths"]["corpus_rl"], cache_dir=job["bm25"])
    trainer = MemPOTrainer(
        model,
        rl_retriever,
        args=config,
        reward_funcs=[reward],
        train_dataset=load_qa(job["paths"]["rl"]),
        processing_class=tokenizer,
    )
    # A stopped run resumes from its newest checkpoint, unless that was made with other settings.
    started = run_dir / "settings.json"
    if started.is_file() and json.loads(started.read_text()) != key:
        for stale in run_dir.glob("checkpoint-*"):
            shutil.rmtree(stale)
    started.write_text(json.dumps(key))
    resume = newest_complete_checkpoint(run_dir)
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    seconds = time.perf_counter() - start
    # the trained policy in both context modes: its own (``after``) and the other one
    after_by_mode = {
        mode: evaluate_horizons(trainer.model, tokenizer, rows, retriever, budget, mode) for mode in CONTEXT_MODES
    }
    after = after_by_mode[context_mode]
    log = [e for e in trainer.state.log_history if "episode/em" in e]
    record = {
        "arm": arm,
        "seed": seed,
        "tune_point": job["tune_point"],
        "settings": key,
        "warm_start": job["warm_dir"],
        "seconds": seconds,
        "resumed_from": resume and resume.name,
        "before": before,
        "after": after,
        "after_by_mode": after_by_mode,
        "train_em": [e["episode/em"] for e in log],
        "train_reward": [e.get("reward") for e in log],
        "versions": _versions(),
        "machine": _machine(),
    }
    (run_dir / "run.json").write_text(json.dumps(record, indent=1))
    if job["record_copy"]:
        Path(job["record_copy"]).parent.mkdir(parents=True, exist_ok=True)
        Path(job["record_copy"]).write_text(json.dumps(record, indent=1) + "\n")
    em = ", ".join(f"K={k} {before[k]['em']:.2f}->{after[k]['em']:.2f}" for k in after)
    print(f"{arm} seed {seed}: EM {em} ({seconds / 60:.1f} min)", flush=True)
    return record


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


PUBLISHED_SEEDS = (0, 1, 2, 3, 4)


def publishable(records: list[dict], arms: list[str], seeds: list[int]) -> bool:
    """Whether a command of the published configuration may write the published summary: it asked for every arm
    and every published seed, and each of those runs is in ``records``. Any other command (some seeds or arms, or
    one stopped before its runs were all in) leaves the published summary as its own command wrote it.

    >>> everything = [{"arm": a, "seed": s} for a in ARMS for s in PUBLISHED_SEEDS]
    >>> publishable(everything, list(ARMS), list(PUBLISHED_SEEDS))
    True
    >>> publishable(everything[1:], list(ARMS), list(PUBLISHED_SEEDS))
    False
    >>> publishable(everything, ["mempo"], list(PUBLISHED_SEEDS)), publishable(everything, list(ARMS), [3, 4])
    (False, False)
    """
    if set(arms) != set(ARMS) or set(seeds) != set(PUBLISHED_SEEDS):
        return False
    return {(a, s) for a in ARMS for s in PUBLISHED_SEEDS} <= {(r["arm"], r["seed"]) for r in records}


PER_SEED = ("em", "all_parts_em", "searches", "turns", "format_valid", "tokens_per_question")
"""The final evaluation's fields a summary lists per seed, for each context mode and for the arm's own mode."""


def summarize(records: list[dict], command: str) -> dict:
    """Per K and arm: seeds, warm and final EM/F1 (mean/std over seeds), tokens, peak context, memory recall,
    failure kinds (and, with a context budget, the share of episodes it ended), `PER_SEED` fields and each run's CPU
    per seed; ``machine`` is the summary writer's, ``run_machines`` counts the runs each CPU made; ``targets``
    checks the issue's targets at every reported K >= 4."""
    horizons: dict[str, dict] = {}
    for k in records[0]["after"] if records else []:
        horizons[k] = {}
        for arm in ARMS:
            runs = sorted((r for r in records if r["arm"] == arm), key=lambda r: r["seed"])
            if not runs:
                continue
            finals = [r["after"][k] for r in runs]
            em, em_std = _mean_std([f["em"] for f in finals])
            all_parts, all_parts_std = _mean_std([f.get("all_parts_em") for f in finals])
            f1, f1_std = _mean_std([f["f1"] for f in finals])
            kinds = finals[0]["failures"]
            horizons[k][arm] = {
                "seeds": [r["seed"] for r in runs],
                "warm_em": runs[0]["before"][k]["em"],
                "warm_f1": runs[0]["before"][k]["f1"],
                "warm_tokens_per_question": runs[0]["before"][k]["tokens_per_question"],
                "final_em_mean": em,
                "final_em_std": em_std,
                "final_f1_mean": f1,
                "final_f1_std": f1_std,
                "final_em_per_seed": [f["em"] for f in finals],
                "final_all_parts_em_mean": all_parts,
                "final_all_parts_em_std": all_parts_std,
                "final_all_parts_em_per_seed": [f.get("all_parts_em") for f in finals],
                "by_context_mode": {
                    mode: {
                        field + "_per_seed": [r["after_by_mode"][mode][k].get(field) for r in runs]
                        for field in PER_SEED
                    }
                    for mode in CONTEXT_MODES
                    if all("after_by_mode" in r for r in runs)
                },
                **{field + "_per_seed": [f.get(field) for f in finals] for field in PER_SEED[2:]},
                "machine_per_seed": [r.get("machine", {}).get("cpu") for r in runs],
                "searches": _mean_std([f.get("searches") for f in finals])[0],
                "format_valid": _mean_std([f.get("format_valid") for f in finals])[0],
                "tokens_per_question": _mean_std([f["tokens_per_question"] for f in finals])[0],
                "peak_context_tokens": _mean_std([f["peak_context_tokens"] for f in finals])[0],
                "turns": _mean_std([f["turns"] for f in finals])[0],
                "memory_recall": _mean_std([f["memory_recall"] for f in finals])[0],
                "warm_memory_recall": runs[0]["before"][k]["memory_recall"],
                "failures": {kind: statistics.fmean(f["failures"][kind] for f in finals) for kind in kinds},
                "train_minutes_per_run": statistics.fmean(r["seconds"] for r in runs) / 60,
            }
            if "context_overflow" in finals[0]:  # runs with a context budget (`evaluate_horizons`)
                horizons[k][arm]["context_overflow"] = _mean_std([f["context_overflow"] for f in finals])[0]
    return {
        "horizons": horizons,
        "targets": targets(horizons),
        "settings": {k: v for k, v in records[0]["settings"].items() if k != "arm"} if records else {},
        "arms": {
            arm: next(r["settings"]["arm"] for r in records if r["arm"] == arm)
            for arm in ARMS
            if any(r["arm"] == arm for r in records)
        },
        "command": command,
        "versions": _versions(),
        "machine": _machine(),
        "run_machines": dict(collections.Counter(r.get("machine", {}).get("cpu") for r in records)),
    }


def print_oracle_tokens(out: Path, paths: dict, tokenizer_dir: Path, budget: dict, split: str) -> dict:
    """`oracle_context_tokens` of ``split``'s rows (the whole corpus, the learner's tokenizer), printed per K."""
    from mempo_trl.data import read_jsonl
    from mempo_trl.loading import load_tokenizer
    from mempo_trl.retrieval import BM25Retriever

    retriever = BM25Retriever.from_corpus(str(paths["corpus"]), cache_dir=str(out / "bm25"))
    cells = oracle_context_tokens(read_jsonl(paths[split]), retriever, load_tokenizer(tokenizer_dir), budget)
    for k, cell in cells.items():
        print(
            f"scripted oracle, K={k}: tokens per question memory {cell['tokens_memory']:.0f} / full history "
            f"{cell['tokens_full_history']:.0f} = {cell['ratio']:.3f} (peak context {cell['peak_memory']} / "
            f"{cell['peak_full_history']})",
            flush=True,
        )
    return cells


def targets(horizons: dict) -> dict:
    """At every reported K >= 4 with the three `COMPARED_ARMS`: MemPO's tokens per question over full history's (target <= 0.5
    at equal or better EM), MemPO - full-history EM, and MemPO - outcome-only EM against the larger seed std (target:
    above it); ``gap_grows_with_k``: the MemPO - full-history EM gap is larger at each larger reported K."""
    checked, gaps = {}, []
    for k in (str(k) for k in REPORTED_HORIZONS):
        arms = horizons.get(k, {})
        if int(k) < 4 or not all(a in arms for a in COMPARED_ARMS):
            continue
        mem, out, full = arms["mempo"], arms["outcome_only"], arms["full_history"]
        ratio = mem["tokens_per_question"] / full["tokens_per_question"]
        gap_full = mem["final_em_mean"] - full["final_em_mean"]
        gap_outcome = mem["final_em_mean"] - out["final_em_mean"]
        noise = max(mem["final_em_std"], out["final_em_std"])
        gaps.append(gap_full)
        checked[k] = {
            "token_ratio_vs_full_history": ratio,
            "em_minus_full_history": gap_full,
            "em_minus_outcome_only": gap_outcome,
            "larger_seed_std": noise,
            "tokens_met": ratio <= 0.5 and gap_full >= 0.0,
            "beats_outcome_only": gap_outcome > noise,
        }
    grows = all(b > a for a, b in zip(gaps, gaps[1:])) if len(gaps) > 1 else None
    return {"by_horizon": checked, "gap_grows_with_k": grows}


def plot(summary: dict, path: Path) -> None:
    """EM vs K per arm (mean, min-max band over seeds) and tokens per question vs K per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_em, ax_tok) = plt.subplots(1, 2, figsize=(11, 4))
    ks = sorted(summary["horizons"], key=int)
    for arm in ARMS:
        cells = [summary["horizons"][k].get(arm) for k in ks]
        if not all(cells):
            continue
        x = [int(k) for k in ks]
        em = [c["final_em_mean"] for c in cells]
        std = [c["final_em_std"] for c in cells]
        line = ax_em.plot(x, em, marker="o", label=f"{arm} ({len(cells[0]['seeds'])} seed(s))")[0]
        ax_em.fill_between(
            x, [m - s for m, s in zip(em, std)], [m + s for m, s in zip(em, std)], color=line.get_color(), alpha=0.2
        )
        ax_tok.plot(x, [c["tokens_per_question"] for c in cells], marker="o", label=arm, color=line.get_color())
    ax_em.set_xlabel("objectives per question (K)")
    ax_em.set_ylabel("test EM after RL (greedy; band: +/- 1 std over seeds)")
    ax_tok.set_xlabel("objectives per question (K)")
    ax_tok.set_ylabel("tokens per question (all rounds' prompts + completions)")
    for ax in (ax_em, ax_tok):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def experiment_settings(
    quick: bool,
    split: str,
    overrides: dict,
    passage_words: int | None = None,
    outcome_reward: str = "each_part",
    learner: str = "kit",
) -> dict:
    """What keys the world, the warm start and every run: `WORLD`, `WARM` (`SMOLLM2_WARM` for ``learner``
    ``"smollm2"``) and `BUDGET` with ``overrides`` (`QUICK`'s, or `QUICK_SMOLLM2`'s, with ``quick``), and the split.
    ``passage_words``, ``outcome_reward`` and ``learner`` enter only when not the default, so that the default
    settings (and the cached warm start and runs they key) stay as they are."""
    smollm2 = learner == "smollm2"
    world, warm, budget = dict(WORLD), dict(SMOLLM2_WARM if smollm2 else WARM), {**BUDGET, **overrides}
    if quick:
        quick_settings = QUICK_SMOLLM2 if smollm2 else QUICK
        world = quick_settings["world"]
        warm.update(quick_settings["warm"])
        budget.update(quick_settings["budget"])
        budget["max_turns"] = max(world["horizons"]) + 2
    if passage_words is not None:
        world = {**world, "passage_words": passage_words}
    settings = {"world": world, "warm": warm, "budget": budget, "split": split}
    if outcome_reward != "each_part":
        settings["outcome_reward"] = outcome_reward
    return {**settings, "learner": learner} if smollm2 else settings


def _ran(record: Path, key: dict) -> bool:
    """Whether ``record`` is a finished run's ``run.json`` (or its kept copy) with the settings ``key``."""
    return record.is_file() and json.loads(record.read_text())["settings"] == key


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/long_horizon", help="world, warm model and runs (resumable)")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(PUBLISHED_SEEDS))
    parser.add_argument("--split", default="test", choices=["test", "validation"])
    parser.add_argument("--jobs", type=int, default=1, help="runs trained side by side (processes)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="tiny world, 1 step, 1 seed: a smoke run")
    parser.add_argument("--warm_only", action="store_true", help="build and check the warm start, no RL")
    parser.add_argument(
        "--tune",
        action="store_true",
        help="on the validation split, train every arm at each TUNE_GRID point and write each arm's "
        "best point, which later runs of these settings use",
    )
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        dest="overrides",
        help="override BUDGET entries (MemPOConfig fields, JSON values); an arm's own settings (ARMS) win",
    )
    parser.add_argument(
        "--outcome_reward",
        default="each_part",
        choices=list(OUTCOME_REWARDS),
        help="what an answer earns in training: each right part its share (default) or 1 only when "
        "all parts are right; runs and summary get the suffix _all_parts",
    )
    parser.add_argument(
        "--learner",
        default="kit",
        choices=LEARNERS,
        help="kit: the learner built from scratch (default); smollm2: SmolLM2-135M-Instruct, fully "
        "fine-tuned; its world, warm starts and runs go to <out>/smollm2, its summary is "
        "long_horizon_smollm2.json",
    )
    parser.add_argument(
        "--records",
        default=None,
        metavar="DIR",
        help="keep a copy of each finished run's run.json in DIR/<warm start sha256[:12]>/<split>/, "
        "and take a run from there instead of training it when its settings match (default: "
        "lab/results/long_horizon_runs for the default settings, none otherwise)",
    )
    parser.add_argument(
        "--passage_words",
        type=int,
        default=None,
        metavar="N",
        help="pad every passage to ~N words (wiki-length); world, warm start and runs go to <out>/passage_words_N",
    )
    args = parser.parse_args(argv)
    if args.tune:
        args.split = "validation"
    default_words = SMOLLM2_PASSAGE_WORDS if args.learner == "smollm2" else None
    if args.passage_words is None:
        args.passage_words = default_words
    try:
        overrides = parse_overrides(args.overrides)
        if args.jobs < 1:
            raise ValueError(f"--jobs {args.jobs}: expected >= 1")
        if args.passage_words is not None and args.passage_words < 1:
            raise ValueError(f"--passage_words {args.passage_words}: expected >= 1 (words per passage)")
        settings = experiment_settings(
            args.quick, args.split, overrides, args.passage_words, args.outcome_reward, args.learner
        )
        turn_protocol(settings["budget"], "memory")  # a bad max_context_tokens fails here, before the warm start
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from mempo_trl.outputs import OutputError, check_writable

    world, warm, budget = settings["world"], settings["warm"], settings["budget"]
    if args.quick:
        args.seeds = args.seeds[:1]
    defaults = not (
        args.quick or overrides or args.passage_words != default_words or args.outcome_reward != "each_part"
    )
    published = defaults and args.split == "test"
    out = Path(args.out) if args.passage_words is None else Path(args.out) / f"passage_words_{args.passage_words}"
    summary_name = "long_horizon" if args.learner == "kit" else f"long_horizon_{args.learner}"
    out = out if args.learner == "kit" else out / args.learner
    variant = budget_suffix(budget) + ("" if args.outcome_reward == "each_part" else f"_{args.outcome_reward}")
    results = Path(f"lab/results/{summary_name}.json") if published else out / f"{summary_name}{variant}.json"
    runs = out / "runs" / f"{args.split}{variant}"
    # The choice of the default settings' --tune is committed: the published runs use it.
    tuned_path = (
        Path(f"lab/results/{summary_name}_tuned.json") if defaults else out / f"{summary_name}_tuned{variant}.json"
    )
    # Each finished run of the default settings is kept in git, so that a later session (a fresh machine, no runs/)
    # rebuilds the warm start and goes on from where the last one stopped.
    records_root = (
        Path(args.records) if args.records else Path(f"lab/results/{summary_name}_runs") if defaults else None
    )
    # The warm check of the default settings is the one the README cites: it is also written to bench/results.
    cited = defaults and args.warm_only and args.out == parser.get_default("out")
    committed = Path(f"lab/results/{summary_name}_warm_check_{args.split}.json")
    try:  # every output is checked before the (long) warm start and runs
        kept = [records_root] if records_root else []
        for directory in {out, results.parent, tuned_path.parent, *([committed.parent] if cited else []), *kept}:
            check_writable(directory)
    except OutputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)  # small tensors: one thread is fastest, and the machine is shared
    start = time.perf_counter()
    try:
        paths, warm_dirs = prepare(out, world, warm, args.device, args.learner)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if defaults and args.learner == "kit" and not (COMMITTED_WARM / WARM_MANIFEST).is_file():
        commit_warm(
            warm_dirs["memory"], "python lab/long_horizon.py " + " ".join(sys.argv[1:] if argv is None else argv)
        )
    settings = {**settings, "warm_sha256": warm_fingerprint(warm_dirs)}
    print(
        f"world and warm start ready in {out} ({time.perf_counter() - start:.0f} s; warm start sha256 "
        f"{settings['warm_sha256'][:12]})",
        flush=True,
    )
    oracle = print_oracle_tokens(out, paths, warm_dirs["memory"], budget, args.split)
    if args.warm_only:
        if args.learner == "kit":
            check = warm_check(out, paths, warm_dirs["memory"], budget, args.split)
        else:
            check = smollm2_warm_check(out, paths, warm_dirs, budget, args.split)
        check["scripted_oracle_tokens"] = oracle
        (out / f"warm_check_{args.split}{budget_suffix(budget)}.json").write_text(json.dumps(check, indent=1))
        if cited:
            command = "python lab/long_horizon.py " + " ".join(sys.argv[1:] if argv is None else argv)
            record = {
                **check,
                "settings": settings,
                "command": command,
                "versions": _versions(),
                "machine": _machine(),
            }
            committed.write_text(json.dumps(record, indent=1) + "\n")
            print(f"wrote {committed}", flush=True)
        return 0
    try:
        tuned = {} if args.tune else read_tuned(tuned_path, settings, required=defaults and args.learner == "kit")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.tune:
        runs = runs.with_name(runs.name + "_tune")
    points = list(enumerate(TUNE_GRID)) if args.tune else [(None, None)]
    jobs = []
    for seed in args.seeds:
        for arm in args.arms:
            for point, tune_settings in points:
                name = f"{arm}_s{seed}" if point is None else f"{arm}_g{point}_s{seed}"
                run_dir, key = runs / name, run_settings(settings, arm, tune_settings or tuned.get(arm))
                warm_dir = warm_dirs[{**settings["budget"], **key["arm"]}.get("context_mode", "memory")]
                done = run_dir / "run.json"
                kept_dir = records_root / settings["warm_sha256"][:12] / runs.name if records_root else None
                record_copy = kept_dir / f"{name}.json" if kept_dir else None
                if not _ran(done, key) and record_copy and _ran(record_copy, key):
                    run_dir.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(record_copy, done)  # a kept run of this warm start and settings
                if _ran(done, key):
                    print(f"{name}: done already ({done})", flush=True)
                    continue
                jobs.append(
                    {
                        "arm": arm,
                        "seed": seed,
                        "tune_point": point,
                        "key": key,
                        "settings": settings,
                        "run_dir": str(run_dir),
                        "warm_dir": str(warm_dir),
                        "paths": {k: str(v) for k, v in paths.items()},
                        "bm25": str(out / "bm25"),
                        "device": args.device,
                        "record_copy": record_copy and str(record_copy),
                    }
                )
    if args.jobs > 1 and len(jobs) > 1:
        with job_pool(min(args.jobs, len(jobs))) as pool:
            for _ in pool.imap_unordered(run_one, jobs):
                pass
    else:
        for job in jobs:
            run_one(job)
    records = [json.loads(p.read_text()) for p in sorted(runs.glob("*/run.json"))]
    command = "python lab/long_horizon.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.tune:
        records = [
            r
            for r in records
            if r["arm"] in args.arms
            and r["seed"] in args.seeds
            and r["settings"] == run_settings(settings, r["arm"], TUNE_GRID[r["tune_point"]])
        ]
        choice = {
            "arms": tune_choice(records, TUNE_GRID),
            "grid": TUNE_GRID,
            "seeds": args.seeds,
            "settings": settings,
            "command": command,
            "versions": _versions(),
            "machine": _machine(),
        }
        tuned_path.write_text(json.dumps(choice, indent=1) + "\n")
        for arm, chosen in choice["arms"].items():
            print(f"{arm}: {chosen['choice']} (validation EM per point {chosen['scores']})", flush=True)
        print(f"wrote {tuned_path}", flush=True)
        return 0
    records = [r for r in records if r["settings"] == run_settings(settings, r["arm"], tuned.get(r["arm"]))]
    if published and not publishable(records, args.arms, args.seeds):
        print(
            f"{len(records)} of {len(ARMS) * len(PUBLISHED_SEEDS)} runs kept; {results} is written by "
            "`python lab/long_horizon.py` (every arm and seed), once all its runs are in",
            flush=True,
        )
    elif records:
        summary = {**summarize(records, command), "scripted_oracle_tokens": oracle}
        results.write_text(json.dumps(summary, indent=2))
        plot(summary, results.with_suffix(".png"))
        print(f"wrote {results}, {results.with_suffix('.png')}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))  # --passage_words: bench_context_tokens
    sys.exit(main())
