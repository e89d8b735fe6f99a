"""The rollout log and `mempo-trl view`: the log's size per logged step, what logging costs a training run, and the
page's size and open time at 1,000 episodes.

1. Training overhead and log size: the shipped learner (`mempo-trl kit learner`) trains ``--steps`` steps of the
   quick-start recipe (16 episodes a step, BM25) twice on the same seed, rollout log off, then on (every step, all 16
   episodes). Reported: the median ``step_time`` (TRL's, per optimizer step) of each run without its first step, their
   ratio (on / off), and in the logging run the seconds spent in the log itself (`RolloutLog.record`, building the
   records, plus `RolloutLog.on_step_end`, writing them) over the training time: the overhead without the noise of
   two runs. And the size of each step file.
2. The page at 1,000 episodes: a synthetic log of the learner run's shape (``--episodes`` episodes in steps of 100,
   each a copy of a logged episode of the run with its question, memories and passages made distinct, so that no
   passage is shared more than in a real run) is turned into a page (`mempo_trl.viewer.build_page`): its size, the
   build time, and the open time in headless Chromium: from the start of the navigation to the first page drawn (the
   page's ``data-drawn-ms``) and the wall time of the Chromium process (start-up included).

    python bench/bench_viewer.py                        # ~4 min on 2 loaded cores
    python bench/bench_viewer.py --steps 6 --episodes 1000 --json bench/results/viewer.json
"""

import argparse
import copy
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # `browser`, the tests' Chromium driver

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "configs" / "quickstart_cpu.yaml"


def train(kit: Path, out: Path, steps: int, log_steps: int) -> dict:
    """Train the learner ``steps`` steps into ``out``; its step times and, with the log on, the seconds in it."""
    from mempo_trl.commands.recipe import build_trainer
    from mempo_trl.commands.train import parse_args
    from mempo_trl.rollout_log import RolloutLog

    argv = ["--config", str(QUICKSTART), "--model_name_or_path", str(kit / "model"), "--output_dir", str(out)]
    argv += ["--dataset_name", str(kit / "world"), "--corpus", str(kit / "world" / "corpus.jsonl")]
    argv += ["--max_steps", str(steps), "--heldout_questions", "0", "--rollout_log_steps", str(log_steps)]
    argv += ["--rollout_log_episodes", "16", "--disable_tqdm", "true"]
    trainer = build_trainer(*parse_args(argv))
    spent, originals = [], {name: getattr(RolloutLog, name) for name in ("record", "on_step_end")}
    for name, original in originals.items():

        def timed(*args, _original=original, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - start)

        setattr(RolloutLog, name, timed)
    try:
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
    finally:
        for name, original in originals.items():
            setattr(RolloutLog, name, original)
    step_times = [e["step_time"] for e in trainer.state.log_history if "step_time" in e]
    files = sorted((out / "rollouts").glob("step-*.jsonl")) if log_steps else []
    return {
        "wall_s": wall,
        "step_times_s": step_times,
        "median_step_s": statistics.median(step_times[1:]),
        "log_s": sum(spent),
        "step_file_bytes": [f.stat().st_size for f in files],
        "episodes_per_file": [len(f.read_text().splitlines()) - 1 for f in files],
    }


def synthetic_log(real: list[dict], folder: Path, episodes: int, per_step: int = 100) -> None:
    """``episodes`` episodes in step files of ``per_step``, copies of the ``real`` ones made distinct (question,
    memories, passages: a serial number added), as a long run's logs would be."""
    from mempo_trl.rollout_log import write_step_log

    for step in range(1, episodes // per_step + 1):
        records = []
        for i in range(per_step):
            n = (step - 1) * per_step + i
            record = copy.deepcopy(real[n % len(real)])
            record.update(step=step, question=f"{record['question']} (#{n})")
            for r in record["rounds"]:
                r["mem"] = r["mem"] and f"{r['mem']} #{n}"
                if r.get("information"):
                    r["information"] = re.sub(r"\)", f") #{n}", r["information"])
            records.append(record)
        write_step_log(folder, step, {"context_mode": "memory", "num_generations": 4}, records)


def open_page(page: Path) -> tuple[int, float]:
    """(ms from navigation start to the first page drawn, wall seconds of the Chromium process)."""
    from browser import dump_dom

    start = time.perf_counter()
    dom = dump_dom(page)
    wall = time.perf_counter() - start
    return int(re.search(r'data-drawn-ms="(\d+)"', dom).group(1)), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="Training steps of each run (the first is left out).")
    parser.add_argument("--episodes", type=int, default=1000, help="Episodes of the synthetic page.")
    parser.add_argument("--opens", type=int, default=3, help="Times the page is opened in Chromium.")
    parser.add_argument("--json", help="Write the results there.")
    args = parser.parse_args()
    from mempo_trl.cli import main as cli
    from mempo_trl.viewer import build_page

    with tempfile.TemporaryDirectory(prefix="bench-viewer-") as tmp:
        root = Path(tmp)
        assert cli(["kit", "learner", "--output_dir", str(root / "kit")]) == 0
        off = train(root / "kit", root / "off", args.steps, 0)
        on = train(root / "kit", root / "on", args.steps, 1)
        files = sorted((root / "on" / "rollouts").glob("step-*.jsonl"))
        real = [json.loads(line) for f in files for line in f.read_text().splitlines()[1:]]
        synthetic_log(real, root / "big" / "rollouts", args.episodes)
        start = time.perf_counter()
        page, count = build_page(root / "big", root / "page.html")
        build_s = time.perf_counter() - start
        log_bytes = sum(f.stat().st_size for f in (root / "big" / "rollouts").iterdir())
        opens = [open_page(page) for _ in range(args.opens)]
        result = {
            "command": " ".join(sys.argv),
            "machine": f"{platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
            "training": {
                "steps": args.steps,
                "episodes_per_step": 16,
                "off_median_step_s": off["median_step_s"],
                "on_median_step_s": on["median_step_s"],
                "ratio_on_off": on["median_step_s"] / off["median_step_s"],
                "log_s": on["log_s"],
                "log_share_of_training": on["log_s"] / on["wall_s"],
                "step_file_bytes": on["step_file_bytes"],
                "episodes_per_file": on["episodes_per_file"],
                "off_step_times_s": off["step_times_s"],
                "on_step_times_s": on["step_times_s"],
            },
            "page": {
                "episodes": count,
                "log_bytes": log_bytes,
                "page_bytes": page.stat().st_size,
                "build_s": build_s,
                "drawn_ms": [ms for ms, _ in opens],
                "chromium_wall_s": [wall for _, wall in opens],
            },
        }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
