"""Does the memory credit train a better agent? MemPO against outcome-only GRPO on SmolLM2 at K = 4 (issue 56).

From the credit study's gated LoRA warm start made on a world with an RL split of its own (`lab/credit_study.py
--rl_rows 120 --gate_only`, its run directory ``--study_out``), folded in by `mempo-trl merge-lora`, each arm
(`ARMS`: outcome-only GRPO, MemPO with the paper's default memory reward, MemPO with the reward variant
``--variant`` of `credit_study.VARIANTS`) trains with `mempo-trl train --use_peft` on the RL split's K = 4 rows, every
seed, the same budget (`COMPARE`: steps, episodes per step, G, learning rate). Then the warm start and every trained
run play the first ``eval_questions`` validation questions of K = 4 greedily (`evaluate_run`): all-parts EM, share
EM, memory recall of the facts found (`found_recall`), searches, tokens and format-valid. `verdict` applies the
pre-registered rule (`RULE`, lab/preregistration_credit.md) to each MemPO arm against outcome-only, seed by seed.

Every run saves a checkpoint every ``save_steps`` steps and resumes from its newest; a finished run (``arm.json``)
and a finished evaluation (``eval.json``) are skipped; ``--jobs`` runs train side by side (one GPU holds several
135 M runs). The published command (no ``--quick``, default ``--out``) writes ``lab/results/rl_compare.json``; any
other writes ``<out>/rl_compare.json``.

    python lab/credit_study.py --rl_rows 120 --gate_only --out runs/credit_rl --device cuda
    python lab/rl_compare.py --study_out runs/credit_rl --device cuda --jobs 6
    python lab/rl_compare.py --quick --study_out DIR --out DIR2   # after `credit_study.py --quick --rl_rows 2 ...`
"""

import argparse
import json
import platform
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import credit_study
import rl_smoke
from learning import _machine


COMPARE = {
    "k": 4,
    "rl_rows": 120,
    "max_steps": 25,
    "episodes": 32,
    "micro_batch": 8,
    "num_generations": 8,
    "learning_rate": 1e-4,
    "lora_r": 16,
    "lora_alpha": 32,
    "temperature": 1.0,
    "heldout_questions": 0,
    "eval_questions": 100,
    "save_steps": 5,
    "seeds": [0, 1],
    "variant": "diff",
}
"""The comparison: K, RL rows per K in the world (the study's ``--rl_rows``), steps, episodes per step, the episodes
of one forward, G, the LoRA learning rate and rank, the temperature, the trainer's own held-out questions (0: the
evaluation is `evaluate_run`'s), validation questions evaluated, the checkpoint interval, the seeds and the reward
variant of the second MemPO arm (``--variant``; ``diff``: centred, unfiltered, the pre-registered choice)."""

QUICK = {
    "rl_rows": 2,
    "max_steps": 1,
    "episodes": 4,
    "micro_batch": 2,
    "num_generations": 2,
    "eval_questions": 1,
    "save_steps": 1,
    "seeds": [0],
}
"""``--quick``: one step of 4 episodes per arm and seed, one seed, one evaluated question."""

ARMS = {"outcome_only": {"memory_coef": 0}, "mempo_default": {}, "mempo_variant": None}
"""Each arm's `mempo-trl train` settings on top of the shared ones (written to its ``--config``): outcome-only GRPO
(``memory_coef: 0``), MemPO at the library's defaults (the paper's reward, p > 0.5 filter), and MemPO with
``--variant``'s `MemoryRewardSettings` fields (None: filled in by `arm_settings`)."""

RULE = {
    "baseline": "outcome_only",
    "em_margin": 0.10,
    "recall_margin": 0.15,
    "null_band": 0.05,
    "warm_min_format_valid": 0.8,
    "warm_min_searched_k": 0.8,
}
"""The pre-registered success rule (lab/preregistration_credit.md): a MemPO arm *wins* when it is ahead of the
baseline by at least ``em_margin`` all-parts EM and ``recall_margin`` found-fact recall in every seed; the result is
*null* when its all-parts EM gap is within +/- ``null_band`` in every seed; otherwise *inconclusive*. The comparison
counts only when the warm start plays the evaluated questions format-valid and K searches at least this often."""

EPS = 1e-9
"""The slack of `verdict`'s comparisons: a gap equal to a margin meets it, whatever the float rounding of the
difference (0.3 - 0.2 < 0.1 in floats)."""


def arm_settings(arm: str, variant: str) -> dict:
    """The `mempo-trl train` settings of ``arm`` (`ARMS`): ``mempo_variant`` takes ``variant``'s fields.

    >>> arm_settings("outcome_only", "diff"), arm_settings("mempo_variant", "diff")
    ({'memory_coef': 0}, {'memory_reward_type': 'diff', 'memory_threshold': None})
    """
    if ARMS[arm] is not None:
        return dict(ARMS[arm])
    fields = dict(credit_study.VARIANTS[variant])
    if "memory_threshold_quantile" in fields:
        raise ValueError(f"variant {variant!r} sets its quantile per group in the study; pick another for RL")
    return fields


def found_recall(record: dict, row: dict, retriever) -> float | None:
    """The share of the needed facts found by the episode (shown in one of its information blocks) that its last
    ``<mem>`` keeps; None when it found none."""
    from mempo_trl.kit.learner import memory_recall, needed_facts
    from mempo_trl.rewards import normalize_answer

    shown = " ".join(normalize_answer(r["information"] or "") for r in record["rounds"])
    found = [f for f in needed_facts(row, retriever) if f" {normalize_answer(f)} " in f" {shown} "]
    if not found:
        return None
    mems = [r["mem"] for r in record["rounds"] if r["mem"] is not None]
    return memory_recall(mems[-1] if mems else None, found)


def run_metrics(records: list[dict], recalls: list[float | None], k: int) -> dict:
    """The evaluation's figures over its episodes: all-parts EM, share EM, found-fact recall (over the episodes that
    found a fact), searches, tokens per question, format-valid and the share that searched K times.

    >>> recs = [{"em_all_parts": 1.0, "em": 1.0, "num_searches": 2, "total_tokens": 100, "format_valid": True},
    ...         {"em_all_parts": 0.0, "em": 0.5, "num_searches": 1, "total_tokens": 60, "format_valid": False}]
    >>> run_metrics(recs, [1.0, None], 2)
    {'questions': 2, 'all_parts_em': 0.5, 'share_em': 0.75, 'found_recall': 1.0, 'searches': 1.5, 'tokens': 80.0, 'format_valid': 0.5, 'searched_k': 0.5}
    """
    n = len(records)
    kept = [r for r in recalls if r is not None]
    return {
        "questions": n,
        "all_parts_em": sum(r["em_all_parts"] or 0.0 for r in records) / n,
        "share_em": sum(r["em"] or 0.0 for r in records) / n,
        "found_recall": sum(kept) / len(kept) if kept else None,
        "searches": sum(r["num_searches"] for r in records) / n,
        "tokens": sum(r["total_tokens"] for r in records) / n,
        "format_valid": sum(bool(r["format_valid"]) for r in records) / n,
        "searched_k": sum(r["num_searches"] >= k for r in records) / n,
    }


def verdict(evals: dict[str, dict], seeds: list[int], rule: dict = RULE) -> dict:
    """`RULE` applied to each MemPO arm of ``evals`` (``"warm"`` and ``"<arm>_s<seed>"`` to `run_metrics`): per seed
    its all-parts EM and found-recall gaps to the baseline, and ``win``, ``null`` or ``inconclusive`` (``unfit``
    when the warm start plays too few format-valid or K-search episodes; ``missing`` when a run has no evaluation).

    >>> m = lambda em, rec: {"all_parts_em": em, "found_recall": rec}
    >>> warm = {"format_valid": 1.0, "searched_k": 0.9}
    >>> ev = {"warm": warm, "outcome_only_s0": m(0.1, 0.5), "outcome_only_s1": m(0.2, 0.6),
    ...       "mempo_default_s0": m(0.12, 0.5), "mempo_default_s1": m(0.18, 0.6),
    ...       "mempo_variant_s0": m(0.25, 0.7), "mempo_variant_s1": m(0.3, 0.8)}
    >>> v = verdict(ev, [0, 1])
    >>> v["mempo_default"]["outcome"], v["mempo_variant"]["outcome"]
    ('null', 'win')
    """
    warm = evals.get("warm") or {}
    fit = (warm.get("format_valid") or 0) >= rule["warm_min_format_valid"] and (warm.get("searched_k") or 0) >= rule[
        "warm_min_searched_k"
    ]
    out = {}
    for arm in (a for a in ARMS if a != rule["baseline"]):
        gaps = []
        for seed in seeds:
            ours, base = evals.get(f"{arm}_s{seed}"), evals.get(f"{rule['baseline']}_s{seed}")
            if ours is None or base is None:
                gaps.append(None)
                continue
            recall = None
            if ours["found_recall"] is not None and base["found_recall"] is not None:
                recall = ours["found_recall"] - base["found_recall"]
            gaps.append({"seed": seed, "all_parts_em": ours["all_parts_em"] - base["all_parts_em"], "recall": recall})
        if not fit:
            outcome = "unfit"
        elif any(g is None for g in gaps):
            outcome = "missing"
        elif all(
            g["all_parts_em"] >= rule["em_margin"] - EPS
            and g["recall"] is not None
            and g["recall"] >= rule["recall_margin"] - EPS
            for g in gaps
        ):
            outcome = "win"
        elif all(abs(g["all_parts_em"]) <= rule["null_band"] + EPS for g in gaps):
            outcome = "null"
        else:
            outcome = "inconclusive"
        out[arm] = {"gaps": gaps, "outcome": outcome}
    return out


def evaluate_run(base: Path, adapter: Path | None, rows: list[dict], retriever, study: dict, device: str, k: int):
    """Greedy episodes of ``rows`` by the merged warm start (``base``) with ``adapter`` (None: the warm start
    itself) in memory mode: `run_metrics`."""
    import torch

    from mempo_trl.agent import MemPOAgent
    from mempo_trl.evaluation import evaluate
    from mempo_trl.generation import HFGenerator
    from mempo_trl.loading import load_tokenizer

    if adapter is None:
        from transformers import AutoModelForCausalLM

        model, tokenizer = AutoModelForCausalLM.from_pretrained(str(base)).eval().to(device), load_tokenizer(base)
    else:
        model, tokenizer = credit_study.load_warm(base, adapter, device)
    protocol = credit_study.protocol_of(study)
    generator = HFGenerator(model, tokenizer, protocol.max_completion_length, temperature=0.0, batch_size=32)
    with torch.no_grad():
        records = evaluate(MemPOAgent(tokenizer, retriever, generator, protocol), rows, progress=False).records
    recalls = [found_recall(r, row, retriever) for r, row in zip(records, rows)]
    return run_metrics(records, recalls, k)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one step of 4 episodes, one seed (`QUICK`)")
    parser.add_argument("--world_seed", type=int, help="the credit study's --world_seed, when it had one")
    parser.add_argument("--study_out", default="runs/credit_rl", help="the gated warm start's run directory")
    parser.add_argument("--out", default="runs/rl_compare", help="run directory (resumable; not in git)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--jobs", type=int, default=1, help="runs trained side by side")
    parser.add_argument(
        "--variant",
        default=COMPARE["variant"],
        choices=list(credit_study.VARIANTS),
        help="the reward variant of the mempo_variant arm",
    )
    args = parser.parse_args(argv)
    compare = {**COMPARE, **QUICK, "variant": args.variant} if args.quick else {**COMPARE, "variant": args.variant}
    study = credit_study.study_of(args.quick, args.world_seed, None, compare["rl_rows"])
    out, study_out = Path(args.out), Path(args.study_out)
    published = not args.quick and args.world_seed is None and args.out == "runs/rl_compare"
    published = published and args.variant == COMPARE["variant"]
    target = credit_study.RESULTS if published else out
    from mempo_trl.outputs import OutputError, check_writable

    try:
        gate = rl_smoke.checked_gate(study_out, study)
        settings = {arm: arm_settings(arm, args.variant) for arm in ARMS}
        for directory in {out, target}:
            check_writable(directory)
    except (ValueError, OutputError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    command = shlex.join(["python", "lab/rl_compare.py", *(argv if argv is not None else sys.argv[1:])])

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    from mempo_trl.data import read_jsonl
    from mempo_trl.kit.demo_world import write_jsonl
    from mempo_trl.retrieval import BM25Retriever

    start = time.perf_counter()
    digest = credit_study.warm_digest(study)
    try:
        merged_dir = credit_study.merged_warm_start(study, study_out, out, log)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    k, world = compare["k"], study_out / "world"
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    for split, source in (("train", "rl"), ("validation", "validation")):
        rows = [r for r in read_jsonl(world / f"{source}.jsonl") if r["data_source"] == f"horizon_{k}"]
        write_jsonl(data / f"{split}.jsonl", rows)
    runs = {}
    for arm in ARMS:
        config = out / f"{arm}.yaml"
        config.write_text(json.dumps(settings[arm]) + "\n")  # JSON is YAML
        for seed in compare["seeds"]:
            smoke = {**compare, "seed": seed}
            base = rl_smoke.train_command(
                merged_dir, data, world / "corpus.jsonl", out / f"{arm}_s{seed}", study, smoke, args.device
            )
            runs[f"{arm}_s{seed}"] = base + ["--save_steps", str(compare["save_steps"]), "--config", str(config)]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {name: pool.submit(rl_smoke.run_arm, name, cmd, out / name, log) for name, cmd in runs.items()}
        trained = {name: future.result() for name, future in futures.items()}
    retriever = BM25Retriever.from_corpus(str(world / "corpus.jsonl"), cache_dir=str(study_out / "bm25"))
    eval_rows = read_jsonl(data / "validation.jsonl")[: compare["eval_questions"]]
    evals = {}
    for name in ["warm", *runs]:
        path = out / name / "eval.json"
        if path.is_file():
            evals[name] = json.loads(path.read_text())
            continue
        adapter = None if name == "warm" else out / name / "model"
        evals[name] = evaluate_run(merged_dir, adapter, eval_rows, retriever, study, args.device, k)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(evals[name], indent=1))
        log(f"{name}: {evals[name]}")
    import torch

    summary = {
        "command": command,
        "compare": compare,
        "arms": settings,
        "rule": RULE,
        "verdict": verdict(evals, compare["seeds"]),
        "evaluation": evals,
        "training": {name: {"steps": t["steps"], "seconds": t["seconds"]} for name, t in trained.items()},
        "warm_start": {"digest": digest, "gate": gate},
        "seconds": time.perf_counter() - start,
        "machine": {**_machine(), "python": platform.python_version(), "torch": torch.__version__},
    }
    target.mkdir(parents=True, exist_ok=True)
    (target / "rl_compare.json").write_text(json.dumps(summary, indent=1) + "\n")
    log(
        f"verdict: { {arm: v['outcome'] for arm, v in summary['verdict'].items()} }; wrote {target / 'rl_compare.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
