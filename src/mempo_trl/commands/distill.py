"""`mempo-trl distill`: warm-start data from a teacher played as a MemPO agent (`mempo_trl.distill`).

    mempo-trl distill --model_name_or_path kit/learner/model --dataset_name kit/learner/world/warm.jsonl \\
        --corpus kit/learner/world/corpus.jsonl --output_dir distilled
    MEMPO_OPENAI_API_KEY=... mempo-trl distill --model_name_or_path Qwen/Qwen2.5-3B-Instruct \\
        --openai_base_url http://127.0.0.1:8000/v1 --openai_model Qwen/Qwen2.5-72B-Instruct \\
        --dataset_name data/nq_hotpotqa_train --corpus wiki.jsonl --output_dir distilled

The teacher (`--teacher`, `TEACHERS`) runs with transformers, vLLM (`--use_vllm`) or behind an
OpenAI-compatible API (`--openai_base_url`; `model_name_or_path` then gives only the tokenizer the contexts are
measured with), or is the oracle (`--teacher oracle`, `mempo_trl.oracle`), which plays rows with known hops
(`mempo-trl hotpotqa` rows) without a model:

    mempo-trl distill --teacher oracle --model_name_or_path HuggingFaceTB/SmolLM2-135M-Instruct \\
        --dataset_name data/hotpotqa --dataset_split train --corpus data/hotpotqa/corpus.jsonl --output_dir distilled
 Writes ``train.jsonl`` (one
prompt-completion row per round of every kept episode, for `mempo-trl sft`), ``episodes.jsonl`` (every episode
played), ``requests.jsonl`` (the API's answers), ``mempo_agent.json`` (the turn protocol played) and
``distill_report.json``. Rerun the same command after a stop: it continues where it stopped and sends no answered
request again (one in flight when the run was killed is sent again).
"""

import argparse
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from mempo_trl.commands import add_command, parse
from mempo_trl.commands.ask import AgentArguments, load_agent
from mempo_trl.retrieval.settings import RetrieverArguments, build_retriever


REPORT_FILE = "distill_report.json"
SETTINGS_FILE = "distill_settings.json"
REQUESTS_FILE = "requests.jsonl"
TEACHERS = {
    "transformers": "the model's weights, generated with transformers (the default)",
    "vllm": "the model's weights, generated with vLLM (as --use_vllm)",
    "openai": "an OpenAI-compatible API (--openai_base_url, --openai_model); --model_name_or_path gives only the "
    "tokenizer and the protocol",
    "oracle": "a scripted agent (`mempo_trl.oracle`) for rows with hop_queries and hop_facts (`mempo-trl hotpotqa` "
    "rows, the demo world's): it searches each hop with the real retriever (again with the title when the gold "
    "paragraph is missed), keeps the facts found in <mem> and answers the gold; --model_name_or_path gives only the "
    "tokenizer (the student's) and the protocol",
}
"""The teachers `mempo-trl distill` plays (``--teacher``), and what each is."""


@dataclass
class DistillArguments:
    """The QA rows the teacher plays, the rule that keeps its episodes and where the rows go."""

    output_dir: str = field(metadata={"help": "Directory for train.jsonl, episodes.jsonl and distill_report.json."})
    dataset_name: str = field(
        metadata={"help": "QA .jsonl/.json/.parquet file, FlashRAG-style directory or `datasets` name."}
    )
    dataset_split: str = field(default="train", metadata={"help": "Split of a directory or `datasets` source."})
    dataset_config: str | None = field(default=None, metadata={"help": "`datasets` config name."})
    max_samples: int | None = field(default=None, metadata={"help": "First N rows of the source."})
    keep: str = field(
        default="correct",
        metadata={
            "help": "Episodes kept: correct (format-valid and exact match, at least min_share of the parts of a "
            "multi-objective row) or format_valid (right or wrong).",
            "choices": ["correct", "format_valid"],
        },
    )
    min_share: float = field(
        default=1.0, metadata={"help": "Share of a multi-objective row's parts that must be answered exactly."}
    )
    save_every: int = field(
        default=16, metadata={"help": "Rows played together; their episodes are saved when the group ends."}
    )
    teacher: str | None = field(
        default=None,
        metadata={
            "help": "Who plays the episodes (default: transformers, or as --use_vllm / --openai_base_url say): "
            + "; ".join(f"{name}: {text}" for name, text in TEACHERS.items())
            + ".",
            "choices": list(TEACHERS),
        },
    )

    @property
    def resumes_output_dir(self) -> bool:
        """A rerun continues the episodes saved in ``output_dir`` (`mempo_trl.commands.parse` lets it in)."""
        return (Path(self.output_dir) / SETTINGS_FILE).is_file()

    def __post_init__(self):
        if not 0.0 < self.min_share <= 1.0:
            raise ValueError(f"min_share must be in (0, 1], got {self.min_share}.")
        if self.save_every < 1 or (self.max_samples is not None and self.max_samples < 1):
            raise ValueError(f"save_every and max_samples must be >= 1, got {self.save_every}, {self.max_samples}.")


def _rows(args: DistillArguments) -> list[dict]:
    """The rows to play, each with a unique ``id`` (its row number when the source has none); `DataError` names a
    duplicate."""
    from mempo_trl.data import DataError, load_qa

    dataset = load_qa(args.dataset_name, split=args.dataset_split, config=args.dataset_config)
    if args.max_samples is not None:
        dataset = dataset.select(range(min(args.max_samples, len(dataset))))
    rows, seen = [], {}
    for index, row in enumerate(dataset):
        row_id = str(row["id"]) if row.get("id") not in (None, "") else str(index)
        if row_id in seen:
            raise DataError(
                f"{args.dataset_name}, rows {seen[row_id] + 1} and {index + 1} have the same id {row_id!r}: distill "
                "saves episodes by id; give every row its own id."
            )
        seen[row_id] = index
        rows.append({**row, "id": row_id})
    return rows


def teacher_name(teacher: str | None, agent_args: AgentArguments) -> str:
    """The `TEACHERS` entry that plays: ``--teacher``, or the backend flags' (``--use_vllm``, ``--openai_base_url``);
    `ValueError` when they disagree.

    Example:
        >>> teacher_name(None, AgentArguments("m", use_vllm=True)), teacher_name("oracle", AgentArguments("m"))
        ('vllm', 'oracle')
    """
    flagged = "openai" if agent_args.openai_base_url else "vllm" if agent_args.use_vllm else None
    if teacher is None or teacher == flagged:
        return flagged or teacher or "transformers"
    if flagged is not None:
        flag = "--openai_base_url" if flagged == "openai" else "--use_vllm"
        raise ValueError(f"--teacher {teacher} and {flag} name two teachers: give one.")
    if teacher == "openai":
        raise ValueError("--teacher openai needs --openai_base_url URL and --openai_model NAME.")
    return teacher


def _check_oracle_rows(rows: list[dict], source_name: str) -> None:
    """Raise `DataError` naming the first row the oracle teacher cannot play (`mempo_trl.oracle.row_problem`)."""
    from mempo_trl.data import DataError
    from mempo_trl.oracle import row_problem

    for number, row in enumerate(rows, 1):
        problem = row_problem(row)
        if problem is not None:
            raise DataError(f"{source_name}, row {number} (id {row['id']!r}): {problem}.")


def _check_same_run(out: Path, settings: dict, save: bool = False) -> None:
    """Refuse to continue an output directory whose saved episodes another teacher, source or protocol played (the
    ``settings`` given are compared); with ``save``, record ``settings``."""
    from mempo_trl.outputs import OutputError

    path = out / SETTINGS_FILE
    if path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
        changed = sorted(k for k in settings if settings[k] != saved.get(k))
        if changed:
            raise OutputError(
                f"{out} holds episodes distilled with other settings ({', '.join(changed)} differ, see {path}). "
                "Rerun with the same settings to continue, pass --overwrite_output_dir to start again, or choose "
                "another output directory."
            )
    if save:
        path.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def saved_group(out: Path, done: int, total: int) -> None:
    """After a group of episodes is saved: the run has results of its own (`drop_set_aside`); say how far it is."""
    from mempo_trl.outputs import drop_set_aside

    drop_set_aside(out)
    print(f"distill: {done}/{total} rows played", flush=True)


def main(argv: list[str] | None = None) -> int:
    from mempo_trl.commands.eval import _versions
    from mempo_trl.distill import distill
    from mempo_trl.oracle import OracleTeacher

    agent_args, args, retriever_args = parse(
        "mempo-trl distill", [AgentArguments, DistillArguments, RetrieverArguments], argv
    )
    if agent_args.context_mode == "both":
        raise ValueError("distill plays one context mode: memory or full_history.")
    name = teacher_name(args.teacher, agent_args)
    if name == "vllm":
        agent_args = replace(agent_args, use_vllm=True)
    out = Path(args.output_dir)
    rows = _rows(args)
    if name == "oracle":
        _check_oracle_rows(rows, args.dataset_name)
    teacher = {
        "model_name_or_path": agent_args.model_name_or_path,
        "backend": name,
        "openai_base_url": agent_args.openai_base_url,
        "openai_model": agent_args.openai_model,
        "temperature": agent_args.temperature,
        "seed": agent_args.seed,
    }
    data = {
        "dataset_name": args.dataset_name,
        "dataset_split": args.dataset_split,
        "dataset_config": args.dataset_config,
        "corpus": retriever_args.corpus,
        "retriever_url": retriever_args.retriever_url,
    }
    _check_same_run(out, {"teacher": teacher, "data": data})  # before the teacher loads
    retriever = build_retriever(retriever_args)
    oracle = None
    if name == "oracle":

        def oracle(tokenizer, protocol):
            return OracleTeacher(tokenizer, retriever, protocol.retrieval_topk, protocol.max_turns)

    agent = load_agent(
        agent_args, retriever, agent_args.context_mode, openai_cache=out / REQUESTS_FILE, generator=oracle
    )
    agent.rollout_engine().check_first_contexts(rows, args.dataset_name)
    _check_same_run(out, {"teacher": teacher, "data": data, "protocol": asdict(agent.protocol)}, save=True)
    agent.protocol.save(out)
    start = time.time()
    counts = distill(
        agent,
        rows,
        out,
        keep=args.keep,
        min_share=args.min_share,
        save_every=args.save_every,
        on_group=lambda done, total: saved_group(out, done, total),
    )
    report = {
        **counts,
        "keep": args.keep,
        "min_share": args.min_share,
        "teacher": teacher,
        "data": {**data, "max_samples": args.max_samples, "num_rows": len(rows)},
        "protocol": asdict(agent.protocol),
        "requests_sent": getattr(agent.generator, "requests_sent", None),
        "versions": _versions(agent_args.use_vllm),
        "elapsed_s": time.time() - start,
    }
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(
        f"kept {counts['kept']} of {counts['episodes']} episodes ({counts['played']} played now; "
        f"{', '.join(f'{k} {v}' for k, v in sorted(counts['by_reason'].items()))}): {counts['rows']} rows in "
        f"{out / 'train.jsonl'}; report in {out / REPORT_FILE}"
    )
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    add_command(subparsers, "distill", "play a teacher as a MemPO agent and keep its good turns as SFT rows", main)
