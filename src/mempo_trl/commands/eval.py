"""`mempo-trl eval`: play a trained agent over QA rows and report EM, F1, format, turns, searches and token cost.

    mempo-trl eval --model_name_or_path outputs/quickstart --dataset_name outputs/quickstart/learner_world/test.jsonl \\
        --corpus outputs/quickstart/learner_world/corpus.jsonl --output_dir eval_out --context_mode both

With `--environment my_pkg.envs.MyEnv` (an import path) the agent plays that TRL-style environment instead of
searching; `--dataset_name` then holds its `reset` rows (.jsonl).

The agent runs with the turn protocol saved with it (`mempo_agent.json`); a flag such as `--max_turns 4` overrides them
and says so. Contexts are held to the model's limit and `max_context_tokens` as in training (`context_overflow`): a
question whose first context does not fit is refused before any is played. Writes ``results.json`` (metrics, settings, versions), ``trajectories.jsonl`` (one line per question
and mode) and ``context_tokens.png`` (mean prompt tokens per round) into `output_dir`.

With `--objectives 1 2 4 8` it runs the objectives sweep instead (`mempo_trl.sweep`, docs/objectives.md): one set of
K-question rows per K, and ``objectives.json``, ``trajectories.jsonl`` and ``objectives.png``.
"""

import argparse
import importlib.util
import json
import logging
import platform
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mempo_trl.commands import add_command, parse
from mempo_trl.commands.ask import AgentArguments, load_agent
from mempo_trl.context import COMPARED_CONTEXT_MODES
from mempo_trl.evaluation import EvalResult, compare_modes, evaluate, plot_context_tokens
from mempo_trl.retrieval.settings import RetrieverArguments, build_retriever


RESULTS_FILE = "results.json"
TRAJECTORIES_FILE = "trajectories.jsonl"
PLOT_FILE = "context_tokens.png"
OBJECTIVES_FILE = "objectives.json"
OBJECTIVES_PLOT = "objectives.png"


@dataclass
class EvalArguments:
    """The questions to evaluate on and where the results go."""

    output_dir: str = field(metadata={"help": "Directory for results.json, trajectories.jsonl and the plot."})
    dataset_name: list[str] = field(
        metadata={
            "help": "QA .jsonl/.json/.parquet files, FlashRAG-style directories or `datasets` names, each "
            "reported on its own; with `environment`, .jsonl files of its reset rows."
        },
    )
    dataset_split: str = field(default="test", metadata={"help": "Split of a directory or `datasets` source."})
    dataset_config: str | None = field(
        default=None, metadata={"help": "`datasets` config name, e.g. nq for FlashRAG_datasets."}
    )
    max_eval_samples: int | None = field(default=None, metadata={"help": "First N questions of every source."})
    environment: str | None = field(
        default=None,
        metadata={
            "help": "Play a TRL-style environment instead of searching: an import path (my_pkg.envs.MyEnv; "
            "the kit's: mempo_trl.kit.envs.KeyVaultEnv, ...). dataset_name then holds its reset rows (.jsonl)."
        },
    )
    disable_tqdm: bool = field(default=False, metadata={"help": "No progress bar."})
    objectives: list[int] | None = field(
        default=None,
        metadata={
            "help": "The objectives sweep: evaluate on rows of K questions for every K given (e.g. 1 2 4 8), "
            "composed from dataset_name with `seed` (or read from a `mempo-trl compose` directory); writes "
            "objectives.json and objectives.png. max_eval_samples then caps the rows per K."
        },
    )

    def __post_init__(self):
        if self.max_eval_samples is not None and self.max_eval_samples < 1:
            raise ValueError(f"max_eval_samples must be >= 1, got {self.max_eval_samples}.")
        if self.objectives is not None and (
            not self.objectives or min(self.objectives) < 1 or len(set(self.objectives)) < len(self.objectives)
        ):
            raise ValueError(
                f"objectives must be distinct whole numbers >= 1 (e.g. --objectives 1 2 4 8), got {self.objectives}."
            )
        if self.objectives and self.environment:
            raise ValueError("objectives composes QA rows; it cannot be used with environment. Leave one out.")


def _versions(use_vllm: bool) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    names = ["mempo_trl", "torch", "transformers", "trl", "tokenizers", "datasets", "bm25s"]
    if use_vllm:
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


def _load_rows(args: EvalArguments) -> dict[str, list[dict]]:
    """The QA rows of every `dataset_name` source, by source."""
    from mempo_trl.data import load_qa

    rows = {}
    for source in args.dataset_name:
        dataset = load_qa(source, split=args.dataset_split, config=args.dataset_config)
        if args.max_eval_samples is not None:
            dataset = dataset.select(range(min(args.max_eval_samples, len(dataset))))
        name = Path(source).stem if Path(source).exists() else args.dataset_config or source
        # Rows without a data_source are reported under the name of the file or dataset they come from.
        rows[source] = [
            {**row, "data_source": name if row["data_source"] == "unknown" else row["data_source"]} for row in dataset
        ]
    return rows


def _objective_rows(args: EvalArguments, seed: int) -> dict[str, list[dict]]:
    """The rows of every K of the objectives sweep, by ``"K objectives"``: read from a `mempo-trl compose` directory
    (its ``k{K}/{split}.jsonl``), or composed from the pooled `dataset_name` sources with ``seed``."""
    from mempo_trl.commands.compose import REPORT_FILE, load_pool, objectives_dir
    from mempo_trl.compose import compose_objectives
    from mempo_trl.data import DataError, load_qa

    composed = [source for source in args.dataset_name if (Path(source) / REPORT_FILE).is_file()]
    if composed and len(args.dataset_name) > 1:
        raise DataError(
            f"{composed[0]} holds composed rows (mempo-trl compose); with objectives it must be the only dataset_name."
        )
    if not composed:
        pool = load_pool(args.dataset_name, args.dataset_split, args.dataset_config)
        where = f"{', '.join(args.dataset_name)} [{args.dataset_split}]"
        return {
            f"{k} objectives": compose_objectives(
                pool, k, seed=seed, max_rows=args.max_eval_samples, source_name=where
            )
            for k in args.objectives
        }
    rows = {}
    for k in args.objectives:
        path = objectives_dir(composed[0], k) / f"{args.dataset_split}.jsonl"
        if not path.is_file():
            raise DataError(
                f"{path}: not found, so {composed[0]} has no {k}-objective {args.dataset_split} rows. Compose them "
                f"(mempo-trl compose --objectives {k} --dataset_split {args.dataset_split} ...), or leave {k} out of "
                "--objectives."
            )
        rows[f"{k} objectives"] = list(load_qa(path))[: args.max_eval_samples]
    return rows


def _environment_rows(args: EvalArguments) -> list[dict]:
    """The rows an environment is evaluated on: the `dataset_name` .jsonl files (every row as `reset` arguments)."""
    from mempo_trl.data import read_jsonl

    rows = []
    for source in args.dataset_name:
        found = read_jsonl(source)
        rows += [{"data_source": Path(source).stem, **row} for row in found[: args.max_eval_samples or len(found)]]
    return rows


def _probe_retriever(retriever, args: RetrieverArguments, probe: str) -> dict:
    """Search once (a dead server fails here, not mid-run) and describe the retriever for results.json."""
    from mempo_trl.retrieval import RetrievalError

    with _quiet_retry_warnings():
        retriever.search([probe], 1)
    info = {"kind": getattr(retriever, "name", type(retriever).__name__), "corpus": args.corpus}
    if args.retriever_url:
        info.update(url=args.retriever_url, corpus=args.corpus)
    if hasattr(retriever, "num_passages"):
        info["num_passages"] = retriever.num_passages
    if hasattr(retriever, "health"):
        try:  # Search-R1's own server has no /health
            with _quiet_retry_warnings():
                info["server"] = retriever.health()
        except RetrievalError:
            info["server"] = None
    return info


def _print_summary(results: Sequence[EvalResult], comparison: dict | None) -> None:
    print(
        f"{'mode':<13} {'n':>5} {'EM':>6} {'F1':>6} {'subEM':>6} {'format':>6} {'turns':>5} {'search':>6} "
        f"{'peak ctx':>8} {'tokens/q':>9}" + (f" {'reward':>6}" if "reward" in results[0].metrics["overall"] else "")
    )
    for result in results:
        m = result.metrics["overall"]
        print(
            f"{result.context_mode:<13} {m['num_questions']:>5} {m['em']:>6.3f} {m['f1']:>6.3f} {m['sub_em']:>6.3f} "
            f"{m['format_valid']:>6.3f} {m['turns_per_question']:>5.2f} {m['searches_per_question']:>6.2f} "
            f"{m['peak_context_tokens']:>8.1f} {m['total_tokens_per_question']:>9.1f}"
            + (f" {m['reward']:>6.3f}" if "reward" in m else "")
        )
    if comparison is not None:
        print(
            f"memory vs full_history: {comparison['total_token_reduction_pct']:.2f}% fewer total tokens, "
            f"{comparison['peak_context_reduction_pct']:.2f}% lower peak context, F1 {comparison['f1_delta']:+.3f}"
        )


def _sweep(agent, rows: list[list[dict]], modes: list[str], out: Path, settings: dict, progress: bool) -> int:
    """The objectives sweep (`mempo_trl.sweep`): evaluate every K in every mode, write the table, trajectories and
    figure."""
    from mempo_trl.sweep import evaluate_objectives, format_table, objectives_table, plot_objectives

    start = time.time()
    rows_by_k = dict(zip(settings["objectives"], rows))
    results = evaluate_objectives(agent, rows_by_k, modes, progress=progress)
    table = objectives_table(results)
    with (out / TRAJECTORIES_FILE).open("w", encoding="utf-8") as f:
        for k, by_mode in results.items():
            for mode, result in by_mode.items():
                for record in result.records:
                    line = {"objectives": k, "context_mode": mode, **record}
                    f.write(json.dumps(line, ensure_ascii=False) + "\n")
    datasets = ", ".join(Path(name).name for name in settings["dataset_name"])
    plot_objectives(table, out / OBJECTIVES_PLOT, f"{settings['model_name_or_path']} on {datasets}")
    report = {
        "settings": settings,
        "versions": _versions(settings["use_vllm"]),
        "table": table,
        "objectives": {
            str(k): {
                mode: {**r.metrics, "generation_s": r.generation_s, "retrieval_s": r.retrieval_s}
                for mode, r in by_mode.items()
            }
            for k, by_mode in results.items()
        },
        "comparison": {
            str(k): compare_modes(*by_mode.values()) for k, by_mode in results.items() if len(by_mode) == 2
        },
        "elapsed_s": time.time() - start,
    }
    (out / OBJECTIVES_FILE).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(format_table(table))
    print(f"wrote {out / OBJECTIVES_FILE}, {out / TRAJECTORIES_FILE}, {out / OBJECTIVES_PLOT}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`mempo-trl eval`: load, evaluate every requested context mode, write the outputs."""
    if importlib.util.find_spec("matplotlib") is None:  # before the run, not after it
        raise ImportError("mempo-trl eval draws context_tokens.png with matplotlib: pip install 'mempo_trl[eval]'.")
    agent_args, eval_args, retriever_args = parse(
        "mempo-trl eval", [AgentArguments, EvalArguments, RetrieverArguments], argv
    )
    context_mode = None if agent_args.context_mode == "both" else agent_args.context_mode
    if eval_args.environment:
        from mempo_trl.environments import check_environment, load_environment

        environment_factory = load_environment(eval_args.environment)
        check_environment(environment_factory)
        rows, retriever_info = _environment_rows(eval_args), {"environment": eval_args.environment}
        sources = {}  # reset rows: no first context to check
        agent = load_agent(agent_args, None, context_mode, environment_factory=environment_factory)
    else:
        sources = _objective_rows(eval_args, agent_args.seed) if eval_args.objectives else _load_rows(eval_args)
        rows = [row for found in sources.values() for row in found]
        retriever = build_retriever(retriever_args)
        retriever_info = _probe_retriever(retriever, retriever_args, rows[0]["question"])
        agent = load_agent(agent_args, retriever, context_mode)

    modes = list(COMPARED_CONTEXT_MODES) if agent_args.context_mode == "both" else [agent.protocol.context_mode]
    out = Path(eval_args.output_dir)
    settings = {
        "model_name_or_path": agent_args.model_name_or_path,
        "dataset_name": eval_args.dataset_name,
        "dataset_split": eval_args.dataset_split,
        "dataset_config": eval_args.dataset_config,
        "max_eval_samples": eval_args.max_eval_samples,
        "num_questions": len(rows),
        "retriever": retriever_info,
        "context_modes": modes,
        "protocol": asdict(agent.protocol),
        "protocol_saved": agent.saved_protocol is not None,
        "use_vllm": agent_args.use_vllm,
        "openai_base_url": agent_args.openai_base_url,
        "openai_model": agent_args.openai_model,
        "temperature": agent_args.temperature,
        "per_device_eval_batch_size": agent_args.per_device_eval_batch_size,
        "seed": agent_args.seed,
        "objectives": eval_args.objectives,
    }
    with agent:  # a vLLM engine is shut down once the questions are played (or on an error)
        for source, found in sources.items():
            agent.rollout_engine().check_first_contexts(found, source)  # every question fits, before any is played
        out.mkdir(parents=True, exist_ok=True)
        if eval_args.objectives:
            return _sweep(agent, list(sources.values()), modes, out, settings, not eval_args.disable_tqdm)
        start = time.time()
        results = [evaluate(agent, rows, context_mode=m, progress=not eval_args.disable_tqdm) for m in modes]
    comparison = compare_modes(*results) if len(results) == 2 else None
    with (out / TRAJECTORIES_FILE).open("w", encoding="utf-8") as f:
        for result in results:
            for record in result.records:
                f.write(json.dumps({"context_mode": result.context_mode, **record}, ensure_ascii=False) + "\n")
    datasets = ", ".join(Path(name).name for name in eval_args.dataset_name)
    plot_context_tokens(results, out / PLOT_FILE, f"{agent_args.model_name_or_path} on {datasets}")
    report = {
        "settings": settings,
        "versions": _versions(agent_args.use_vllm),
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


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    add_command(
        subparsers,
        "eval",
        "evaluate a trained agent (EM/F1, format, turns, token cost) in one or both context modes",
        main,
    )
