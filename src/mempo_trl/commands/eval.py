"""`mempo-trl eval`: load a model, QA files and a retriever, run `mempo_trl.evaluation.evaluate`, write the results.

Writes ``results.json`` (metrics, settings, versions), ``trajectories.jsonl`` (one line per question and mode) and
``context_tokens.png`` (mean prompt tokens per round).
"""

import argparse
import json
import logging
import platform
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

from mempo_trl.context import CONTEXT_MODES, DEFAULT_INSTRUCTION, DEFAULT_SYSTEM_PROMPT
from mempo_trl.evaluation import (
    EvalError,
    EvalResult,
    check_model_source,
    compare_modes,
    evaluate,
    load_eval_tokenizer,
    load_model,
    plot_context_tokens,
)
from mempo_trl.outputs import prepare_output_dir


RESULTS_FILE = "results.json"
TRAJECTORIES_FILE = "trajectories.jsonl"
PLOT_FILE = "context_tokens.png"


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
    prepare_output_dir(args.out, overwrite=args.overwrite_output_dir)
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
        "--overwrite_output_dir", action="store_true", help="write into an --out that already holds results"
    )
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
