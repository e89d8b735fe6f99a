"""SFT warm start on the MemPO turn format, for the tiny offline model (the paper SFT-warms before MemPO).

A randomly initialised model never writes a valid turn, so every episode scores 0 and GRPO has no signal. This
module teaches the format first:

- `oracle_episode_turns` plays a demo-world row as a scripted agent: one ``<search>`` per hop query (the
  information after it is the real retriever result), then the ``<answer>``; its ``<mem>`` carries the facts
  found so far;
- `sft_examples` turns the oracle episodes into one ``(prompt, completion)`` pair per round, the prompt rebuilt
  with `mempo_trl.context` exactly as training and evaluation rebuild it;
- `sft_warm_start` fine-tunes a saved model on them with TRL's `SFTTrainer` (`WarmSettings`) and saves it back,
  through `mempo_trl.kit.sft.CompletionSFTTrainer`, whose loss projects only the completion positions through the
  LM head (TRL's fused LM-head loss scores every position on a CPU, prompts included, which made the tiny model's
  warm start several times slower: ``bench/README.md``): the learner's warm start (`mempo_trl.kit.learner`) and
  the tiny model's;
- `build_warm_tiny_model` builds the tiny model and warm-starts it, reusing a previous result with the same
  settings (what `mempo-trl kit tiny` and the tests' warm model use).

The ``<mem>`` holds only the facts (``Subject: value.``), not the question again: the question stays in every
context (and in the memory reward's ``mem_traj``), and a 48-token turn has no room for it.
"""

import hashlib
import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mempo_trl.context import (
    DEFAULT_INSTRUCTION,
    ContextMode,
    initial_messages,
    render_gold_answer,
    render_information,
    render_prompt,
    round_messages,
)
from mempo_trl.oracle import ANSWER_THOUGHT, SEARCH_THOUGHT, hop_facts, turn_text


WARM_START_FILE = "warm_start.json"
"""Written next to the weights by `sft_warm_start`: the settings and the stats of the run."""

WARM_STEPS = 600
WARM_LR = 5e-3
WARM_BATCH_SIZE = 16
"""The tiny model's warm start (`tiny_warm_settings`, `build_warm_tiny_model`): enough steps for its loss to pass
the drop where it starts copying names from its context."""


def oracle_episode_turns(
    row: dict,
    retriever,
    topk: int = 3,
    max_turns: int = 8,
    mem_drop: float = 0.0,
    rng: random.Random | None = None,
    repair: bool = False,
    counted: bool = False,
) -> list[tuple[str, str | None]]:
    """The turns of a scripted agent that solves a demo-world row: ``(turn text, information or None)``.

    One search turn per hop query, each followed by the real result of ``retriever`` rendered with
    `render_information`, then the answer turn (``None`` information) with the gold rendered as the memory
    reward scores it (`render_gold_answer`). The ``<mem>`` of each turn lists the facts found so far. Raises
    ``ValueError`` when the row needs more than ``max_turns`` turns.

    ``mem_drop`` makes the memory imperfect on purpose: each fact of the episode is left out of every ``<mem>``
    with probability ``mem_drop`` (drawn from ``rng``), while the searches and the answer stay right, so a model
    warm-started on these turns forgets facts that a comparison or multi-objective answer needs: something for
    the memory advantage to repair. Its answer then names values that neither the memory nor the last result shows.
    With ``repair``, the scripted agent searches each dropped fact again after the hops (as many as ``max_turns``
    leaves room for; a drop beyond that is not made) and answers with every fact in memory: a model warm-started on
    these turns sees a forgotten fact cost a search instead of learning to answer what it cannot see.

    With ``counted``, each thought starts with how many of the row's hops are searched so far (`counted_thought`:
    ``Searched 1 of 2. I must search.``, ..., ``Searched 2 of 2. I know the answer.``): the count of the turn before
    is in view in the next context, so a model warm-started on these turns reads when to answer off a number it
    copies and raises by one, not off the facts its memory may have dropped. Not combined with ``repair``, whose
    extra searches repeat hops (``ValueError``).

    Example:
        >>> turns = oracle_episode_turns(row, retriever)  # doctest: +SKIP
        >>> turns[0][0]  # doctest: +SKIP
        '<mem> Nothing yet. </mem>\\n<think> I must search. </think>\\n<search> Who founded Orbix? </search>'
    """
    queries = list(row["hop_queries"])
    if len(queries) + 1 > max_turns:
        raise ValueError(f"row {row.get('id')!r} needs {len(queries) + 1} turns, more than max_turns={max_turns}")
    if not 0.0 <= mem_drop <= 1.0:
        raise ValueError(f"mem_drop must be in [0, 1], got {mem_drop}")
    results = retriever.search(queries, topk)
    facts = hop_facts(row, results)
    if counted and repair:
        raise ValueError("counted thoughts count the hops, and repair searches hops again: pick one")
    rng = rng or random.Random(0)
    kept = [fact if mem_drop == 0.0 or rng.random() >= mem_drop else "" for fact in facts]
    if repair:  # at most as many drops as there are turns left for their searches
        room = max_turns - len(queries) - 1
        dropped = [i for i, fact in enumerate(kept) if not fact]
        for i in dropped[room:]:
            kept[i] = facts[i]
    turns: list[tuple[str, str | None]] = []
    for i, (query, passages) in enumerate(zip(queries, results)):
        thought = counted_thought(i, len(queries), SEARCH_THOUGHT) if counted else SEARCH_THOUGHT
        turns.append((turn_text(kept[:i], thought, f"<search> {query} </search>"), render_information(passages)))
    for i in [i for i, fact in enumerate(kept) if not fact] if repair else []:
        text = turn_text(kept, SEARCH_THOUGHT, f"<search> {queries[i]} </search>")
        turns.append((text, render_information(results[i])))
        kept[i] = facts[i]
    answer, _ = render_gold_answer(row["golden_answers"], row.get("sub_answers"))
    thought = counted_thought(len(queries), len(queries), ANSWER_THOUGHT) if counted else ANSWER_THOUGHT
    turns.append((turn_text(kept, thought, answer), None))
    return turns


def counted_thought(searched: int, hops: int, thought: str) -> str:
    """The thought of a counted oracle turn (`oracle_episode_turns`): the hops searched so far, then ``thought``.

    >>> counted_thought(1, 2, SEARCH_THOUGHT), counted_thought(2, 2, ANSWER_THOUGHT)
    ('Searched 1 of 2. I must search.', 'Searched 2 of 2. I know the answer.')
    """
    return f"Searched {searched} of {hops}. {thought}"


def sft_examples(
    rows: Sequence[dict],
    retriever,
    tokenizer,
    context_mode: ContextMode = "memory",
    topk: int = 3,
    mem_drop: float = 0.0,
    seed: int = 0,
    instruction: str = DEFAULT_INSTRUCTION,
    max_turns: int = 8,
) -> list[tuple[list[int], list[int]]]:
    """One ``(prompt_ids, completion_ids)`` pair per round of every row's oracle episode.

    ``mem_drop`` (see `oracle_episode_turns`) draws its drops from ``random.Random(seed)``, so the same seed
    gives the same examples. ``instruction`` is the user message around the question (train and evaluate with the
    same one). A row that needs more than ``max_turns`` turns raises ``ValueError`` (`oracle_episode_turns`).

    The prompt is the round's context rebuilt with `initial_messages` + `round_messages` + `render_prompt`, as
    `mempo_trl.rollout.RolloutEngine` rebuilds it in training and evaluation. The completion is the turn's tokens
    and the eos (``<|im_end|>``): generation stops on the closing action tag (an eos id when it is one token, a
    vLLM stop string otherwise) and `cut_after_action` drops whatever follows it, so the eos is never part of an
    RL row; learning it right after the tag, as the chat template closes every assistant message, makes a model
    whose tags span several tokens stop there instead of running on to ``max_new_tokens`` under HF generation.

    Example:
        >>> prompt, completion = sft_examples([row], retriever, tokenizer)[0]  # doctest: +SKIP
        >>> tokenizer.decode(completion[-1:])  # doctest: +SKIP
        '<|im_end|>'
    """
    examples = []
    rng = random.Random(seed)
    for row in rows:
        base = initial_messages(row["question"], instruction=instruction)
        history: list[tuple[str, str]] = []
        for text, information in oracle_episode_turns(row, retriever, topk, max_turns, mem_drop, rng):
            prompt = render_prompt(tokenizer, round_messages(base, history, context_mode))
            completion = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            examples.append((prompt, completion))
            if information is not None:
                history.append((text, information))
    return examples


def sft_dataset(examples: Sequence[tuple[list[int], list[int]]], prompt_loss: bool = False) -> dict:
    """``input_ids`` (prompt + completion) and ``labels`` of `sft_examples`' pairs: the completion's tokens, the
    prompt's masked with -100, or with ``prompt_loss`` every token (language-model loss on the whole context, whose
    passages repeat the names the completion copies).

    Example:
        >>> sft_dataset([([1, 2], [3])])
        {'input_ids': [[1, 2, 3]], 'labels': [[-100, -100, 3]]}
        >>> sft_dataset([([1, 2], [3])], prompt_loss=True)["labels"]
        [[1, 2, 3]]
    """
    input_ids = [list(p) + list(c) for p, c in examples]
    labels = input_ids if prompt_loss else [[-100] * len(p) + list(c) for p, c in examples]
    return {"input_ids": input_ids, "labels": [list(x) for x in labels]}


@dataclass
class WarmSettings:
    """An SFT warm start (`sft_warm_start`): `SFTTrainer` steps, batch size, learning rate, seed, ``mem_drop`` (see
    `oracle_episode_turns`), the number of rows used (all by default) and the instruction (RL and evaluation must
    use the same)."""

    steps: int
    batch_size: int
    lr: float
    seed: int = 0
    mem_drop: float = 0.0
    max_warm_rows: int | None = None
    instruction: str = DEFAULT_INSTRUCTION


def sft_warm_start(
    model_dir: str | Path,
    rows: Sequence[dict],
    retriever,
    settings: WarmSettings,
    max_turns: int = 8,
    use_cpu: bool = True,
    checkpoint_every: int = 0,
    prompt_loss: bool = False,
    context_mode: ContextMode = "memory",
) -> dict:
    """Warm-start the model in ``model_dir`` on the oracle turns of ``rows`` with TRL's `SFTTrainer`; save it back.

    One prompt/completion example per round (`sft_examples`: the context rebuilt exactly as training rebuilds it,
    the loss on the completion only, `CompletionSFTTrainer`; with ``prompt_loss`` on every token: `sft_dataset`), no
    activation checkpointing, a cosine schedule after a warm-up of 1/30 of the steps. Rows the oracle cannot play (a
    comparison whose passage the retriever misses, or a row needing more than ``max_turns`` turns) are skipped.
    Returns the stats (``steps``, ``rows``, ``skipped_rows``, ``examples``, ``initial_loss`` and ``final_loss``: the
    first and last logged loss, ``seconds``), also written to ``WARM_START_FILE`` with the settings.
    ``use_cpu=False`` trains on the accelerator when there is one. ``checkpoint_every`` N > 0 saves a checkpoint
    every N steps under ``model_dir/sft`` (the newest one kept) and resumes from the newest complete one there, so a
    long warm start that is stopped continues where it was (`mempo_trl.checkpoints`). ``context_mode``: the contexts
    the examples are rebuilt in (``"full_history"`` for a full-history policy's start).
    """
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig

    from mempo_trl.checkpoints import newest_complete_checkpoint
    from mempo_trl.kit.sft import CompletionSFTTrainer
    from mempo_trl.loading import load_tokenizer

    start = time.perf_counter()
    model_dir = Path(model_dir)
    tokenizer = load_tokenizer(model_dir)
    rows = list(rows)[: settings.max_warm_rows]
    examples, skipped = [], 0
    for n, row in enumerate(rows):
        try:
            examples += sft_examples(
                [row],
                retriever,
                tokenizer,
                context_mode,
                mem_drop=settings.mem_drop,
                seed=settings.seed + n,
                instruction=settings.instruction,
                max_turns=max_turns,
            )
        except ValueError:
            skipped += 1
    dataset = Dataset.from_dict(sft_dataset(examples, prompt_loss))
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
        activation_checkpointing=False,  # TRL turns it on: recomputing the forward made the tiny model 1.25x slower
        seed=settings.seed,
        use_cpu=use_cpu,
        bf16=False,
        logging_steps=max(1, settings.steps // 60),
        save_strategy="steps" if checkpoint_every else "no",
        save_steps=checkpoint_every or 500,
        save_total_limit=1,
        report_to="none",
        max_length=None,
        dataset_num_proc=None,
        disable_tqdm=True,  # random batches: length-grouped ones learned to copy from the context more slowly
    )
    trainer = CompletionSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    resume = newest_complete_checkpoint(model_dir / "sft") if checkpoint_every else None
    result = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
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


def demo_data(rows: Sequence[dict] | None = None, retriever=None) -> tuple[list[dict], Any]:
    """``rows`` and ``retriever``, by default the demo train rows and BM25 over the demo corpus."""
    from mempo_trl.data import read_jsonl
    from mempo_trl.kit.demo_world import demo_paths
    from mempo_trl.retrieval import BM25Retriever

    paths = demo_paths()
    rows = read_jsonl(paths.train) if rows is None else list(rows)
    retriever = BM25Retriever.from_corpus(str(paths.corpus)) if retriever is None else retriever
    return rows, retriever


def tiny_warm_settings(
    steps: int = WARM_STEPS, lr: float = WARM_LR, batch_size: int = WARM_BATCH_SIZE, seed: int = 0
) -> WarmSettings:
    """The tiny model's warm start settings (`WARM_STEPS`, `WARM_LR`, `WARM_BATCH_SIZE` by default)."""
    return WarmSettings(steps=steps, batch_size=batch_size, lr=lr, seed=seed)


def _tiny_key(seed: int) -> dict:
    """What a warm tiny model depends on: the seed, the SFT settings and the demo data (tokenizer and examples)."""
    from mempo_trl.kit.demo_world import demo_paths

    digest = hashlib.sha256(b"".join(path.read_bytes() for path in demo_paths())).hexdigest()
    return {**asdict(tiny_warm_settings(seed=seed)), "trainer": "CompletionSFTTrainer", "data_sha256": digest}


def build_warm_tiny_model(output_dir: str | Path, seed: int = 0) -> Path:
    """Build the tiny model into ``output_dir`` and warm-start it (`sft_warm_start` with `tiny_warm_settings` on
    the demo train rows and BM25 over the demo corpus, on the CPU); reuse a previous result.

    A directory whose ``WARM_START_FILE`` records the same settings (seed, SFT settings, demo data) is returned
    as it is; anything else is rebuilt.

    Example:
        >>> path = build_warm_tiny_model("outputs/tiny/base_model", seed=0)  # doctest: +SKIP
        >>> json.loads((path / WARM_START_FILE).read_text())["tiny"]["seed"]  # doctest: +SKIP
        0
    """
    from mempo_trl.kit.tiny import build_tiny_model

    out = Path(output_dir)
    key = _tiny_key(seed)
    marker = out / WARM_START_FILE
    if marker.is_file() and json.loads(marker.read_text()).get("tiny") == key:
        return out
    build_tiny_model(out, seed=seed)
    sft_warm_start(out, *demo_data(), tiny_warm_settings(seed=seed))
    record = json.loads(marker.read_text())
    marker.write_text(json.dumps({**record, "tiny": key}, indent=2))
    return out
