"""Evaluation harness: play a model as a MemPO agent over QA rows and report answers, format and token cost.

`evaluate` runs one context mode through `mempo_trl.rollout.RolloutEngine` (the context builder of training) and
returns an `EvalResult`: one record per question (the trajectory, its scores and its token counts) and the
metrics, overall and per ``data_source``. ``context_mode="full_history"`` is the Search-R1 style baseline whose
context grows every round; `compare_modes` sets the two side by side on the same questions.

Token accounting is exact: a round's prompt tokens are the ids the model was given, its completion tokens the ids
it produced (cut after the action); per question, the peak context is the largest prompt + completion of any round
and the total is the sum of prompt + completion over the rounds.

`mempo-trl eval` loads a model, QA files and a retriever and writes ``results.json`` (metrics, settings, versions),
``trajectories.jsonl`` (one line per question and mode) and ``context_tokens.png`` (mean prompt tokens per round).
"""

import argparse
import json
import logging
import math
import platform
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mempo_trl.context import CONTEXT_MODES, DEFAULT_INSTRUCTION, DEFAULT_SYSTEM_PROMPT, ContextMode
from mempo_trl.rewards import outcome_score
from mempo_trl.rollout import Episode, GenerateFn, RolloutEngine


RESULTS_FILE = "results.json"
TRAJECTORIES_FILE = "trajectories.jsonl"
PLOT_FILE = "context_tokens.png"


class EvalError(RuntimeError):
    """An evaluation that cannot start (missing model, missing backend); the message says how to fix it."""


@dataclass
class EvalResult:
    """The outcome of `evaluate` for one context mode.

    ``records`` holds one JSON-ready dict per question (see `episode_record`); ``metrics`` has ``"overall"`` and
    ``"by_data_source"`` (see `summarize`); ``episodes`` are the rollout's own objects.
    """

    context_mode: str
    records: list[dict]
    metrics: dict[str, Any]
    episodes: list[Episode] = field(repr=False)
    generation_s: float = 0.0
    retrieval_s: float = 0.0


def episode_record(episode: Episode) -> dict:
    """Scores, token counts and rounds of one finished episode, as a JSON-ready dict.

    Example:
        >>> record = episode_record(episodes[0])  # doctest: +SKIP
        >>> record["total_tokens"] == sum(r["prompt_tokens"] + r["completion_tokens"] for r in record["rounds"])  # doctest: +SKIP
        True
    """
    row = episode.row
    score = outcome_score(
        episode.answer, row["golden_answers"], row.get("sub_answers") or None, format_valid=episode.format_valid
    )
    rounds = [
        {
            "prompt_tokens": len(r.prompt_ids),
            "completion_tokens": len(r.completion_ids),
            "completion": r.text,
            "valid": r.turn.valid,
            "reason": r.turn.reason,
            "mem": r.turn.mem,
            "action": r.turn.action,
            "content": r.turn.content,
            "information": r.information,
            "truncated": r.truncated,
        }
        for r in episode.rounds
    ]
    processed = [r["prompt_tokens"] + r["completion_tokens"] for r in rounds]
    return {
        "id": row.get("id"),
        "data_source": row.get("data_source", "unknown"),
        "question": row["question"],
        "golden_answers": list(row["golden_answers"]),
        "sub_answers": list(row.get("sub_answers") or []),
        "answer": episode.answer,
        "em": score.em,
        "f1": score.f1,
        "sub_em": score.sub_em,
        "format_valid": episode.format_valid,
        "turns_valid": all(r.turn.valid for r in episode.rounds),
        "num_turns": len(rounds),
        "num_searches": sum(1 for r in episode.rounds if r.information is not None),
        "peak_context_tokens": max(processed, default=0),
        "total_tokens": sum(processed),
        "rounds": rounds,
    }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _summary(records: Sequence[dict]) -> dict[str, Any]:
    max_rounds = max((r["num_turns"] for r in records), default=0)
    per_round = [[r["rounds"][k]["prompt_tokens"] for r in records if r["num_turns"] > k] for k in range(max_rounds)]
    return {
        "num_questions": len(records),
        "em": _mean([r["em"] for r in records]),
        "f1": _mean([r["f1"] for r in records]),
        "sub_em": _mean([r["sub_em"] for r in records]),
        "format_valid": _mean([float(r["format_valid"]) for r in records]),
        "turns_valid": _mean([float(r["turns_valid"]) for r in records]),
        "turns_per_question": _mean([r["num_turns"] for r in records]),
        "searches_per_question": _mean([r["num_searches"] for r in records]),
        "prompt_tokens_per_round": [_mean(tokens) for tokens in per_round],
        "questions_per_round": [len(tokens) for tokens in per_round],
        "mean_prompt_tokens": _mean([t for tokens in per_round for t in tokens]),
        "completion_tokens_per_question": _mean([sum(x["completion_tokens"] for x in r["rounds"]) for r in records]),
        "peak_context_tokens": _mean([r["peak_context_tokens"] for r in records]),
        "max_peak_context_tokens": max((r["peak_context_tokens"] for r in records), default=0),
        "total_tokens_per_question": _mean([r["total_tokens"] for r in records]),
        "total_tokens": sum(r["total_tokens"] for r in records),
    }


def summarize(records: Sequence[dict]) -> dict[str, Any]:
    """Metrics of `episode_record` dicts, overall and per ``data_source``.

    Scores, rates and per-question counts are means over questions; ``prompt_tokens_per_round[k]`` is the mean
    prompt length of round k+1 over the questions that reached it (``questions_per_round[k]`` of them).
    ``format_valid`` counts episodes whose every round is a valid turn and that end on an answer;
    ``turns_valid`` only asks the former (an episode cut by ``max_turns`` can be turn-valid).
    Searches are those the retriever answered (a search in the last allowed round is not run).

    Example:
        >>> summarize(records)["overall"]["em"]  # doctest: +SKIP
        0.42
    """
    sources = sorted({r["data_source"] for r in records})
    return {
        "overall": _summary(records),
        "by_data_source": {s: _summary([r for r in records if r["data_source"] == s]) for s in sources},
    }


class _Progress:
    """Wraps a `GenerateFn`: a bar of finished questions, with the round and the active count as postfix."""

    def __init__(self, generate: GenerateFn, total: int, max_turns: int, desc: str, enabled: bool):
        from tqdm.auto import tqdm

        self.generate = generate
        self.max_turns = max_turns
        self.round = 0
        self.bar = tqdm(total=total, desc=desc, unit="q", disable=not enabled, file=sys.stderr)

    def __call__(self, prompts: list[list[int]]):
        self.round += 1
        self.bar.update(self.bar.total - len(prompts) - self.bar.n)
        self.bar.set_postfix_str(f"round {self.round}/{self.max_turns}, {len(prompts)} active")
        return self.generate(prompts)

    def close(self) -> None:
        self.bar.update(self.bar.total - self.bar.n)
        self.bar.close()


def evaluate(
    model,
    tokenizer,
    rows: Sequence[dict],
    retriever,
    *,
    max_turns: int = 8,
    topk: int = 3,
    context_mode: ContextMode = "memory",
    generator: GenerateFn | None = None,
    batch_size: int = 16,
    max_new_tokens: int = 512,
    temperature: float = 0.0,
    system_prompt: str = DEFAULT_SYSTEM_PROMPT,
    instruction: str = DEFAULT_INSTRUCTION,
    progress: bool = True,
) -> EvalResult:
    """Play every row as one episode with `model` and score it.

    Args:
        model: a transformers causal LM; ignored when `generator` is given (pass ``None`` then).
        tokenizer: its tokenizer, with a chat template.
        rows: QA rows (``question``, ``golden_answers``, optional ``data_source``/``sub_answers``), e.g. `load_qa`.
        retriever: anything with ``search(queries, topk)``.
        context_mode: ``"memory"`` (MemPO) or ``"full_history"`` (Search-R1 baseline).
        generator: a `GenerateFn`; default `HFGenerator(model, tokenizer, ...)` with the arguments below. Its
            ``eos_token_ids`` attribute, if any, tells the rollout which ids end a turn.

    Example:
        >>> import tempfile
        >>> from mempo_trl import load_qa, load_retriever
        >>> from mempo_trl.kit.demo_world import demo_paths
        >>> from mempo_trl.kit.tiny import build_tiny_model, load_tiny
        >>> model, tokenizer = load_tiny(build_tiny_model(tempfile.mkdtemp()))
        >>> rows, retriever = list(load_qa(demo_paths().test))[:4], load_retriever(str(demo_paths().corpus))
        >>> result = evaluate(model, tokenizer, rows, retriever, max_turns=2, max_new_tokens=16, progress=False)
        >>> result.metrics["overall"]["num_questions"], result.records[0]["rounds"][0]["completion_tokens"]
        (4, 16)
    """
    if generator is None:
        from mempo_trl.generation import HFGenerator

        generator = HFGenerator(
            model, tokenizer, max_new_tokens=max_new_tokens, temperature=temperature, batch_size=batch_size
        )
    eos = getattr(generator, "eos_token_ids", None)
    engine = RolloutEngine(
        tokenizer,
        retriever,
        max_turns=max_turns,
        topk=topk,
        context_mode=context_mode,
        system_prompt=system_prompt,
        instruction=instruction,
        eos_token_ids=eos if eos is not None else [tokenizer.eos_token_id],
    )
    rows = [dict(row) for row in rows]
    tracked = _Progress(generator, len(rows), max_turns, f"eval {context_mode}", progress)
    try:
        episodes, timings = engine.run(rows, tracked)
    finally:
        tracked.close()
    records = [episode_record(ep) for ep in episodes]
    return EvalResult(context_mode, records, summarize(records), episodes, timings.generation, timings.retrieval)


def compare_modes(memory: EvalResult, full_history: EvalResult) -> dict[str, float]:
    """Memory vs full-history on the same questions: token reductions in % and score differences.

    ``total_token_reduction_pct`` is ``100 * (1 - total_memory / total_full)`` over all questions (prompt +
    completion tokens of every round); the deltas are memory minus full history.

    Example:
        >>> compare_modes(memory_result, full_result)["total_token_reduction_pct"]  # doctest: +SKIP
        61.3
    """
    mem, full = memory.metrics["overall"], full_history.metrics["overall"]

    def reduction(key: str) -> float:
        return 100.0 * (1.0 - mem[key] / full[key]) if full[key] else math.nan

    return {
        "total_token_reduction_pct": reduction("total_tokens"),
        "peak_context_reduction_pct": reduction("peak_context_tokens"),
        "mean_prompt_reduction_pct": reduction("mean_prompt_tokens"),
        "em_delta": mem["em"] - full["em"],
        "f1_delta": mem["f1"] - full["f1"],
        "sub_em_delta": mem["sub_em"] - full["sub_em"],
        "turns_delta": mem["turns_per_question"] - full["turns_per_question"],
    }


def plot_context_tokens(results: Sequence[EvalResult], path: str | Path) -> Path:
    """Save a PNG of the mean prompt tokens per round index, one line per context mode.

    Example:
        >>> plot_context_tokens([memory_result, full_result], "out/context_tokens.png")  # doctest: +SKIP
        PosixPath('out/context_tokens.png')
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for result in results:
        means = result.metrics["overall"]["prompt_tokens_per_round"]
        ax.plot(range(1, len(means) + 1), means, marker="o", label=result.context_mode)
    ax.set_xlabel("round")
    ax.set_ylabel("mean prompt (context) tokens")
    ax.set_title("Context tokens per round")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def check_model_source(path: str) -> None:
    """Raise `EvalError` unless `path` is a model directory (with ``config.json``) or a Hub model in the local cache.

    Example:
        >>> check_model_source("/no/such/model")
        Traceback (most recent call last):
        mempo_trl.evaluation.EvalError: model '/no/such/model' not found: no such directory, and no model of that name in the local Hugging Face cache (evaluation runs offline). Pass a directory written by save_pretrained, e.g. by `mempo-trl build-tiny-model --out DIR`.
    """
    from huggingface_hub import try_to_load_from_cache

    if Path(path).exists():
        if not (Path(path) / "config.json").is_file():
            raise EvalError(
                f"{path} is not a model directory (no config.json). Pass a directory written by save_pretrained."
            )
        return
    try:
        cached = try_to_load_from_cache(path, "config.json")
    except ValueError:  # not a valid repo id either
        cached = None
    if not isinstance(cached, str):
        raise EvalError(
            f"model {path!r} not found: no such directory, and no model of that name in the local Hugging Face "
            "cache (evaluation runs offline). Pass a directory written by save_pretrained, e.g. by "
            "`mempo-trl build-tiny-model --out DIR`."
        )


def load_eval_tokenizer(path: str):
    """The tokenizer of a model, read as its ``tokenizer.json`` says when there is one, else with `AutoTokenizer`.

    `AutoTokenizer` swaps in `Qwen2Tokenizer` for Qwen2 configs, which re-tokenizes a custom ``tokenizer.json``
    differently. Raises `EvalError` when the tokenizer has no chat template.

    Example:
        >>> load_eval_tokenizer("tiny").padding_side  # doctest: +SKIP
        'left'
    """
    from mempo_trl.loading import load_tokenizer

    tokenizer = load_tokenizer(path)
    if not tokenizer.chat_template:
        raise EvalError(f"the tokenizer of {path} has no chat template; MemPO prompts are chat conversations.")
    return tokenizer


def load_model(path: str, device: str | None = None, dtype: str = "auto"):
    """Load ``(model, tokenizer)`` for evaluation, in eval mode on `device` (default: cuda when available).

    Example:
        >>> model, tokenizer = load_model("tiny", device="cpu")  # doctest: +SKIP
    """
    import torch
    from transformers import AutoModelForCausalLM

    check_model_source(path)
    tokenizer = load_eval_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device).eval(), tokenizer


def _versions(backend: str) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    names = ["mempo_trl", "torch", "transformers", "trl", "tokenizers", "datasets", "bm25s"]
    if backend == "vllm":
        names.append("vllm")
    found = {"python": platform.python_version()}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    return found


@contextmanager
def _quiet_retry_warnings():
    """Silence the HTTP client's per-attempt warnings, so a failed probe prints one line."""
    log = logging.getLogger("mempo_trl.retrieval")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _load_rows(args: argparse.Namespace) -> list[dict]:
    from mempo_trl.data import load_qa
    from mempo_trl.kit.demo_world import demo_paths

    sources = args.data or [str(demo_paths().test)]
    rows = []
    for source in sources:
        dataset = load_qa(source, split=args.split, config=args.data_config)
        if args.limit is not None:
            dataset = dataset.select(range(min(args.limit, len(dataset))))
        name = Path(source).stem if Path(source).exists() else args.data_config or source
        # Rows without a data_source are reported under the name of the file or dataset they come from.
        rows += [
            {**row, "data_source": name if row["data_source"] == "unknown" else row["data_source"]} for row in dataset
        ]
    return rows


def _load_retriever(args: argparse.Namespace, probe: str):
    from mempo_trl.kit.demo_world import demo_paths
    from mempo_trl.retrieval import RetrievalError, load_retriever

    corpus = args.corpus or str(demo_paths().corpus)
    spec = args.retriever or corpus
    kwargs = {"timeout": args.retriever_timeout, "max_retries": args.retriever_retries}
    retriever = load_retriever(spec, **kwargs) if spec.startswith(("http://", "https://")) else load_retriever(spec)
    with _quiet_retry_warnings():
        retriever.search([probe], args.topk)
    info = {"spec": spec, "kind": getattr(retriever, "name", type(retriever).__name__), "corpus": corpus}
    if hasattr(retriever, "num_passages"):
        info["num_passages"] = retriever.num_passages
    if hasattr(retriever, "health"):
        info["corpus"] = args.corpus
        try:  # Search-R1's own server has no /health
            with _quiet_retry_warnings():
                info["server"] = retriever.health()
        except RetrievalError:
            info["server"] = None
    return retriever, info


def _print_summary(results: Sequence[EvalResult], comparison: dict | None) -> None:
    print(
        f"{'mode':<13} {'n':>5} {'EM':>6} {'F1':>6} {'subEM':>6} {'format':>6} {'turns':>5} {'search':>6} "
        f"{'peak ctx':>8} {'tokens/q':>9}"
    )
    for result in results:
        m = result.metrics["overall"]
        print(
            f"{result.context_mode:<13} {m['num_questions']:>5} {m['em']:>6.3f} {m['f1']:>6.3f} {m['sub_em']:>6.3f} "
            f"{m['format_valid']:>6.3f} {m['turns_per_question']:>5.2f} {m['searches_per_question']:>6.2f} "
            f"{m['peak_context_tokens']:>8.1f} {m['total_tokens_per_question']:>9.1f}"
        )
    if comparison is not None:
        print(
            f"memory vs full_history: {comparison['total_token_reduction_pct']:.2f}% fewer total tokens, "
            f"{comparison['peak_context_reduction_pct']:.2f}% lower peak context, F1 {comparison['f1_delta']:+.3f}"
        )


def run_eval(args: argparse.Namespace) -> int:
    """`mempo-trl eval`: load, evaluate every requested context mode, write the outputs; 2 on a bad input."""
    from mempo_trl.data import DataError
    from mempo_trl.retrieval import CorpusError, RetrievalError

    modes = list(CONTEXT_MODES) if args.context_mode == "both" else [args.context_mode]
    try:
        check_model_source(args.model)
        rows = _load_rows(args)
        retriever, retriever_info = _load_retriever(args, rows[0]["question"])
        if args.backend == "vllm":
            from mempo_trl.generation import VLLMGenerator

            model, tokenizer = None, load_eval_tokenizer(args.model)
            generator = VLLMGenerator(args.model, tokenizer, args.max_new_tokens, args.temperature, seed=args.seed)
        else:
            import torch

            from mempo_trl.generation import HFGenerator

            torch.manual_seed(args.seed)
            model, tokenizer = load_model(args.model, args.device, args.dtype)
            generator = HFGenerator(
                model, tokenizer, args.max_new_tokens, args.temperature, batch_size=args.batch_size
            )
    except (DataError, CorpusError, RetrievalError, EvalError, ImportError, OSError, ValueError) as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    try:
        results = [
            evaluate(
                model,
                tokenizer,
                rows,
                retriever,
                max_turns=args.max_turns,
                topk=args.topk,
                context_mode=mode,
                generator=generator,
                progress=not args.no_progress,
            )
            for mode in modes
        ]
    except RetrievalError as e:  # the server went away during the run
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    comparison = compare_modes(*results) if len(results) == 2 else None
    with (out / TRAJECTORIES_FILE).open("w", encoding="utf-8") as f:
        for result in results:
            for record in result.records:
                f.write(json.dumps({"context_mode": result.context_mode, **record}, ensure_ascii=False) + "\n")
    plot_context_tokens(results, out / PLOT_FILE)
    settings = {
        "model": args.model,
        "data": args.data or ["demo test split"],
        "split": args.split,
        "data_config": args.data_config,
        "limit": args.limit,
        "num_questions": len(rows),
        "retriever": retriever_info,
        "topk": args.topk,
        "max_turns": args.max_turns,
        "context_modes": modes,
        "backend": args.backend,
        "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "system_prompt": DEFAULT_SYSTEM_PROMPT,
        "instruction": DEFAULT_INSTRUCTION,
    }
    report = {
        "settings": settings,
        "versions": _versions(args.backend),
        "modes": {
            r.context_mode: {**r.metrics, "generation_s": r.generation_s, "retrieval_s": r.retrieval_s}
            for r in results
        },
        "comparison": comparison,
        "elapsed_s": time.time() - start,
    }
    (out / RESULTS_FILE).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    _print_summary(results, comparison)
    print(f"wrote {out / RESULTS_FILE}, {out / TRAJECTORIES_FILE}, {out / PLOT_FILE}")
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add `mempo-trl eval` (e.g. `--model tiny --context-mode both --out eval_out`)."""
    parser = subparsers.add_parser(
        "eval",
        help="evaluate a model as a MemPO agent (EM/F1, format, token cost)",
        description="Run a model as a MemPO search agent over QA rows and report EM, F1, sub-EM, format validity, "
        "turns, searches and token cost, in memory and/or full-history context mode.",
    )
    parser.add_argument("--model", required=True, help="local model directory (or a cached Hub name)")
    parser.add_argument(
        "--data",
        action="append",
        help="QA .jsonl/.json/.parquet file, FlashRAG-style directory or datasets name; repeatable "
        "(default: the demo test split)",
    )
    parser.add_argument("--split", default="test", help="split of a directory or datasets source")
    parser.add_argument("--data-config", default=None, help="datasets config name, e.g. nq for FlashRAG_datasets")
    parser.add_argument("--limit", type=_positive_int, default=None, help="first N questions of every --data source")
    parser.add_argument("--corpus", default=None, help="corpus .jsonl for BM25 (default: the demo corpus)")
    parser.add_argument(
        "--retriever",
        default=None,
        help="retriever spec: http://host:port, bm25:<corpus>, ... (default: BM25 on --corpus)",
    )
    parser.add_argument("--retriever-timeout", type=float, default=30.0, help="seconds per HTTP request")
    parser.add_argument("--retriever-retries", type=int, default=3, help="HTTP retries after a failed request")
    parser.add_argument("--max-turns", type=_positive_int, default=8, help="rounds per question at most")
    parser.add_argument("--topk", type=_positive_int, default=3, help="passages per search")
    parser.add_argument(
        "--context-mode",
        choices=[*CONTEXT_MODES, "both"],
        default="memory",
        help="memory (MemPO), full_history (Search-R1 baseline) or both on the same questions",
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--backend", choices=["transformers", "vllm"], default="transformers", help="vllm needs mempo_trl[vllm]"
    )
    parser.add_argument("--batch-size", type=_positive_int, default=16, help="prompts per model.generate call")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=512, help="tokens per turn at most")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_eval)
