"""MemPO on real text: a SmolLM2-135M student on HotpotQA, memory against full history (issue 55, item 4).

From real HotpotQA rows (default: ``../shared/data/hotpotqa_distractor``, 300 train + 300 dev questions in the Hub's
schema), every step is a library command a user runs:

1. ``mempo-trl hotpotqa``: QA rows with their hops and one corpus of the pooled Wikipedia paragraphs;
2. ``mempo-trl compose``: K = 2 rows of the train questions;
3. ``mempo-trl distill --teacher oracle``: warm-start episodes from the supporting facts (search, keep the fact
   found in ``<mem>``, search the bridge, answer), on the first ``sft_questions`` K = 1 and ``sft_k2_rows`` K = 2 rows;
4. ``mempo-trl sft --use_peft`` (LoRA) on them, then ``mempo-trl merge-lora``;
5. ``mempo-trl eval --objectives 1 2 --context_mode both`` on the dev questions, before SFT (the base model told the
   protocol) and after it: EM, F1, format-valid, searches, total and peak context tokens per K and mode;
6. the kit-free baselines (`baselines.py`) on the base model: no retrieval, one search then answer;
7. a MemPO smoke: ``mempo-trl train --use_peft`` for ``rl_steps`` steps from the SFT model, then its evaluation.

Each stage writes into ``--out`` (default ``runs/hotpotqa_student``, not in git) and is skipped when its output is
there, so a stopped run goes on where it stopped (a run directory holds one run's settings: another is refused).
The summary goes to ``lab/results/``: ``hotpotqa_student.json`` and ``.png`` for `STUDENT`, and
``hotpotqa_student_small`` when ``--sft_questions``, ``--sft_k2_rows`` or ``--eval_questions`` make a smaller run;
it holds the settings, each stage's command and seconds, every table and the machine. ``--quick`` (the test's size:
2 questions per stage, 1 SFT step) writes it to ``--out``.

    python lab/hotpotqa_student.py --model kit/smollm2                 # published; resumable
    python lab/hotpotqa_student.py --model kit/smollm2 --out runs/hs_small --sft_questions 16 --sft_k2_rows 8 \\
        --eval_questions 10 --skip rl                                 # a smaller run: hotpotqa_student_small
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from learning import _machine, _versions


STUDENT = {
    "sft_questions": 48,
    "sft_k2_rows": 16,
    "eval_questions": 300,
    "objectives": [1, 2],
    "protocol": {"max_turns": 6, "retrieval_topk": 2, "max_completion_length": 256},
    "sft": {
        "learning_rate": 1e-3,
        "num_train_epochs": 1,
        "per_device_train_batch_size": 4,
        "lora_r": 16,
        "max_length": 2048,
    },
    "rl": {"max_steps": 2, "num_generations": 4, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
    "baselines_topk": 3,
    "eval_batch_size": 16,
}
"""The published run: oracle episodes the student learns from (K = 1 questions, K = 2 rows), dev questions per K,
the Ks, the turn protocol (up to 6 turns: K = 2 needs 4 searches and an answer; top-2 passages, not Search-R1's 3,
to keep the CPU's contexts short; the oracle's ``<mem>`` holds the supporting sentences found: up to ~230 tokens at
K = 2), the LoRA SFT (one epoch; contexts reach ~1,200 tokens), the MemPO smoke and the baselines."""

QUICK = {
    "sft_questions": 2,
    "sft_k2_rows": 1,
    "eval_questions": 2,
    "sft": {"learning_rate": 5e-4, "max_steps": 1, "per_device_train_batch_size": 2, "lora_r": 4, "max_length": 2048},
    "rl": {"max_steps": 1, "num_generations": 2, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1},
    "eval_batch_size": 2,
    "protocol": {"max_turns": 6, "retrieval_topk": 2, "max_completion_length": 32},
}
"""``--quick``: the test's size (turns of 32 tokens: an untrained model writes to the limit)."""

RESULTS = Path("lab/results")
DATA = Path("../shared/data/hotpotqa_distractor")


def mempo(subcommand: str, options: dict, *flags: str) -> list[str]:
    """The command line of ``mempo-trl SUBCOMMAND`` with this interpreter: each option ``--key value`` (a list
    value gives several words), then ``flags``.

    >>> mempo("eval", {"objectives": [1, 2], "output_dir": Path("o")})[3:]
    ['eval', '--objectives', '1', '2', '--output_dir', 'o']
    """
    words = []
    for key, value in options.items():
        words += [f"--{key}", *(map(str, value) if isinstance(value, list) else [str(value)])]
    return [sys.executable, "-m", "mempo_trl", subcommand, *words, *flags]


class Stages:
    """Runs each stage's command once: skipped when its ``done`` path exists; output in ``out/logs/NAME.log``; the
    command and seconds kept for the summary."""

    def __init__(self, out: Path):
        self.out, self.record = out, {}
        (out / "logs").mkdir(parents=True, exist_ok=True)
        record = out / "stages.json"
        self.record = json.loads(record.read_text()) if record.is_file() else {}

    def run(self, name: str, done: Path, command: list[str]) -> None:
        if done.exists():
            print(f"[{name}] done ({done})", flush=True)
            return
        print(f"[{time.strftime('%H:%M:%S')}] [{name}] {shlex.join(command)}", flush=True)
        start = time.monotonic()
        with open(self.out / "logs" / f"{name}.log", "w") as log:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            finished = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        if finished.returncode != 0 or not done.exists():
            tail = (self.out / "logs" / f"{name}.log").read_text()[-1500:]
            raise RuntimeError(f"stage {name} failed (rc {finished.returncode}); the end of its log:\n{tail}")
        self.record[name] = {"command": shlex.join(command), "seconds": round(time.monotonic() - start, 1)}
        (self.out / "stages.json").write_text(json.dumps(self.record, indent=1) + "\n")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def eval_options(settings: dict, model: Path, data: Path, output_dir: Path) -> dict:
    """The `mempo-trl eval` options of one evaluation: the dev questions, every K, both context modes, greedy."""
    return {
        "model_name_or_path": model,
        "dataset_name": data / "dev.jsonl",
        "corpus": data / "corpus.jsonl",
        "objectives": settings["objectives"],
        "context_mode": "both",
        "max_eval_samples": settings["eval_questions"],
        "per_device_eval_batch_size": settings["eval_batch_size"],
        "device": "cpu",
        "dtype": "float32",
        "disable_tqdm": "true",
        "output_dir": output_dir,
        **settings["protocol"],
    }


def sweep_table(eval_dir: Path) -> list[dict]:
    """The rows of an evaluation's ``objectives.json`` (one per K and context mode)."""
    return json.loads((eval_dir / "objectives.json").read_text())["table"]


def run_baselines(settings: dict, model: Path, data: Path, out: Path) -> dict:
    """Both baselines of `baselines.py` on ``model`` (the first ``eval_questions`` dev questions), cached in ``out``."""
    import torch
    from baselines import run_baseline
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mempo_trl.data import load_qa
    from mempo_trl.retrieval.bm25 import BM25Retriever

    path = out / f"baselines_{settings['eval_questions']}q.json"
    if path.is_file():
        return json.loads(path.read_text())
    rows = list(load_qa(data / "dev.jsonl"))[: settings["eval_questions"]]
    tokenizer = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    retriever = BM25Retriever.from_corpus(data / "corpus.jsonl")
    results = {}
    for name, searcher in (("no_retrieval", None), ("one_search", retriever)):
        start = time.monotonic()
        result = run_baseline(lm, tokenizer, rows, searcher, settings["baselines_topk"], settings["eval_batch_size"])
        results[name] = {**result["metrics"], "seconds": round(time.monotonic() - start, 1)}
        write_jsonl(out / f"baseline_{name}_{len(rows)}q.jsonl", result["records"])
        print(f"[baseline {name}] {results[name]}", flush=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    return results


def plot(summary: dict, path: Path) -> None:
    """EM and total tokens per question against K, memory and full history, before and after SFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_em, ax_tok) = plt.subplots(1, 2, figsize=(9, 3.6))
    for stage, style in (("before_sft", ":"), ("after_sft", "-"), ("after_rl", "--")):
        for mode, color in (("memory", "C0"), ("full_history", "C1")):
            rows = [r for r in summary["evaluations"].get(stage, []) if r["context_mode"] == mode]
            if not rows:
                continue
            ks = [r["objectives"] for r in rows]
            label = f"{mode}, {stage.replace('_', ' ')}"
            ax_em.plot(ks, [r["f1"] for r in rows], style, color=color, marker="o", label=label)
            ax_tok.plot(ks, [r["total_tokens_per_question"] for r in rows], style, color=color, marker="o")
    ax_em.set(xlabel="questions per prompt (K)", ylabel="F1 on dev", title="answer F1")
    ax_tok.set(xlabel="questions per prompt (K)", ylabel="tokens per question", title="total tokens")
    ax_em.legend(fontsize=7)
    fig.suptitle(f"SmolLM2-135M on HotpotQA dev ({summary['settings']['eval_questions']} questions per K)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", required=True, help="SmolLM2-135M-Instruct: the folder `mempo-trl kit smollm2` wrote"
    )
    parser.add_argument("--data", default=str(DATA), help="HotpotQA rows: a folder of train.jsonl and dev.jsonl")
    parser.add_argument("--out", default="runs/hotpotqa_student", help="run directory (resumable; not in git)")
    parser.add_argument("--quick", action="store_true", help="the test's size (`QUICK`)")
    for key in ("sft_questions", "sft_k2_rows", "eval_questions"):
        parser.add_argument(f"--{key}", type=int, help=f"override the settings' {key} (a smaller run)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["baselines", "rl"], help="stages to leave out")
    args = parser.parse_args(argv)
    settings = {**STUDENT, **(QUICK if args.quick else {})}
    overrides = {key: getattr(args, key) for key in ("sft_questions", "sft_k2_rows", "eval_questions")}
    settings.update({key: value for key, value in overrides.items() if value is not None})
    out, model, source = Path(args.out), Path(args.model), Path(args.data)
    for path, what in ((model / "config.json", "--model"), (source, "--data")):
        if not path.exists():
            print(f"error: {path} not found: give {what} (see --help)", file=sys.stderr)
            return 2
    smaller = any(value is not None for value in overrides.values())
    target = out if args.quick else RESULTS
    name = "hotpotqa_student_small" if smaller else "hotpotqa_student"
    saved = out / "settings.json"
    if saved.is_file() and json.loads(saved.read_text()) != settings:
        print(f"error: {out} holds a run of other settings ({saved}): give another --out", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(settings, indent=1) + "\n")
    stages = Stages(out)
    data, protocol = out / "data", settings["protocol"]
    stages.run("data", data / "corpus.jsonl", mempo("hotpotqa", {"dataset_name": source, "output_dir": data}))
    composed = out / "composed"
    stages.run(
        "compose",
        composed / "k2" / "train.jsonl",
        mempo(
            "compose",
            {
                "dataset_name": data / "train.jsonl",
                "objectives": [2],
                "dataset_split": "train",
                "output_dir": composed,
            },
        ),
    )
    sft_rows = out / "sft_rows" / "train.jsonl"
    if not sft_rows.is_file():
        k1 = read_jsonl(data / "train.jsonl")[: settings["sft_questions"]]
        k2 = read_jsonl(composed / "k2" / "train.jsonl")[: settings["sft_k2_rows"]]
        write_jsonl(sft_rows, k1 + k2)
    distilled = out / "distilled"
    distill = {
        "teacher": "oracle",
        "model_name_or_path": model,
        "dataset_name": sft_rows,
        "corpus": data / "corpus.jsonl",
        "output_dir": distilled,
        **protocol,
    }
    stages.run("distill", distilled / "distill_report.json", mempo("distill", distill))
    sft = {
        "model_name_or_path": model,
        "dataset_name": distilled,
        "output_dir": out / "sft",
        "lora_target_modules": "all-linear",
        "lora_alpha": 2 * settings["sft"]["lora_r"],
        **settings["sft"],
        "use_cpu": "true",
        "bf16": "false",  # bf16 autocast on a CPU without bf16 kernels takes the slow generic matmul
        "activation_checkpointing": "false",  # a 135 M model fits; recomputing cost ~25% of each step
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": "true",
    }
    stages.run("sft", out / "sft" / "adapter_config.json", mempo("sft", sft, "--use_peft"))
    merged = out / "sft_merged"
    stages.run(
        "merge",
        merged / "model.safetensors",
        mempo("merge-lora", {"model_name_or_path": out / "sft", "output_dir": merged}),
    )
    evaluations = {}
    for stage, evaluated in (("before_sft", model), ("after_sft", merged)):
        eval_dir = out / f"eval_{stage}_{settings['eval_questions']}q"
        stages.run(
            f"eval_{stage}_{settings['eval_questions']}q",
            eval_dir / "objectives.json",
            mempo("eval", eval_options(settings, evaluated, data, eval_dir)),
        )
        evaluations[stage] = sweep_table(eval_dir)
    baselines = None if "baselines" in args.skip else run_baselines(settings, model, data, out)
    rl = None
    if "rl" not in args.skip:
        rl_dir = out / "rl"
        train = {
            "model_name_or_path": merged,
            "dataset_name": data / "train.jsonl",
            "corpus": data / "corpus.jsonl",
            "output_dir": rl_dir,
            **protocol,
            **settings["rl"],
            "lora_r": 16,
            "lora_alpha": 32,
            "lora_target_modules": "all-linear",
            "learning_rate": 5e-5,
            "beta": 0,
            "logging_steps": 1,
            "save_strategy": "no",
            "heldout_questions": 0,
            "use_cpu": "true",
            "bf16": "false",
            "report_to": "none",
            "disable_tqdm": "true",
        }
        stages.run("rl", rl_dir / "mempo_metrics.json", mempo("train", train, "--use_peft"))
        stages.run(
            "rl_merge",
            out / "rl_merged" / "model.safetensors",
            mempo("merge-lora", {"model_name_or_path": rl_dir, "output_dir": out / "rl_merged"}),
        )
        eval_dir = out / f"eval_after_rl_{settings['eval_questions']}q"
        stages.run(
            f"eval_after_rl_{settings['eval_questions']}q",
            eval_dir / "objectives.json",
            mempo("eval", eval_options(settings, out / "rl_merged", data, eval_dir)),
        )
        evaluations["after_rl"] = sweep_table(eval_dir)
        rl = json.loads((rl_dir / "mempo_metrics.json").read_text())
    summary = {
        "command": shlex.join(["python", "lab/hotpotqa_student.py", *(argv if argv is not None else sys.argv[1:])]),
        "settings": settings,
        "data": {"source": str(source), "report": json.loads((data / "hotpotqa_report.json").read_text())},
        "distill": json.loads((distilled / "distill_report.json").read_text()),
        "evaluations": evaluations,
        "baselines": baselines,
        "rl": rl,
        "stages": stages.record,
        "machine": {**_machine(), **_versions(), "threads": os.environ.get("OMP_NUM_THREADS")},
        "license": "HotpotQA (Yang et al., EMNLP 2018), CC BY-SA 4.0",
    }
    target.mkdir(parents=True, exist_ok=True)
    (target / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, target / f"{name}.png")
    print(f"wrote {target / name}.json and .png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
