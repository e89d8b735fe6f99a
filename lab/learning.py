"""Does it learn? MemPO against its ablations, from one warm start, on CPU.

Three arms train from the same SFT warm start (`build_learner`, `mempo_trl.kit.learner`) with the same budget (steps, G, batch, lr)
on the same RL questions, and are evaluated greedily on held-out questions (never in the SFT or RL data) every
`--eval-every` steps:

- `mempo`: memory context + memory advantage (the defaults);
- `outcome_only`: memory context, outcome advantage only (`memory_coef: 0`);
- `full_history`: full-history GRPO, the Search-R1 baseline (`context_mode: full_history`; evaluated in that mode).

Resumable: every (arm, seed) run writes `runs/<arm>_s<seed>/curve.json` after each evaluation and `run.json` when
it ends; a rerun skips finished runs (same settings), so later sessions on the same machine add seeds. Run
directories stay out of git (default `--out`: `runs/learning`). After every run it rewrites the summary
(`--results`, default `learning.json` next to the runs), `learning_curves.json` (all curves) and the figure. The
`HEADLINE` configuration run into the default `--out` writes the README's answer, `lab/results/learning.json`,
instead; its warm start is the shipped learner (`mempo_trl.kit.learner.shipped_learner`), so it needs no 3,000-step
SFT. `lab/results/learning_probes.json` keeps the summaries of the earlier configurations and probes, each with
its command.

    python lab/learning.py --mem-drop 0.6 --set learning_rate=1e-4 per_device_train_batch_size=16 \
        temperature=0.7 max_steps=300 --eval-every 50   # HEADLINE: all arms x seeds 0 1 2 (resumable)
    python lab/learning.py --seeds 0                # the shipped BUDGET from the first warm start, one seed per arm
    python lab/learning.py --quick --out outputs/learning_quick   # CI smoke: tiny world, a few steps
    python lab/learning.py --headroom --set temperature=0.7        # what RL can gain, before spending it

`--headroom` trains nothing: it plays the held-out rows with the warm start, greedily (why each miss fails:
`analytics.failure_kind`) and G times sampled at the budget's temperature (mean EM, pass@G, the share
of rows whose samples disagree), measures how much each remembered fact raises P(gold), the memory reward's raw
material (`analytics.memory_signal`), and writes `headroom.json` next to the runs. `--mem-drop P` starts every arm
from a more forgetful warm start instead (the shipped one continued with the oracle's `<mem>` dropping each fact
with probability P), into `<out>/mem_drop=P/`.
"""

import argparse
import hashlib
import json
import math
import os
import platform
import re
import shutil
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

from mempo_trl.kit.learner import LEARNER_INSTRUCTION, LEARNER_SIZE, MEM_DROP, LearnerPaths
from mempo_trl.kit.warmstart import WARM_START_FILE, WarmSettings


LEARNER_WARM = WarmSettings(steps=3000, batch_size=16, lr=3e-3, mem_drop=MEM_DROP, instruction=LEARNER_INSTRUCTION)
"""The SFT warm start of the learner, the base of the shipped learner (`mempo_trl.kit.learner.shipped_learner`)."""


ARMS = {
    "mempo": {},
    "outcome_only": {"memory_coef": 0.0},
    "full_history": {"context_mode": "full_history"},
}
"""The arms: MemPOConfig overrides of the shared budget."""

BUDGET = {
    "max_steps": 40,
    "per_device_train_batch_size": 8,
    "num_generations": 4,
    "learning_rate": 3e-4,
    "max_completion_length": 96,
    "max_turns": 4,
    "retrieval_topk": 3,
    "temperature": 1.0,
    "beta": 0.0,
    "loss_type": "dapo",
    "instruction": LEARNER_INSTRUCTION,
}
"""What every arm gets: steps, G, batch (episodes per step), lr, and the episode limits."""

FORGETFUL = {"steps": 300, "lr": 1e-3}
"""`--mem-drop P`: SFT steps and lr that continue the shipped warm start with ``mem_drop = P``
(`derive_learner`)."""

HEADLINE = {
    "mem_drop": 0.6,
    "budget": {
        **BUDGET,
        "learning_rate": 1e-4,
        "per_device_train_batch_size": 16,
        "temperature": 0.7,
        "max_steps": 300,
    },
}
"""The configuration behind the README's answer (`--mem-drop 0.6` and these `--set` overrides): its summary and
figure are `lab/results/learning.json` and `learning.png`, the others' are written next to their runs."""

QUICK = {
    "world": {"seed": 1, "num_entities": 60, "num_questions": 120},
    "sizes": {"test": 8, "rl": 32},
    "warm": {"steps": 4, "batch_size": 4, "max_warm_rows": 16},
    "budget": {"max_steps": 2, "per_device_train_batch_size": 4, "num_generations": 2},
    "eval_every": 1,
}


def _machine() -> dict:
    """Where a result was made: results repeat on the CPU model that made them (a warm start built on an AMD EPYC and
    on an Intel Xeon of this workplace differ: float kernels), so the model name is recorded too."""
    cpuinfo = Path("/proc/cpuinfo")
    names = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.M) if cpuinfo.is_file() else []
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu": names[0] if names else None,
        "cpus": os.cpu_count(),
    }


def _versions() -> dict:
    import torch
    import transformers
    import trl

    import mempo_trl

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "mempo_trl": mempo_trl.__version__,
    }


def parse_overrides(items: list[str]) -> dict:
    """``KEY=VALUE`` items to a dict of BUDGET overrides; each key must be a `MemPOConfig` field, values are JSON
    (a bare word is a string).

    >>> parse_overrides(["learning_rate=1e-4", "memory_threshold=null"])
    {'learning_rate': 0.0001, 'memory_threshold': None}
    """
    from dataclasses import fields

    from mempo_trl import MemPOConfig

    known = {f.name for f in fields(MemPOConfig)}
    overrides = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or key not in known:
            raise ValueError(
                f"--set {item}: expected KEY=VALUE with KEY a MemPOConfig field (e.g. learning_rate=1e-4)"
            )
        try:
            overrides[key] = json.loads(text)
        except json.JSONDecodeError:
            overrides[key] = text
    return overrides


def _settings(args, budget: dict, warm: dict, world: dict, sizes: dict) -> dict:
    return {"budget": budget, "warm": warm, "world": world, "sizes": sizes, "eval_rows": args.eval_rows}


def run_arm(arm: str, seed: int, run_dir: Path, warm_dir: Path, rows: dict, retriever, settings: dict, args) -> dict:
    """Train one arm from the warm start; write `curve.json` after every evaluation and `run.json` at the end."""
    import torch
    from analytics import lab_row_metric

    from mempo_trl import MemPOConfig, MemPOTrainer
    from mempo_trl.callbacks import HeldOutEvalCallback
    from mempo_trl.data import load_qa
    from mempo_trl.kit.tiny import load_tiny

    overrides = ARMS[arm]
    context_mode = overrides.get("context_mode", "memory")
    model, tokenizer = load_tiny(warm_dir)
    model.train()
    run_dir.mkdir(parents=True, exist_ok=True)
    config = MemPOConfig(
        output_dir=str(run_dir),
        **{**settings["budget"], **overrides},
        seed=seed,
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )

    def save_curve(curve):
        (run_dir / "curve.json").write_text(json.dumps({"arm": arm, "seed": seed, "curve": curve}, indent=2))

    callback = HeldOutEvalCallback(
        tokenizer,
        rows["test"],
        retriever,
        eval_every=args.eval_every,
        on_result=save_curve,
        row_metric=lab_row_metric(retriever, memory_context=context_mode == "memory"),
        protocol=protocol_of(settings["budget"], context_mode),
    )
    # The warm start's evaluation is the same for every arm and seed of a context mode: computed once.
    warm_eval = run_dir.parent / f"warm_eval_{context_mode}.json"
    if warm_eval.is_file() and json.loads(warm_eval.read_text())["settings"] == settings:
        callback.curve.append(json.loads(warm_eval.read_text())["eval"])
    trainer = MemPOTrainer(
        model,
        retriever,
        args=config,
        train_dataset=load_qa(str(rows["rl_path"])),
        processing_class=tokenizer,
        callbacks=[callback],
    )
    torch.manual_seed(seed)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    warm_eval.write_text(json.dumps({"settings": settings, "eval": callback.curve[0]}, indent=2))
    train_log = [e for e in trainer.state.log_history if "episode/em" in e]
    record = {
        "arm": arm,
        "seed": seed,
        "settings": settings,
        "overrides": overrides,
        "seconds": seconds,
        "curve": callback.curve,
        "train_em": [e["episode/em"] for e in train_log],
        "train_reward": [e.get("reward") for e in train_log],
    }
    (run_dir / "run.json").write_text(json.dumps(record, indent=2))
    return record


def _mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _failures(finals: list[dict]) -> dict[str, float] | None:
    """Mean over seeds of the share of held-out rows per `failure_kind` (None for runs evaluated before it was kept)."""
    if not all("failures" in f for f in finals):
        return None
    return {kind: statistics.fmean(f["failures"][kind] for f in finals) for kind in finals[0]["failures"]}


def summarize(records: list[dict], command: str) -> dict:
    """Per arm: warm and final held-out EM (mean/std over seeds), EM by type, tokens per question, memory recall."""
    arms = {}
    for arm in ARMS:
        runs = sorted((r for r in records if r["arm"] == arm), key=lambda r: r["seed"])
        if not runs:
            continue
        finals = [r["curve"][-1] for r in runs]
        warm = runs[0]["curve"][0]
        em_mean, em_std = _mean_std([f["em"] for f in finals])
        types = sorted({t for f in finals for t in f["by_type"]})
        arms[arm] = {
            "seeds": [r["seed"] for r in runs],
            "steps": finals[0]["step"],
            "warm_em": warm["em"],
            "final_em_mean": em_mean,
            "final_em_std": em_std,
            "final_f1_mean": _mean_std([f["f1"] for f in finals])[0],
            "final_em_by_type": {t: _mean_std([f["by_type"][t]["em"] for f in finals])[0] for t in types},
            "warm_em_by_type": {t: warm["by_type"][t]["em"] for t in warm["by_type"]},
            "format_valid": _mean_std([f["format_valid"] for f in finals])[0],
            "tokens_per_question": _mean_std([f["total_tokens_per_question"] for f in finals])[0],
            "warm_tokens_per_question": warm["total_tokens_per_question"],
            "peak_context_tokens": _mean_std([f["peak_context_tokens"] for f in finals])[0],
            "memory_recall": _mean_std([f["memory_recall"] for f in finals])[0],
            "memory_recall_std": _mean_std([f["memory_recall"] for f in finals])[1],
            "warm_memory_recall": warm["memory_recall"],
            "final_failures": _failures(finals),
            "train_minutes_per_run": statistics.fmean(r["seconds"] for r in runs) / 60,
        }
    settings = records[0]["settings"] if records else {}
    return {"arms": arms, "settings": settings, "command": command, "versions": _versions()}


def plot(records: list[dict], path: Path) -> None:
    """Held-out EM and memory recall vs step per arm (mean line, min-max band over seeds), and final tokens per
    question per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_em, ax_recall, ax_tok) = plt.subplots(1, 3, figsize=(15, 4))
    labels, tokens = [], []
    for arm in ARMS:
        runs = [r for r in records if r["arm"] == arm]
        if not runs:
            continue
        steps = [p["step"] for p in runs[0]["curve"]]
        for ax, key in ((ax_em, "em"), (ax_recall, "memory_recall")):
            values = [[p[key] for p in r["curve"]][: len(steps)] for r in runs]
            width = min(len(v) for v in values)
            mean = [statistics.fmean(v[k] for v in values) for k in range(width)]
            line = ax.plot(steps[:width], mean, marker="o", label=f"{arm} ({len(runs)} seed(s))")[0]
            if len(runs) > 1:
                low = [min(v[k] for v in values) for k in range(width)]
                high = [max(v[k] for v in values) for k in range(width)]
                ax.fill_between(steps[:width], low, high, color=line.get_color(), alpha=0.2)
        labels.append(arm)
        tokens.append(statistics.fmean(r["curve"][-1]["total_tokens_per_question"] for r in runs))
    for ax, label in ((ax_em, "held-out EM (greedy)"), (ax_recall, "memory recall (held-out, last <mem>)")):
        ax.set_xlabel("MemPO step")
        ax.set_ylabel(label)
        ax.legend()
    ax_tok.bar(labels, tokens, color=["C0", "C1", "C2"][: len(labels)])
    ax_tok.set_ylabel("total tokens per question (final eval)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


DEFAULT_OUT = "runs/learning"


def default_results(out: Path, run_root: Path, mem_drop: float | None, budget: dict, quick: bool = False) -> Path:
    """Where the summary goes: `lab/results/learning.json` for `HEADLINE` run into the default ``--out``, else
    `learning.json` next to the runs (a probe with another ``--out`` never touches the published summary).

    >>> default_results(Path(DEFAULT_OUT), Path("r"), None, BUDGET).as_posix()
    'r/learning.json'
    >>> default_results(Path(DEFAULT_OUT), Path("r"), 0.6, HEADLINE["budget"]).as_posix()
    'lab/results/learning.json'
    >>> default_results(Path("/tmp/probe"), Path("r"), 0.6, HEADLINE["budget"]).as_posix()
    'r/learning.json'
    >>> default_results(Path(DEFAULT_OUT), Path("r"), 0.6, {**HEADLINE["budget"], "max_steps": 500}).as_posix()
    'r/learning.json'
    """
    headline = mem_drop == HEADLINE["mem_drop"] and budget == HEADLINE["budget"]
    if headline and not quick and out == Path(DEFAULT_OUT):
        return Path("lab/results/learning.json")
    return run_root / "learning.json"


def build_learner(
    output_dir: str | Path, paths: LearnerPaths, settings: WarmSettings | None = None, model_seed: int = 0
) -> Path:
    """Build the learner model (`LEARNER_SIZE`, tokenizer trained on the world's corpus) and warm-start it
    (`LEARNER_WARM` by default).

    A directory whose ``warm_start.json`` records the same settings and data is returned as it is.
    """
    from mempo_trl.data import read_jsonl
    from mempo_trl.kit.tiny import build_tiny_model
    from mempo_trl.kit.warmstart import sft_warm_start
    from mempo_trl.retrieval import BM25Retriever

    settings = settings or LEARNER_WARM
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
    from mempo_trl.data import read_jsonl
    from mempo_trl.kit.warmstart import sft_warm_start
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


def shipped_warm_start(derived: dict, paths) -> Path | None:
    """The shipped learner when it is the warm start ``derived`` asks for (same SFT settings, same world files),
    else None."""
    from mempo_trl.kit.learner import shipped_learner

    record = json.loads((shipped_learner() / "warm_start.json").read_text())["derived"]
    digest = hashlib.sha256(b"".join(Path(p).read_bytes() for p in paths)).hexdigest()
    return shipped_learner() if record["warm"] == derived and record["data_sha256"] == digest else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="world, warm model and runs (resumable)")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help=f"MemPO steps per run (default {BUDGET['max_steps']})")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--eval-rows", type=int, default=100, help="held-out questions per evaluation")
    parser.add_argument(
        "--results",
        default=None,
        help="summary JSON (default: learning.json next to the runs; lab/results/learning.json for HEADLINE)",
    )
    parser.add_argument("--figure", default=None, help="figure (default next to the summary, learning.png)")
    parser.add_argument("--quick", action="store_true", help="tiny world, a few steps, 1 seed: a smoke run")
    parser.add_argument(
        "--headroom", action="store_true", help="measure the warm start's headroom (no training): headroom.json"
    )
    parser.add_argument(
        "--mem-drop",
        type=float,
        default=None,
        metavar="P",
        help=f"a more forgetful warm start: continue the shipped one {FORGETFUL['steps']} SFT steps with the oracle's "
        "<mem> dropping each fact with probability P; its runs go to <out>/mem_drop=P/",
    )
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        dest="overrides",
        help="probe: override BUDGET entries (any MemPOConfig field, JSON values), e.g. learning_rate=1e-4; runs go "
        "to <out>/probes/<overrides>/ with their own summary, from the same warm start",
    )
    args = parser.parse_args(argv)
    try:
        overrides = parse_overrides(args.overrides)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    import torch

    from mempo_trl.data import read_jsonl
    from mempo_trl.kit import learner
    from mempo_trl.outputs import OutputError, check_writable
    from mempo_trl.retrieval import BM25Retriever

    torch.set_num_threads(1)  # small tensors: one thread is fastest, and the machine is shared
    out = Path(args.out)
    budget, warm = dict(BUDGET), asdict(LEARNER_WARM)
    world, sizes = learner.LEARNER_WORLD, learner.SPLIT_SIZES
    if args.quick:
        budget.update(QUICK["budget"])
        warm.update(QUICK["warm"])
        world, sizes = QUICK["world"], QUICK["sizes"]
        args.eval_every, args.eval_rows, args.seeds = QUICK["eval_every"], sizes["test"], args.seeds[:1]
    if args.steps is not None:
        budget["max_steps"] = args.steps
    budget.update(overrides)
    tag = ",".join(f"{key}={json.dumps(value)}" for key, value in sorted(overrides.items()))
    base_root = out / f"mem_drop={args.mem_drop}" if args.mem_drop is not None else out
    run_root = base_root / "probes" / tag if overrides else base_root  # probes never touch the shipped runs
    results = Path(args.results or default_results(out, run_root, args.mem_drop, budget, args.quick))
    figure = Path(args.figure or results.with_suffix(".png"))
    derived = None
    if args.mem_drop is not None:
        if not 0.0 <= args.mem_drop <= 1.0:
            print(f"error: --mem-drop {args.mem_drop}: expected a probability in [0, 1]", file=sys.stderr)
            return 2
        steps = QUICK["warm"]["steps"] if args.quick else FORGETFUL["steps"]
        derived = {**warm, "steps": steps, "lr": FORGETFUL["lr"], "mem_drop": args.mem_drop}
    settings = _settings(args, budget, warm if derived is None else {"base": warm, "derived": derived}, world, sizes)
    try:  # every output is checked before the (long) warm start and runs
        for directory in {out, results.parent, figure.parent}:
            check_writable(directory)
    except OutputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    paths = learner.write_learner_world(out / "world", world, sizes)
    print(f"world: {paths.corpus.parent} (warm / rl / test rows in separate files)", flush=True)
    start = time.perf_counter()
    shipped = shipped_warm_start(derived, paths) if derived is not None and not args.quick else None
    if shipped is not None:
        warm_dir = shipped
    else:
        warm_dir = build_learner(out / "warm_model", paths, WarmSettings(**warm))
    if derived is not None and shipped is None:
        derived_dir = out / f"warm_model_mem_drop={args.mem_drop}"
        warm_dir = derive_learner(warm_dir, derived_dir, paths, WarmSettings(**derived))
    stats = json.loads((warm_dir / "warm_start.json").read_text())["stats"]
    print(
        f"warm start: {warm_dir} ({stats['steps']} SFT steps, final loss {stats['final_loss']:.3f}, "
        f"{time.perf_counter() - start:.0f} s)",
        flush=True,
    )
    retriever = BM25Retriever.from_corpus(str(paths.corpus), cache_dir=str(out / "bm25"))
    rows = {"test": read_jsonl(paths.test)[: args.eval_rows], "rl_path": paths.rl}

    command = "python lab/learning.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.headroom:
        return write_headroom(run_root, warm_dir, rows["test"], retriever, budget, command)
    for seed in args.seeds:
        for arm in args.arms:
            run_dir = run_root / "runs" / f"{arm}_s{seed}"
            done = run_dir / "run.json"
            if done.is_file() and json.loads(done.read_text())["settings"] == settings:
                print(f"{arm} seed {seed}: done already ({done})", flush=True)
                continue
            print(f"{arm} seed {seed}: training {budget['max_steps']} steps", flush=True)
            record = run_arm(arm, seed, run_dir, warm_dir, rows, retriever, settings, args)
            curve = record["curve"]
            print(
                f"{arm} seed {seed}: held-out EM {curve[0]['em']:.3f} -> {curve[-1]['em']:.3f} "
                f"({record['seconds'] / 60:.1f} min)",
                flush=True,
            )
            write_outputs(run_root, settings, results, figure, command)
    write_outputs(run_root, settings, results, figure, command)
    return 0


def protocol_of(budget: dict, context_mode: str = "memory"):
    """The `TurnProtocol` of a ``budget`` (its `MemPOConfig` fields) played in ``context_mode``."""
    from mempo_trl.protocol import TurnProtocol

    fields = ("max_turns", "retrieval_topk", "max_completion_length", "instruction")
    return TurnProtocol(context_mode=context_mode, **{name: budget[name] for name in fields if name in budget})


def write_headroom(run_root: Path, warm_dir: Path, rows: list[dict], retriever, budget: dict, command: str) -> int:
    """`--headroom`: `analytics.headroom` of the warm start on the held-out rows -> headroom.json."""
    from analytics import headroom, memory_signal

    from mempo_trl.kit.tiny import load_tiny

    model, tokenizer = load_tiny(warm_dir)
    start = time.perf_counter()
    protocol = protocol_of(budget)
    result = headroom(model, tokenizer, rows, retriever, protocol, budget["num_generations"], budget["temperature"])
    threshold = budget.get("memory_threshold", math.log(0.5))  # MemPOConfig's confidence filter
    result["memory_signal"] = {
        name: memory_signal(model, tokenizer, rows, retriever, value, instruction=budget["instruction"])
        for name, value in (("unfiltered", None), ("filtered", threshold))
    }
    record = {"command": command, "versions": _versions(), "seconds": time.perf_counter() - start, **result}
    run_root.mkdir(parents=True, exist_ok=True)
    (run_root / "headroom.json").write_text(json.dumps(record, indent=2))
    k = result["samples"]
    print(
        f"headroom on {result['rows']} held-out rows: greedy EM {result['greedy_em']:.3f}; sampled "
        f"(G={k}, temperature {result['temperature']}): mean EM {result['mean_at_1']:.3f}, pass@{k} "
        f"{result['pass_at_k']:.3f}, rows whose samples disagree {result['mixed_groups']:.3f}",
        flush=True,
    )
    misses = ", ".join(f"{kind} {share:.2f}" for kind, share in result["failures"].items())
    print(f"greedy episodes: {misses} -> {run_root / 'headroom.json'}", flush=True)
    for source, signal in result["memory_signal"]["unfiltered"]["by_type"].items():
        print(
            f"memory signal, {source}: P(gold) with every fact {signal['p_all']:.3f}, one dropped "
            f"{signal['p_drop']:.3f}, none {signal['p_none']:.3f}",
            flush=True,
        )
    return 0


def write_outputs(out: Path, settings: dict, results: Path, figure: Path, command: str) -> None:
    """Collect every finished run with these settings into `curves.json`, the summary and the figure."""
    records = []
    for path in sorted((out / "runs").glob("*/run.json")):
        record = json.loads(path.read_text())
        if record["settings"] == settings:
            records.append(record)
    if not records:
        return
    results.parent.mkdir(parents=True, exist_ok=True)
    curves = [{k: r[k] for k in ("arm", "seed", "seconds", "curve", "train_em")} for r in records]
    results.with_name(results.stem + "_curves.json").write_text(json.dumps(curves, indent=1))
    results.write_text(json.dumps(summarize(records, command), indent=2))
    plot(records, figure)
    print(f"wrote {results}, {figure}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
