"""A real learner's first RL steps, measured not claimed: a smoke of the real path on SmolLM2 (issue 43, item 3).

From the credit study's gated LoRA warm start (`lab/credit_study.py`, its run directory ``--study_out``), folded into
SmolLM2-135M-Instruct by `mempo-trl merge-lora`, each arm (`ARMS`) trains with `mempo-trl train --use_peft` for a few
steps at K = 2 (`SMOKE`): MemPO (the library's default memory reward) and outcome-only GRPO with dynamic sampling
(``memory_coef: 0``, ``dynamic_sampling: refill``), same seed, same rows. It trains on the warm split's K = 2 rows
(the warm start's own questions: the credit study's world has no RL split, and a new one would change its warm
start) and evaluates greedily on the first ``heldout_questions`` validation rows of K = 2 before and after (EM,
format-valid, memory recall: the share of needed facts the last ``<mem>`` keeps). Per arm and step it keeps the
outcome reward, searches, the memory reward and advantage, the refill rounds and the step's seconds.

It is a smoke: a few steps at a small learning rate show the path runs end to end and what a step costs here, not
that anything is learned. It refuses a warm start whose gate is missing, of other settings than this run's study, or
failed (one ``error:`` line each). Each arm saves a checkpoint every step and resumes from its newest one (a resumed
arm's "before" evaluation is at the resumed step); a finished arm is skipped. The published command (no
``--quick``, default ``--out`` and ``--study_out``) writes ``lab/results/rl_smoke.json``; any other writes
``<out>/rl_smoke.json``. Each arm's training output goes to ``<out>/<arm>/train.log``.

    python lab/rl_smoke.py                                   # after `python lab/credit_study.py` passed its gate
    python lab/rl_smoke.py --quick --study_out DIR --out DIR2   # the CI smoke, after `credit_study.py --quick --out DIR`
"""

import argparse
import json
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import credit_study
from learning import _machine


SMOKE = {
    "k": 2,
    "max_steps": 3,
    "episodes": 16,
    "micro_batch": 4,
    "num_generations": 4,
    "learning_rate": 5e-5,
    "lora_r": 16,
    "lora_alpha": 32,
    "temperature": 1.0,
    "heldout_questions": 8,
    "seed": 0,
}
"""The published smoke: K, steps per arm, episodes per optimizer step, the episodes of one forward and backward
(``per_device_train_batch_size``; ``gradient_accumulation_steps`` = episodes / micro_batch: all 16 episodes' rounds
in one forward took over 22 GB of RSS with SmolLM2's 49,152-token vocabulary and were OOM-killed), G, the LoRA learning
rate and rank, the sampling temperature, held-out validation questions and the seed."""

QUICK = {"max_steps": 1, "episodes": 4, "micro_batch": 2, "num_generations": 2, "heldout_questions": 1}
"""``--quick``: one step of 4 episodes (two micro-batches of 2) per arm, one held-out question."""

ARMS = {"mempo": [], "outcome_only_dynamic": ["--memory_coef", "0", "--dynamic_sampling", "refill"]}
"""Each arm's `mempo-trl train` arguments on top of the shared ones: MemPO at the library's defaults, and outcome-only
GRPO with DAPO's refill."""

STEP_METRICS = {
    "reward": "reward",
    "searches": "episode/searches",
    "format_valid": "episode/format_valid",
    "memory_reward": "memory/reward",
    "memory_advantage": "memory/advantage",
    "memory_tokens": "tokens/mem_length",
    "refill_rounds": "dynamic_sampling/refill_rounds",
    "seconds": "step_time",
}
"""What the summary keeps of each logged step: its name there and the trainer's log key."""


def checked_gate(study_out: Path, study: dict) -> dict:
    """The credit study's gate of ``study``'s warm start in ``study_out``; `ValueError` (the message of the one
    ``error:`` line) when it is missing, of another warm start, or failed."""
    path, digest = study_out / "gate.json", credit_study.warm_digest(study)
    rerun = (
        f"run `python lab/credit_study.py{' --quick' if study is not credit_study.STUDY else ''} --out {study_out}`"
    )
    if not path.is_file():
        raise ValueError(f"{path} is missing: no gated warm start in {study_out}; {rerun} first")
    gate = json.loads(path.read_text())
    if gate.get("warm_digest") != digest:
        raise ValueError(
            f"{path} gates warm start {gate.get('warm_digest')}, not this study's {digest}: {rerun} to train and "
            "gate it"
        )
    if not credit_study.gate_passed(gate["by_k"], study["gate"]):
        raise ValueError(f"the warm start of {study_out} failed its gate ({path}): the smoke needs one that passed")
    return gate


def rows_dir(out: Path, study_out: Path, study: dict, smoke: dict) -> Path:
    """``out/data/{train,validation}.jsonl``: the warm and validation rows of K = ``smoke["k"]``."""
    from mempo_trl.data import read_jsonl
    from mempo_trl.kit.demo_world import write_jsonl

    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    for split, source in (("train", "warm"), ("validation", "validation")):
        rows = read_jsonl(study_out / "world" / f"{source}.jsonl")
        write_jsonl(data / f"{split}.jsonl", [r for r in rows if r["data_source"] == f"horizon_{smoke['k']}"])
    return data


def train_command(model: Path, data: Path, corpus: Path, arm_dir: Path, study: dict, smoke: dict, device: str):
    """The `mempo-trl train` command line of an arm (its own arguments appended by the caller)."""
    protocol = study["protocol"]
    options = {
        "model_name_or_path": model,
        "dataset_name": data,
        "dataset_train_split": "train",
        "dataset_test_split": "validation",
        "corpus": corpus,
        "output_dir": arm_dir / "model",
        **{key: protocol[key] for key in ("instruction", "max_turns", "retrieval_topk", "max_completion_length")},
        "lora_r": smoke["lora_r"],
        "lora_alpha": smoke["lora_alpha"],
        "lora_target_modules": "all-linear",
        "learning_rate": smoke["learning_rate"],
        "max_steps": smoke["max_steps"],
        "per_device_train_batch_size": smoke["micro_batch"],
        "gradient_accumulation_steps": smoke["episodes"] // smoke["micro_batch"],
        "num_generations": smoke["num_generations"],
        "temperature": smoke["temperature"],
        "beta": 0,
        "loss_type": "dapo",
        "seed": smoke["seed"],
        "heldout_questions": smoke["heldout_questions"],
        "heldout_row_metric": "mempo_trl.kit.learner.memory_recall_metric",
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": 1,
        "save_total_limit": 1,
        **credit_study.run_options(device),
        # a forward of 4 episodes' rounds without it reached 18.7 GB RSS (eager attention keeps every layer's scores)
        "activation_checkpointing": "true",
    }
    return credit_study.mempo_command("train", options, "--use_peft")


def step_rows(log_history: list[dict]) -> list[dict]:
    """The `STEP_METRICS` of each logged training step (entries with a ``step_time``), in step order.

    >>> step_rows([{"step": 1, "reward": 0.5, "step_time": 9.0, "memory/reward": -0.1}, {"train_runtime": 20.0}])
    [{'step': 1, 'reward': 0.5, 'searches': None, 'format_valid': None, 'memory_reward': -0.1, 'memory_advantage': None, 'memory_tokens': None, 'refill_rounds': None, 'seconds': 9.0}]
    """
    steps = [entry for entry in log_history if "step_time" in entry]
    return [{"step": e["step"], **{name: e.get(key) for name, key in STEP_METRICS.items()}} for e in steps]


def run_arm(arm: str, command: list[str], arm_dir: Path, log) -> dict:
    """One arm's training (resumed from its newest checkpoint; skipped when ``arm.json`` says it finished with the
    same command), then its steps and held-out evaluation from the saved run."""
    from mempo_trl.checkpoints import newest_complete_checkpoint

    done = arm_dir / "arm.json"
    if done.is_file() and json.loads(done.read_text())["command"] == command:
        log(f"{arm}: done already ({done})")
        return json.loads(done.read_text())
    model_dir = arm_dir / "model"
    resume = newest_complete_checkpoint(model_dir) if model_dir.is_dir() else None
    full = command + (["--resume_from_checkpoint", str(resume)] if resume else [])
    arm_dir.mkdir(parents=True, exist_ok=True)
    log_path = arm_dir / "train.log"
    log(f"{arm}: training{f' from {resume}' if resume else ''}; its steps go to {log_path}")
    start = time.perf_counter()
    with log_path.open("a") as sink:
        code = subprocess.run(
            full, stdout=sink, stderr=subprocess.STDOUT, env=credit_study.child_process_env()
        ).returncode
    if code != 0:
        raise SystemExit(f"error: {arm}: mempo-trl train failed with exit code {code}; see {log_path}")
    state = json.loads((newest_complete_checkpoint(model_dir) / "trainer_state.json").read_text())
    metrics = json.loads((model_dir / "mempo_metrics.json").read_text())
    record = {
        "arm": arm,
        "command": command,
        "steps": step_rows(state["log_history"]),
        "heldout": {k.removeprefix("heldout/"): v for k, v in metrics.items() if k.startswith("heldout/")},
        "seconds": time.perf_counter() - start,
        "resumed_from": str(resume) if resume else None,
    }
    done.write_text(json.dumps(record, indent=1))
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/rl_smoke", help="run directory (resumable; not in git)")
    parser.add_argument("--study_out", default="runs/credit_study", help="the credit study's run directory")
    parser.add_argument("--quick", action="store_true", help="one step of 4 episodes per arm (`QUICK`)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    args = parser.parse_args(argv)
    study = credit_study.merged(credit_study.STUDY, credit_study.QUICK) if args.quick else credit_study.STUDY
    smoke = {**SMOKE, **QUICK} if args.quick else SMOKE
    out, study_out = Path(args.out), Path(args.study_out)
    published = not args.quick and args.out == "runs/rl_smoke" and args.study_out == "runs/credit_study"
    published = published and args.arms == list(ARMS)
    target = credit_study.RESULTS if published else out
    from mempo_trl.outputs import OutputError, check_writable

    try:
        gate = checked_gate(study_out, study)
        for directory in {out, target}:
            check_writable(directory)
    except (ValueError, OutputError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    command = shlex.join(["python", "lab/rl_smoke.py", *(argv if argv is not None else sys.argv[1:])])

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    digest = credit_study.warm_digest(study)
    try:
        merged_dir = credit_study.merged_warm_start(study, study_out, out, log)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    data = rows_dir(out, study_out, study, smoke)
    corpus = study_out / "world" / "corpus.jsonl"
    arms = {}
    for arm in args.arms:
        base = train_command(merged_dir, data, corpus, out / arm, study, smoke, args.device)
        arms[arm] = run_arm(arm, base + ARMS[arm], out / arm, log)
        last, heldout = arms[arm]["steps"][-1] if arms[arm]["steps"] else {}, arms[arm]["heldout"]
        log(
            f"{arm}: reward per step {[s['reward'] for s in arms[arm]['steps']]}, last step {last.get('seconds')} s; "
            f"held-out EM {heldout.get('em_before')} -> {heldout.get('em_after')}, memory recall "
            f"{heldout.get('memory_recall_before')} -> {heldout.get('memory_recall_after')}"
        )
    import torch

    summary = {
        "command": command,
        "smoke": smoke,
        "arms": arms,
        "warm_start": {"digest": digest, "gate": gate},
        "machine": {
            **_machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
    }
    target.mkdir(parents=True, exist_ok=True)
    (target / "rl_smoke.json").write_text(json.dumps(summary, indent=1) + "\n")
    log(f"wrote {target / 'rl_smoke.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
