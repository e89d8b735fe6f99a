"""Short MemPO training runs on the kit's tool environments (`KeyVaultEnv`, `SafeEnv`), in both context modes, on CPU.

Two steps per environment, into ``--out`` (run directories, not in git; default `runs/environments_training`):

1. warm start: the tiny model (`build_tiny_model(seed=0)`) fine-tuned on the oracle's turns
   (`mempo_trl.kit.envs.ORACLES`) of 300 seeded rows (seed 0) played through the real `RolloutEngine` (memory
   contexts, ``TurnProtocol(max_turns=8)``), one (prompt, completion) pair per round: AdamW, lr 5e-3, batch 16,
   30-step linear warm-up and linear decay, one thread (`WARM`; ``WARM_STEPS`` steps: the untrained tiny model needs
   more to play KeyVaultEnv than SafeEnv). It is evaluated greedily on 20 held-out rows (seed 1) and saved into
   ``<out>/warm_<env>`` with its settings, stats and evaluation in ``warm_start.json``; a rerun with the same
   settings reuses it;
2. training: `mempo-trl train` through the library (`mempo_trl.commands.train.parse_args` +
   `mempo_trl.commands.recipe.build_trainer`) on the environment's recipe (`examples/configs/<env>_cpu.yaml`) from
   that warm start, on its rows (`mempo-trl kit env-rows`: ``<out>/rows_<env>/train.jsonl``), for ``--steps``
   steps of 8 episodes (G = 4), once per context mode, into ``<out>/<env>_<mode>``.

The summary holds, per "<env> <mode>" run, the per-step training metrics of `KEYS` and the run's wall seconds, and
the warm starts' stats (``warm``), with the command, versions, machine and settings. With the default settings and
``--out`` it is `lab/results/environments_training.json`, else ``environments_training.json`` next to the runs.

    python lab/environments_training.py        # the committed summary: ~16 min on a 2-core CPU
    python lab/environments_training.py --warm_steps 2 --steps 1 --warm_eval_rows 2 --out /tmp/envs  # smoke
"""

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from learning import _versions


DEFAULT_OUT = "runs/environments_training"
RESULTS = "lab/results/environments_training.json"
ENVIRONMENTS = ("keyvault", "safe")
MODES = ("memory", "full_history")

WARM = {
    "model_seed": 0,
    "rows": 300,
    "rows_seed": 0,
    "max_turns": 8,
    "lr": 5e-3,
    "batch_size": 16,
    "warmup_steps": 30,
    "seed": 0,
    "eval_rows": 20,
    "eval_seed": 1,
    "eval_max_new_tokens": 96,
}
"""The warm start's settings but its steps (those of the closing-note probes of issue 25)."""

WARM_STEPS = {"keyvault": 600, "safe": 400}
"""SFT steps per environment."""

TRAIN = {"max_steps": 10, "per_device_train_batch_size": 8, "num_generations": 4}
"""What each training run overrides in its recipe."""

KEYS = (
    "tokens/prompt_per_round",
    "tokens/prompt_peak",
    "episode/turns",
    "episode/tool_calls",
    "episode/format_valid",
    "episode/em",
    "reward",
    "memory/scored_rounds",
    "memory/reward",
)
"""The per-step training metrics kept (a metric a step does not log is left out of its list)."""


def settings_of(environments, warm_steps: int | None, steps: int, warm_eval_rows: int) -> dict:
    """The settings a run records: per environment its warm start, and the training overrides."""
    warm = {env: {**WARM, "eval_rows": warm_eval_rows, "steps": warm_steps or WARM_STEPS[env]} for env in environments}
    return {"environments": list(environments), "warm": warm, "train": {**TRAIN, "max_steps": steps}}


def default_results(out: Path, settings: dict) -> Path:
    """`lab/results/environments_training.json` for the default settings run into the default ``--out``, else
    ``environments_training.json`` next to the runs (a smoke or probe run never touches the committed summary).

    >>> default = settings_of(ENVIRONMENTS, None, TRAIN["max_steps"], WARM["eval_rows"])
    >>> default_results(Path(DEFAULT_OUT), default).as_posix()
    'lab/results/environments_training.json'
    >>> default_results(Path("/tmp/envs"), default).as_posix()
    '/tmp/envs/environments_training.json'
    >>> default_results(Path(DEFAULT_OUT), settings_of(ENVIRONMENTS, None, 1, 20)).as_posix()
    'runs/environments_training/environments_training.json'
    >>> default_results(Path(DEFAULT_OUT), settings_of(["safe"], None, 10, 20)).as_posix()
    'runs/environments_training/environments_training.json'
    """
    if out == Path(DEFAULT_OUT) and settings == settings_of(ENVIRONMENTS, None, TRAIN["max_steps"], WARM["eval_rows"]):
        return Path(RESULTS)
    return out / "environments_training.json"


def warm_start(env: str, warm_dir: Path, settings: dict) -> dict:
    """The warm start of ``env`` in ``warm_dir`` (reused when its ``warm_start.json`` has ``settings``): its record,
    the settings, the SFT stats and the greedy held-out evaluation."""
    import torch

    from mempo_trl.generation import HFGenerator
    from mempo_trl.kit.envs import KIT_ENVIRONMENTS, ORACLES, OracleGenerator
    from mempo_trl.kit.tiny import build_tiny_model, load_tiny
    from mempo_trl.padding import pad_ids
    from mempo_trl.protocol import TurnProtocol
    from mempo_trl.rewards import episode_metrics
    from mempo_trl.rollout import RolloutEngine
    from mempo_trl.turns import TOOL_STOPS

    record_path = warm_dir / "warm_start.json"
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        if record["settings"] == settings:
            print(f"{env}: warm start {warm_dir} reused (same settings)", flush=True)
            return record
    torch.manual_seed(settings["seed"])
    model, tokenizer = load_tiny(build_tiny_model(warm_dir, seed=settings["model_seed"]))
    env_cls, rows = KIT_ENVIRONMENTS[env]
    protocol = TurnProtocol(max_turns=settings["max_turns"])
    engine = RolloutEngine(tokenizer, protocol, environment_factory=env_cls, eos_token_ids=[tokenizer.eos_token_id])
    oracle = OracleGenerator(tokenizer, ORACLES[env])
    episodes = engine.play(rows(settings["rows"], seed=settings["rows_seed"]), oracle).episodes
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    examples = [(r.prompt_ids, r.completion_ids + [end]) for episode in episodes for r in episode.rounds]
    steps, warmup = settings["steps"], settings["warmup_steps"]
    print(f"{env}: warm start, {len(examples)} oracle rounds, {steps} SFT steps", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings["lr"], weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * (1.0 - s / steps))
    generator = torch.Generator().manual_seed(settings["seed"])
    model.train()
    losses, start = {}, time.perf_counter()
    for step in range(steps):
        batch = [examples[i] for i in torch.randint(len(examples), (settings["batch_size"],), generator=generator)]
        ids, attention = pad_ids([p + c for p, c in batch], 0)
        labels, _ = pad_ids([[-100] * len(p) + c for p, c in batch], -100)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        keep = max(len(c) for _, c in batch) + 1  # logits of the completion tokens only
        logits = model(
            input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False, logits_to_keep=keep
        ).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1 - keep :].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % 50 == 0 or step == steps - 1:
            losses[step] = round(loss.item(), 4)
            print(f"{env}: SFT step {step} loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
    sft_seconds = time.perf_counter() - start
    model.save_pretrained(warm_dir)
    tokenizer.save_pretrained(warm_dir)

    model.eval()
    greedy = HFGenerator(model, tokenizer, max_new_tokens=settings["eval_max_new_tokens"], stops=TOOL_STOPS)
    engine = RolloutEngine(tokenizer, protocol, environment_factory=env_cls, eos_token_ids=greedy.eos_token_ids)
    episodes = engine.play(rows(settings["eval_rows"], seed=settings["eval_seed"]), greedy).episodes
    metrics = [episode_metrics(episode) for episode in episodes]
    held_out = {key: round(sum(m.get(key, 0.0) for m in metrics) / len(metrics), 4) for key in metrics[0]}
    if hasattr(env_cls, "get_reward"):
        held_out["reward"] = round(sum(e.environment.get_reward() for e in episodes) / len(episodes), 4)
    record = {
        "settings": settings,
        "sft_examples": len(examples),
        "loss": losses,
        "sft_seconds": round(sft_seconds, 1),
        "held_out_greedy": held_out,
    }
    record_path.write_text(json.dumps(record, indent=1))
    print(f"{env}: warm start held-out (greedy, {len(episodes)} rows): {held_out}", flush=True)
    return record


def train_run(env: str, mode: str, model_dir: Path, rows_path: Path, run_dir: Path, train: dict) -> dict:
    """One short `mempo-trl train` run: the per-step metrics of `KEYS` and the wall seconds."""
    from mempo_trl.commands.recipe import build_trainer
    from mempo_trl.commands.train import parse_args

    argv = [
        "--config",
        f"examples/configs/{env}_cpu.yaml",
        "--model_name_or_path",
        str(model_dir),
        "--dataset_name",
        str(rows_path),
        "--context_mode",
        mode,
        "--output_dir",
        str(run_dir),
        "--max_steps",
        str(train["max_steps"]),
        "--per_device_train_batch_size",
        str(train["per_device_train_batch_size"]),
        "--num_generations",
        str(train["num_generations"]),
        "--disable_tqdm",
        "true",
        "--overwrite_output_dir",
        "true",
    ]
    trainer = build_trainer(*parse_args(argv))
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    logs = [entry for entry in trainer.state.log_history if "tokens/prompt_per_round" in entry]
    return {key: [round(entry[key], 3) for entry in logs if key in entry] for key in KEYS} | {
        "seconds": round(seconds, 1)
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="warm starts, rows and runs")
    parser.add_argument("--environments", nargs="+", default=list(ENVIRONMENTS), choices=ENVIRONMENTS)
    parser.add_argument(
        "--warm_steps", type=int, default=None, help=f"SFT steps of every warm start (default: {WARM_STEPS})"
    )
    parser.add_argument("--steps", type=int, default=TRAIN["max_steps"], help="training steps per run")
    parser.add_argument("--warm_eval_rows", type=int, default=WARM["eval_rows"], help="held-out rows of the warm eval")
    parser.add_argument(
        "--results",
        default=None,
        help=f"summary JSON (default: {RESULTS} for the default settings "
        "and --out, else environments_training.json in --out)",
    )
    args = parser.parse_args(argv)

    import torch

    from mempo_trl.kit.cli import env_rows
    from mempo_trl.outputs import OutputError, check_writable

    torch.set_num_threads(1)  # small tensors: one thread is fastest, and the machine is shared
    out = Path(args.out)
    settings = settings_of(args.environments, args.warm_steps, args.steps, args.warm_eval_rows)
    results = Path(args.results or default_results(out, settings))
    try:
        for directory in {out, results.parent}:
            check_writable(directory)
    except OutputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    command = "python lab/environments_training.py " + " ".join(sys.argv[1:] if argv is None else argv)
    summary = {
        "command": command.strip(),
        "versions": _versions(),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
        },
        "settings": settings,
        "warm": {},
    }
    for env in args.environments:
        warm_dir = out / f"warm_{env}"
        summary["warm"][env] = warm_start(env, warm_dir, settings["warm"][env])
        rows_dir = out / f"rows_{env}"
        env_rows(["--environment", env, "--output_dir", str(rows_dir)])
        for mode in MODES:
            print(f"{env} {mode}: training {args.steps} steps", flush=True)
            run = train_run(env, mode, warm_dir, rows_dir / "train.jsonl", out / f"{env}_{mode}", settings["train"])
            summary[f"{env} {mode}"] = run
            means = {k: round(sum(v) / len(v), 3) if isinstance(v, list) and v else v for k, v in run.items()}
            print(f"{env} {mode}: {json.dumps(means)}", flush=True)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"summary: {results}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
