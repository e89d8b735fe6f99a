"""Does the memory reward credit the right memory? The credit study on a real language model (issue 43).

SmolLM2-135M-Instruct (`mempo-trl kit smollm2`, offline) gets a short LoRA warm start with the project's own pipeline:
the scripted oracle's episodes of K-balanced warm rows of the horizon world (`horizon_world.py`, K = 2 and 4, each
fact left out of the oracle's memory with probability ``mem_drop``) written as `mempo-trl distill` writes its rows,
then `mempo-trl sft --use_peft`. A gate plays it greedily on a few validation questions per K and stops the study
(one ``error:`` line) unless it plays format-valid episodes and searches K times (`STUDY["gate"]`).

Then, on the validation questions of each K (never the test split), every memory below is scored as the trainer
scores it (`mempo_trl.scoring.shared_prefix_answer_logps` of the gold answer after the memory and after the full
history) and
labelled by the needed facts it holds (each part's gold value found in the memory after `normalize_answer`):

- scripted memories, written at the answer round of the oracle's episode: ``all`` the needed facts, ``drop_first``,
  ``drop_half`` (only the first K/2 kept), ``corrupt`` (every value replaced by another of its kind: `fresh_value`)
  and ``nothing`` (``Nothing yet.``); P_full is the oracle's full history at that round;
- sampled memories: G ``<mem>`` blocks per question sampled from the warm model (temperature
  `STUDY["temperature"]`) at the round after the last search, the searches played by the oracle (every needed fact
  retrieved; its memory of the earlier rounds drops each fact with probability ``mem_drop``, drawn anew for each of
  the G, as in the warm start's data), P_full that trajectory's own full history there. Playing all K + 1 turns G
  times per question, and the answer after the memory, cost more than this CPU had (lab/README.md).

For every reward variant (`VARIANTS`) the memory reward (`answer_probability`, `memory_reward`) and the memory
advantage after the library's pooling (`mempo_advantages`: the scripted memories of a question are one group, the G
sampled ones another, each with equal outcomes, which the memory advantage does not read) give the figures of merit
(`pool_figures`):
the AUC of the advantage ranking the memories of a question by needed facts kept, sign accuracy, and the share of
memories short of a needed fact that get a positive advantage (and a positive reward), with 95% bootstrap intervals
over questions. Every phase is cached in the run directory (``runs/credit_study/``), so a restart skips what is done.

    python lab/credit_study.py                              # the published run -> lab/results/credit_study.*
    python lab/credit_study.py --sample_minutes 45          # the same, sampling stopped after 45 min (partial)
    python lab/credit_study.py --quick --out outputs/credit_quick   # smoke run: tiny shapes
"""

import argparse
import copy
import json
import math
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

from learning import _machine

from mempo_trl.kit.learner import LEARNER_INSTRUCTION
from mempo_trl.processes import child_env


STUDY = {
    "world": {
        "seed": 2,
        "num_entities": 240,
        "horizons": [2, 4],
        "rows_per_horizon": {"warm": 150, "rl": 0, "validation": 60, "test": 0},
    },
    "warm": {
        "rows_per_k": 150,
        "mem_drop": 0.3,
        "seed": 0,
        "max_steps": 150,
        "batch_size": 4,
        "learning_rate": 2e-3,
        "lora_r": 16,
        "lora_alpha": 32,
        "counted": True,
    },
    "gate": {"questions": 3, "min_format_valid": 0.5, "min_searched_k": 0.5},
    "protocol": {
        "instruction": LEARNER_INSTRUCTION,
        "max_turns": 6,
        "retrieval_topk": 3,
        "max_completion_length": 128,
    },
    "questions": 60,
    "generations": 8,
    "temperature": 1.0,
    "quantile": 0.5,
    "bootstrap": 1000,
    "seed": 0,
}
"""The published configuration: the world (`generate_horizon_world` arguments), the LoRA warm start
(`mempo-trl sft` arguments), the gate, the turn protocol, validation questions per K, sampled memories per question
(G), their temperature, the quantile of the quantile filter, bootstrap resamples and the seed. ``warm["counted"]``
starts every oracle thought with the hops searched so far (``Searched 1 of 2. I must search.``), in the warm start's
data and in the rounds the study scores; ``warm["repair"]`` (absent: off) makes the oracle search each dropped fact
again instead (`oracle_episode_turns`)."""

QUICK = {
    "world": {"num_entities": 60, "rows_per_horizon": {"warm": 4, "rl": 0, "validation": 2, "test": 0}},
    "warm": {"rows_per_k": 2, "max_steps": 1, "batch_size": 2},
    "gate": {"questions": 1, "min_format_valid": 0.0, "min_searched_k": 0.0},
    "protocol": {"max_completion_length": 24},
    "questions": 2,
    "generations": 2,
    "bootstrap": 20,
}
"""``--quick``: tiny shapes that exercise every phase (the gate's thresholds at 0: one SFT step plays nothing)."""

VARIANTS = {
    "diff_filter": {"memory_reward_type": "diff", "memory_threshold": math.log(0.5)},
    "diff": {"memory_reward_type": "diff", "memory_threshold": None},
    "diff_quantile": {"memory_reward_type": "diff", "memory_threshold": None, "memory_threshold_quantile": "quantile"},
    "log_ratio_filter": {"memory_reward_type": "log_ratio", "memory_threshold": math.log(0.5)},
    "log_ratio": {"memory_reward_type": "log_ratio", "memory_threshold": None},
    "diff_weakest": {"memory_reward_type": "diff", "memory_threshold": None, "memory_reward_parts": "weakest"},
    "log_ratio_weakest": {
        "memory_reward_type": "log_ratio",
        "memory_threshold": None,
        "memory_reward_parts": "weakest",
    },
    "diff_uncentred": {"memory_reward_type": "diff", "memory_threshold": None, "memory_center_rewards": False},
    "diff_weakest_uncentred": {
        "memory_reward_type": "diff",
        "memory_threshold": None,
        "memory_reward_parts": "weakest",
        "memory_center_rewards": False,
    },
    "diff_losses_uncentred": {
        "memory_reward_type": "diff",
        "memory_threshold": None,
        "memory_reward_parts": "losses",
        "memory_center_rewards": False,
    },
}
"""The reward variants, as `MemoryRewardSettings` fields: the library's default (``diff_filter``: the paper's
``P_mem - P_full`` with its filter, p > 0.5), without the filter, with the quantile filter (the q-quantile of the
group's answer-token log-probs, full and memory, q = ``STUDY["quantile"]``), and ``log_ratio`` with and without the
filter. ``log_ratio`` without the filter is the difference of the mean per-token log-probability of the gold. The
``_weakest`` ones score each part of the gold on its own tokens and take the lowest reward
(``memory_reward_parts="weakest"``); ``_losses`` takes, where any part's reward is below 0, the mean of
``min(part reward, 0)`` over the parts (``memory_reward_parts="losses"``); the ``_uncentred`` ones take no pool mean
off (``memory_center_rewards=False``), so an advantage keeps its reward's sign."""

DEFAULT_VARIANT = "diff_filter"
TARGETS = {"auc": 0.9, "false_positive": 0.1}
"""The issue's targets on the sampled groups at every K: AUC at least this, a false-positive share at most this."""
SCRIPTED = ("all", "drop_first", "drop_half", "corrupt", "nothing")
RESULTS = Path("lab/results")
PHASES_FILE = "phases.json"


def merged(base: dict, overrides: dict) -> dict:
    """``base`` with ``overrides`` merged in, one level of nested dicts deep.

    >>> merged({"a": {"x": 1, "y": 2}, "b": 3}, {"a": {"y": 5}})
    {'a': {'x': 1, 'y': 5}, 'b': 3}
    """
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def study_of(quick: bool = False, world_seed: int | None = None, horizons=None, rl_rows: int = 0) -> dict:
    """The study's settings: `STUDY` (``quick``: with `QUICK`), its world made with seed ``world_seed`` and
    ``horizons`` when given (the turn budget raised to K + 1 turns for the largest K), with ``rl_rows`` rows per K
    in an RL split of its own (the RL comparison's questions, never scored here). Any of them changes the world, so
    the warm start is trained, gated and scored anew (`warm_digest`).

    >>> study_of() == STUDY
    True
    >>> s = study_of(True, world_seed=7, horizons=[2, 4, 6], rl_rows=5)
    >>> s["world"]["seed"], s["world"]["horizons"], s["world"]["rows_per_horizon"]["rl"], s["protocol"]["max_turns"]
    (7, [2, 4, 6], 5, 7)
    """
    study = merged(STUDY, QUICK) if quick else copy.deepcopy(STUDY)
    world = study["world"]
    if world_seed is not None:
        world["seed"] = world_seed
    if horizons:
        world["horizons"] = sorted(horizons)
        study["protocol"]["max_turns"] = max(study["protocol"]["max_turns"], max(horizons) + 1)
    if rl_rows:
        world["rows_per_horizon"] = {**world["rows_per_horizon"], "rl": rl_rows}
    return study


def add_study_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that pick the study's settings (`study_of`), shared by the lab's scripts that read its runs."""
    parser.add_argument("--quick", action="store_true", help="smoke run with tiny shapes (`QUICK`)")
    parser.add_argument(
        "--world_seed", type=int, help=f"the world's seed (default {STUDY['world']['seed']}): fresh questions"
    )
    parser.add_argument(
        "--horizons", type=int, nargs="+", help=f"the K of the world (default {STUDY['world']['horizons']})"
    )
    parser.add_argument(
        "--rl_rows", type=int, default=0, help="rows per K in an RL split of the world (default 0: none)"
    )


def study_from_args(args: argparse.Namespace) -> dict:
    """`study_of` the parsed `add_study_arguments` options."""
    return study_of(args.quick, args.world_seed, args.horizons, args.rl_rows)


def is_default_study(args: argparse.Namespace) -> bool:
    """Whether the options give the published study's settings (no ``--quick``, world options at their defaults)."""
    return not args.quick and args.world_seed is None and not args.horizons and not args.rl_rows


def facts_held(memory: str, sub_answers: list[list[str]]) -> list[bool]:
    """For each needed fact (its gold aliases), whether the memory holds one of them as whole words after
    `normalize_answer` (case, punctuation, articles and thousands separators aside).

    >>> facts_held("Ada Lovel: 1,801. Bo: painter.", [["1801"], ["sculptor"], ["painter", "a painter"]])
    [True, False, True]
    """
    from mempo_trl.rewards import normalize_answer

    text = f" {normalize_answer(memory)} "
    return [any(f" {normalize_answer(a)} " in text for a in aliases if normalize_answer(a)) for aliases in sub_answers]


def pairwise_auc(scores: list[float], kept: list[int]) -> tuple[float, int]:
    """``(wins, pairs)`` over the pairs of memories that keep different numbers of needed facts: a win when the one
    that keeps more has the higher score, half a win for a tie.

    >>> pairwise_auc([0.9, 0.1, 0.5, 0.5], [2, 0, 1, 1])
    (5.0, 5)
    >>> pairwise_auc([0.1, 0.9, 0.5], [2, 1, 0])
    (1.0, 3)
    """
    wins, pairs = 0.0, 0
    for i in range(len(scores)):
        for j in range(len(scores)):
            if kept[i] > kept[j]:
                pairs += 1
                wins += 1.0 if scores[i] > scores[j] else 0.5 if scores[i] == scores[j] else 0.0
    return wins, pairs


def pool_figures(advantages: list[float], rewards: list[float], kept: list[int], k: int) -> dict:
    """The counts behind the figures of merit of one group: `pairwise_auc` of the advantages; sign accuracy over a
    group that mixes complete memories (all K facts) and incomplete ones (a complete one should get a positive
    advantage, an incomplete one a negative); incomplete memories, and those of them with a positive advantage and
    with a positive reward (``fp``, ``fp_reward``).

    >>> pool_figures([1.2, -0.2, -1.0], [0.3, 0.01, -0.2], [2, 1, 0], 2)
    {'auc_wins': 3.0, 'auc_pairs': 3, 'sign_correct': 3, 'sign_n': 3, 'incomplete': 2, 'fp': 0, 'fp_reward': 1}
    """
    wins, pairs = pairwise_auc(advantages, kept)
    complete = [n == k for n in kept]
    mixed = any(complete) and not all(complete)
    correct = sum((a > 0) == c for a, c in zip(advantages, complete)) if mixed else 0
    return {
        "auc_wins": wins,
        "auc_pairs": pairs,
        "sign_correct": correct,
        "sign_n": len(kept) if mixed else 0,
        "incomplete": sum(not c for c in complete),
        "fp": sum(a > 0 and not c for a, c in zip(advantages, complete)),
        "fp_reward": sum(r > 0 and not c for r, c in zip(rewards, complete)),
    }


FIGURES = {
    "auc": ("auc_wins", "auc_pairs"),
    "sign_accuracy": ("sign_correct", "sign_n"),
    "false_positive": ("fp", "incomplete"),
    "false_positive_reward": ("fp_reward", "incomplete"),
}
"""Each figure of merit as the ratio of two sums of `pool_figures` counts over questions."""


def summarize_figures(per_question: list[dict], resamples: int, seed: int) -> dict:
    """Each figure (`FIGURES`) over the questions' counts, with a 95% bootstrap interval (questions resampled with
    replacement, ``resamples`` times, fixed ``seed``); a figure with no denominator is None.

    >>> summarize_figures([{"auc_wins": 1.0, "auc_pairs": 1, "sign_correct": 0, "sign_n": 0, "incomplete": 1,
    ...                     "fp": 1, "fp_reward": 0}], 10, 0)["false_positive"]
    {'value': 1.0, 'low': 1.0, 'high': 1.0}
    """
    rng = random.Random(seed)
    samples = [[rng.randrange(len(per_question)) for _ in per_question] for _ in range(resamples)]
    out = {"questions": len(per_question)}
    for name, (num, den) in FIGURES.items():
        value = _ratio(per_question, range(len(per_question)), num, den)
        boot = sorted(v for v in (_ratio(per_question, s, num, den) for s in samples) if v is not None)
        out[name] = (
            None
            if value is None
            else {
                "value": value,
                "low": boot[int(0.025 * (len(boot) - 1))] if boot else None,
                "high": boot[int(math.ceil(0.975 * (len(boot) - 1)))] if boot else None,
            }
        )
    return out


def _ratio(per_question: list[dict], indices, num: str, den: str) -> float | None:
    total = sum(per_question[i][den] for i in indices)
    return sum(per_question[i][num] for i in indices) / total if total else None


def variant_settings(name: str, quantile: float):
    """The `MemoryRewardSettings` of variant ``name`` (`VARIANTS`), the library's defaults otherwise."""
    from mempo_trl.settings import MemoryRewardSettings

    fields = dict(VARIANTS[name])
    if fields.get("memory_threshold_quantile") == "quantile":
        fields["memory_threshold_quantile"] = quantile
    return MemoryRewardSettings(**fields)


def group_advantages(group: dict, settings, parts: list[int] | None = None) -> tuple[list[float], list[float]]:
    """The memory rewards and memory advantages of one group's scored memories under ``settings``, computed with the
    library's functions: `quantile_threshold` over the group's answer-token log-probs (full and memory) when the
    variant has one, `memory_scores` (with ``parts``, the part of each gold token, for ``memory_reward_parts``), and
    `mempo_advantages` (the group's G trajectories, one scored round each, their outcome rewards)."""
    import torch

    from mempo_trl.advantages import mempo_advantages
    from mempo_trl.memory import memory_scores, quantile_threshold

    mem_logps, mem_mask = _padded(group["mem_logps"])
    full_logps, full_mask = _padded(group["full_logps"])
    threshold = settings.memory_threshold
    if settings.memory_threshold_quantile is not None:
        values = torch.cat([mem_logps[mem_mask.bool()], full_logps[full_mask.bool()]])
        threshold = quantile_threshold(
            values, torch.ones_like(values, dtype=torch.bool), settings.memory_threshold_quantile
        )
    n = len(group["mem_logps"])
    part_ids = None if parts is None else _padded([parts] * n)[0].long()
    scores = memory_scores(
        n, list(range(n)), (full_logps, full_mask), (mem_logps, mem_mask), [0] * n, settings, threshold, 1, part_ids
    )
    rewards = scores.reward.tolist()
    out = mempo_advantages(
        torch.tensor(group["outcomes"], dtype=torch.float32),
        list(range(n)),
        [1] * n,
        rewards,
        [(0, 0)] * n,
        torch.ones(n, 1),
        slice(0, n),
        n,
        settings=settings,
    )
    return rewards, out.memory[:, 0].tolist()


def gold_token_parts(tokenizer, row: dict) -> list[int]:
    """The part of each gold token of ``row``'s answer (`gold_answer_parts` where `gold_answer_tokens`' mask is 1),
    aligned with a group's cached ``mem_logps`` / ``full_logps``."""
    from mempo_trl.context import gold_answer_encoding

    _, mask, parts = gold_answer_encoding(tokenizer, row["golden_answers"], row["sub_answers"])
    return [part for part, gold in zip(parts, mask) if gold]


def _padded(rows: list[list[float]]):
    """``(values, mask)``, (N, longest) float32 and bool, the rows right-padded with 0."""
    import torch

    width = max((len(r) for r in rows), default=0)
    values = torch.tensor([list(r) + [0.0] * (width - len(r)) for r in rows], dtype=torch.float32).view(
        len(rows), width
    )
    mask = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in rows], dtype=torch.bool)
    return values, mask.view(len(rows), width)


# ---------------------------------------------------------------------------------------------------- the phases


def write_world(out: Path, study: dict) -> dict[str, Path]:
    """The horizon world's corpus, warm and validation rows under ``out/world`` (reused when the settings match)."""
    from horizon_world import generate_horizon_world

    from mempo_trl.kit.demo_world import write_jsonl

    world_dir = out / "world"
    paths = {name: world_dir / f"{name}.jsonl" for name in ("corpus", "warm", "validation", "rl")}
    marker = world_dir / "world.json"
    if marker.is_file() and json.loads(marker.read_text())["world"] == study["world"]:
        return paths
    settings = study["world"]
    world = generate_horizon_world(
        settings["seed"], settings["num_entities"], settings["rows_per_horizon"], tuple(settings["horizons"])
    )
    world_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(paths["corpus"], world.passages)
    for name in ("warm", "validation", "rl"):
        write_jsonl(paths[name], world.splits[name])
    marker.write_text(json.dumps({"world": settings}, indent=1))
    return paths


def by_k(rows: list[dict], horizons: list[int], count: int) -> dict[int, list[dict]]:
    """The first ``count`` rows of each K (``data_source`` ``horizon_K``)."""
    return {k: [r for r in rows if r["data_source"] == f"horizon_{k}"][:count] for k in horizons}


def protocol_of(study: dict):
    from mempo_trl.protocol import TurnProtocol

    return TurnProtocol(**study["protocol"], context_mode="memory")


def warm_rows_file(out: Path, paths: dict, study: dict, retriever) -> Path:
    """The oracle's episodes of ``rows_per_k`` warm rows of each K as `mempo-trl distill` writes its rows
    (``train.jsonl``: one conversational prompt-completion row per round, ``mempo_agent.json`` beside it)."""
    from mempo_trl.data import read_jsonl
    from mempo_trl.kit.demo_world import write_jsonl
    from mempo_trl.kit.warmstart import oracle_episode_turns

    warm = study["warm"]
    protocol = protocol_of(study)
    data_dir = out / "warm_data"
    data_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(warm["seed"])
    examples = []
    for rows in by_k(read_jsonl(paths["warm"]), study["world"]["horizons"], warm["rows_per_k"]).values():
        for row in rows:
            turns = oracle_episode_turns(
                row,
                retriever,
                protocol.retrieval_topk,
                protocol.max_turns,
                warm["mem_drop"],
                rng,
                warm.get("repair", False),
                warm.get("counted", False),
            )
            base, history = protocol.initial_messages(row["question"]), []
            for n, (text, information) in enumerate(turns, 1):
                messages = protocol.round_messages(base, history)
                examples.append(
                    {
                        "id": row["id"],
                        "round": n,
                        "prompt": messages,
                        "completion": [{"role": "assistant", "content": text}],
                    }
                )
                if information is not None:
                    history.append((text, information))
    random.Random(warm["seed"]).shuffle(examples)
    write_jsonl(data_dir / "train.jsonl", examples)
    protocol.save(data_dir)
    return data_dir


def merged_warm_start(study: dict, study_out: Path, out: Path, log) -> Path:
    """``out/merged_<digest>``: the study's LoRA warm start in ``study_out`` folded into its base by `mempo-trl
    merge-lora` (once; a later call finds it); `ValueError` (the message of the one ``error:`` line) when the merge
    fails."""
    digest = warm_digest(study)
    merged_dir = out / f"merged_{digest}"
    if not (merged_dir / "config.json").is_file():
        adapter = study_out / f"warm_{digest}"
        log(f"merging {adapter} into {merged_dir}")
        merge = mempo_command("merge-lora", {"model_name_or_path": adapter, "output_dir": merged_dir})
        finished = subprocess.run(merge, capture_output=True, text=True)
        if finished.returncode != 0:
            raise ValueError(f"mempo-trl merge-lora of {adapter} failed: {finished.stderr.strip()[-500:]}")
    return merged_dir


def mempo_command(subcommand: str, options: dict, *flags: str) -> list[str]:
    """The command line of ``mempo-trl SUBCOMMAND`` run by this interpreter: each option as ``--key value``, then
    the bare ``flags``.

    >>> mempo_command("sft", {"max_steps": 3, "output_dir": Path("o")}, "--use_peft")[3:]
    ['sft', '--max_steps', '3', '--output_dir', 'o', '--use_peft']
    """
    pairs = [x for key, value in options.items() for x in (f"--{key}", str(value))]
    return [sys.executable, "-m", "mempo_trl", subcommand, *pairs, *flags]


def run_options(device: str) -> dict:
    """The options every training command of the lab's SmolLM2 runs takes on ``device``: the CPU in float32, or a GPU
    in bf16; no activation checkpointing (a 135 M model), no report, no progress bar (the logs are files)."""
    return {
        "use_cpu": str(device == "cpu").lower(),
        "bf16": str(device == "cuda").lower(),
        "activation_checkpointing": "false",
        "report_to": "none",
        "disable_tqdm": "true",
    }


def child_process_env() -> dict[str, str]:
    """The environment of a training command the lab starts: it ends with this process (`child_env`) and writes its
    log lines as they come (unbuffered), so that its log file shows each step."""
    return child_env({**os.environ, "PYTHONUNBUFFERED": "1"})


def warm_digest(study: dict) -> str:
    """The first 12 hex digits of the sha256 of what makes a warm start (its settings, the turn protocol, the world):
    the warm start's folder, its gate and its scored groups are kept under it, so a changed warm start is trained,
    gated and scored anew, never read from another's files.

    >>> warm_digest(STUDY) == warm_digest(merged(STUDY, {})) != warm_digest(merged(STUDY, {"warm": {"seed": 1}}))
    True
    """
    import hashlib

    key = {"warm": study["warm"], "protocol": study["protocol"], "world": study["world"]}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def warm_start(out: Path, base: Path, data_dir: Path, study: dict, log, device: str = "cpu") -> tuple[Path, dict]:
    """The LoRA warm start by `mempo-trl sft` into ``out/warm_<digest>`` (`warm_digest`) on ``device`` (``cuda``:
    bf16; resumed from its newest checkpoint; skipped when ``warm_done.json`` there says it finished). Returns the
    adapter's folder and its stats."""
    from mempo_trl.checkpoints import newest_complete_checkpoint

    warm = study["warm"]
    warm_dir = out / f"warm_{warm_digest(study)}"
    done = warm_dir / "warm_done.json"
    key = {"warm": warm, "protocol": study["protocol"], "world": study["world"]}
    if done.is_file() and json.loads(done.read_text())["key"] == key:
        return warm_dir, json.loads(done.read_text())["stats"]
    lora = {"lora_r": warm["lora_r"], "lora_alpha": warm["lora_alpha"], "lora_target_modules": "all-linear"}
    options = {
        "model_name_or_path": base,
        "dataset_name": data_dir,
        "output_dir": warm_dir,
        **lora,
        "max_steps": warm["max_steps"],
        "per_device_train_batch_size": warm["batch_size"],
        "learning_rate": warm["learning_rate"],
        "lr_scheduler_type": "cosine",
        "warmup_steps": 2,
        "seed": warm["seed"],
        "logging_steps": 2,
        "save_steps": 4,
        "save_total_limit": 1,
        "max_length": 2048,
        **run_options(device),
    }
    command = mempo_command("sft", options, "--use_peft")
    resume = newest_complete_checkpoint(warm_dir) if warm_dir.is_dir() else None
    if resume is not None:
        command += ["--resume_from_checkpoint", str(resume)]
    log(f"warm start: {shlex.join(command)}")
    start = time.perf_counter()
    log_path = out / "warm_sft.log"
    with log_path.open("a") as sink:
        code = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, env=child_process_env()).returncode
    lines = log_path.read_text().splitlines()
    if code != 0:
        raise SystemExit(f"error: the warm start (mempo-trl sft) failed with exit code {code}; see {log_path}")
    report = json.loads(next(line for line in reversed(lines) if line.startswith('{"rows"')))
    stats = {
        **report,
        "seconds": time.perf_counter() - start,
        "resumed_from": str(resume) if resume else None,
        "command": shlex.join(command),
    }
    done.write_text(json.dumps({"key": key, "stats": stats}, indent=1))
    return warm_dir, stats


def load_warm(base: Path, warm_dir: Path, device: str = "cpu"):
    """The base model with the warm start's LoRA adapter merged in, in eval mode on ``device``, and its tokenizer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mempo_trl.loading import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(str(base))
    merged = PeftModel.from_pretrained(model, str(warm_dir)).merge_and_unload().eval()
    return merged.to(device), load_tokenizer(base)


def gate(model, tokenizer, retriever, rows: dict[int, list[dict]], study: dict) -> dict:
    """Greedy episodes on the first ``gate["questions"]`` rows of each K: per K the share of format-valid episodes,
    of episodes that searched at least K times, EM and searches; ``passed`` when every K meets both thresholds."""
    from mempo_trl.agent import MemPOAgent
    from mempo_trl.evaluation import evaluate
    from mempo_trl.generation import HFGenerator

    settings, protocol = study["gate"], protocol_of(study)
    generator = HFGenerator(model, tokenizer, protocol.max_completion_length, temperature=0.0, batch_size=32)
    agent = MemPOAgent(tokenizer, retriever, generator, protocol)
    result = {"by_k": {}}
    for k, k_rows in rows.items():
        records = evaluate(agent, k_rows[: settings["questions"]], progress=False).records
        n = len(records)
        result["by_k"][str(k)] = {
            "questions": n,
            "format_valid": sum(bool(r["format_valid"]) for r in records) / n,
            "searched_k": sum(r["num_searches"] >= k for r in records) / n,
            "searches": sum(r["num_searches"] for r in records) / n,
            "em": sum(r["em"] or 0.0 for r in records) / n,
        }
    return result


def gate_passed(by_k: dict, thresholds: dict) -> bool:
    """Whether every K of the gate's episodes meets both thresholds (format-valid, searched K times).

    >>> gate_passed({"2": {"format_valid": 1.0, "searched_k": 0.75}}, {"min_format_valid": 0.75, "min_searched_k": 0.75})
    True
    >>> gate_passed({"2": {"format_valid": 1.0, "searched_k": 0.5}}, {"min_format_valid": 0.75, "min_searched_k": 0.75})
    False
    """
    return all(
        cell["format_valid"] >= thresholds["min_format_valid"] and cell["searched_k"] >= thresholds["min_searched_k"]
        for cell in by_k.values()
    )


def scripted_memories(row: dict, retriever, study: dict, rng: random.Random) -> tuple[dict, list]:
    """The scripted memories of a row (`SCRIPTED`) and the oracle's full history at its answer round."""
    from long_horizon import fresh_value

    from mempo_trl.oracle import NOTHING_YET, hop_facts

    protocol = protocol_of(study)
    _, history, _ = answer_round(row, retriever, study, 0.0, rng)
    facts = hop_facts(row, retriever.search(row["hop_queries"], protocol.retrieval_topk))
    subjects = [fact.rsplit(":", 1)[0] for fact in facts]
    wrong = [fresh_value(rng, [str(a) for a in aliases])[0][0] for aliases in row["sub_answers"]]
    k = len(facts)
    kept = {
        "all": facts,
        "drop_first": facts[1:],
        "drop_half": facts[: k // 2],
        "corrupt": [f"{s}: {v}." for s, v in zip(subjects, wrong)],
        "nothing": [],
    }
    return {name: " ".join(f) or NOTHING_YET for name, f in kept.items()}, history


def answer_round(row: dict, retriever, study: dict, mem_drop: float, rng: random.Random) -> tuple[list, list, list]:
    """The oracle's searches of ``row`` (its memory dropping each fact with probability ``mem_drop``, drawn from
    ``rng``) up to its answer round: ``(base messages, history, the answer round's memory-mode messages)``."""
    from mempo_trl.kit.warmstart import oracle_episode_turns

    protocol = protocol_of(study)
    warm = study["warm"]
    turns = oracle_episode_turns(
        row, retriever, protocol.retrieval_topk, protocol.max_turns, mem_drop, rng, counted=warm.get("counted", False)
    )
    base = protocol.initial_messages(row["question"])
    history = [(text, information) for text, information in turns if information is not None]
    return base, history, protocol.round_messages(base, history)


def score_group(model, tokenizer, row: dict, blocks: list[str], full_messages: list[list[dict]], study: dict) -> dict:
    """One group's memories scored as the trainer scores them: the gold-token log-probs after
    ``system + user + <mem> block`` and after each memory's full history (`shared_prefix_answer_logps`, equal to
    `answer_token_logps` up to float rounding; identical full histories are scored once), and the needed facts each
    memory holds. ``blocks``: the ``<mem> ... </mem>`` blocks; ``full_messages``: each one's full-history messages."""
    from mempo_trl.context import ScoringItem, gold_answer_tokens, memory_context_ids, render_prompt
    from mempo_trl.scoring import shared_prefix_answer_logps

    protocol = protocol_of(study)
    base_ids = render_prompt(tokenizer, protocol.initial_messages(row["question"]))
    answer_ids, answer_mask = gold_answer_tokens(tokenizer, row["golden_answers"], row["sub_answers"])
    fulls = [render_prompt(tokenizer, messages) for messages in full_messages]
    distinct = list(dict.fromkeys(tuple(ids) for ids in fulls))
    items = [ScoringItem(memory_context_ids(tokenizer, base_ids, b), answer_ids, answer_mask) for b in blocks]
    items += [ScoringItem(list(ids), answer_ids, answer_mask) for ids in distinct]
    keys = ["mem"] * len(blocks) + ["full"] * len(distinct)
    logps, mask = shared_prefix_answer_logps(model, items, keys, tokenizer.pad_token_id)
    gold = [row_logps[row_mask].tolist() for row_logps, row_mask in zip(logps, mask)]
    full_of = {ids: gold[len(blocks) + n] for n, ids in enumerate(distinct)}
    memories = [b.removeprefix("<mem>").removesuffix("</mem>").strip() for b in blocks]
    return {
        "memories": memories,
        "mem_logps": gold[: len(blocks)],
        "full_logps": [full_of[tuple(ids)] for ids in fulls],
        "held": [facts_held(m, row["sub_answers"]) for m in memories],
    }


def scripted_group(model, tokenizer, retriever, row: dict, study: dict) -> dict:
    """The scripted group of a question (`scripted_memories`), all with the oracle's full history; outcomes 0."""
    from mempo_trl.context import round_messages

    scripted, history = scripted_memories(row, retriever, study, random.Random(f"{study['seed']}-{row['id']}"))
    full = round_messages(protocol_of(study).initial_messages(row["question"]), history, "full_history")
    blocks = [f"<mem> {memory} </mem>" for memory in scripted.values()]
    group = score_group(model, tokenizer, row, blocks, [full] * len(blocks), study)
    return {"names": list(scripted), **group, "outcomes": [0.0] * len(blocks)}


def sampled_groups(model, tokenizer, retriever, rows: list[dict], study: dict, back: int = 0) -> list[dict]:
    """The sampled group of each question: G memories sampled from the warm model at the answer round, after the
    oracle's searches (`answer_round`, each with its own draw of the memory's drops, as in the warm start's data),
    each scored with its own full history. Sampling stops at ``</mem>``: the memory advantage does not read the
    outcomes (`mempo_advantages` pools the memory rewards alone), so the group's outcomes are all equal (0). A memory
    that is not well-formed is not scored (as in training) and counted in ``unscored``; ``draws`` keeps the draw
    (0 to G - 1) of each scored one. ``back``: ``back`` rounds before the answer round (after K - ``back`` of the
    oracle's searches; the same draws), for the rows with K > ``back`` (the others get no group: None); 0 samples
    what the credit study samples."""
    import torch

    from mempo_trl.context import render_prompt, round_messages
    from mempo_trl.generation import HFGenerator
    from mempo_trl.rollout import cut_after_action
    from mempo_trl.turns import parse_turn

    protocol, g = protocol_of(study), study["generations"]
    generator = HFGenerator(
        model, tokenizer, protocol.max_completion_length, study["temperature"], batch_size=32, stops=MEM_STOPS
    )
    rows = [row for row in rows if len(row["hop_queries"]) > back] if back else rows
    if not rows:
        return []
    rounds = [
        round_before(row, retriever, study, random.Random(f"{study['seed']}-{row['id']}-{n}"), back)
        for row in rows
        for n in range(g)
    ]
    torch.manual_seed(study["seed"] + sum(ord(c) for c in rows[0]["id"]) + 7919 * back)
    completions, _ = generator([render_prompt(tokenizer, messages) for _, _, messages in rounds])
    groups = []
    for n, row in enumerate(rows):
        blocks, fulls, draws, unscored = [], [], [], 0
        for i in range(n * g, (n + 1) * g):
            text = cut_after_action(completions[i], tokenizer, generator.eos_token_ids, MEM_STOPS)[1]
            turn = parse_turn(text)
            if turn.mem_chars is None:
                unscored += 1
                continue
            draws.append(i - n * g)
            base, history, _ = rounds[i]
            blocks.append(text[turn.mem_chars[0] : turn.mem_chars[1]])
            fulls.append(round_messages(base, history, "full_history"))
        group = score_group(model, tokenizer, row, blocks, fulls, study) if blocks else {"memories": [], "held": []}
        groups.append({**group, "outcomes": [0.0] * len(blocks), "unscored": unscored, "draws": draws})
    return groups


def round_before(row: dict, retriever, study: dict, rng: random.Random, back: int = 0) -> tuple[list, list, list]:
    """`answer_round` (the memory's drops drawn from ``rng``) ``back`` rounds earlier: its first K - ``back``
    searches, ``(base messages, history, that round's memory-mode messages)``."""
    base, history, messages = answer_round(row, retriever, study, study["warm"]["mem_drop"], rng)
    if not back:
        return base, history, messages
    history = history[: len(history) - back]
    return base, history, protocol_of(study).round_messages(base, history)


MEM_STOPS = ("</mem>",)
"""Where a sampled memory turn is cut: only its ``<mem>`` block is scored."""


def interleaved(rows: dict[int, list[dict]]) -> list[dict]:
    """The rows of every K taken in turn (K = 2, 4, 2, 4, ...), so that a stopped phase has covered each K alike.

    >>> [r["id"] for r in interleaved({2: [{"id": "a"}, {"id": "b"}], 4: [{"id": "c"}]})]
    ['a', 'c', 'b']
    """
    lists = list(rows.values())
    return [r[n] for n in range(max(map(len, lists), default=0)) for r in lists if n < len(r)]


def scored_phase(path: Path, rows: list[dict], score, log, name: str, deadline: float | None = None) -> dict:
    """``score(chunk) -> groups`` of the rows, 4 at a time, each question's group appended to ``path`` (JSON lines)
    as it is done; a restart skips the questions found there. Stops starting chunks past ``deadline`` (a
    ``time.time()``). Returns the groups by question id."""
    from mempo_trl.data import read_jsonl

    done = {r["id"]: r["group"] for r in read_jsonl(path)} if path.is_file() else {}
    todo = [row for row in rows if row["id"] not in done]
    for start in range(0, len(todo), 4):
        if deadline is not None and time.time() > deadline:
            log(f"{name}: stopped at the deadline with {len(done)} of {len(rows)} questions")
            break
        chunk = todo[start : start + 4]
        for row, group in zip(chunk, score(chunk)):
            done[row["id"]] = group
            with path.open("a") as f:
                f.write(json.dumps({"id": row["id"], "group": group}) + "\n")
        log(f"{name}: {len(done)} of {len(rows)} questions")
    return done


def study_figures(rows: dict[int, list[dict]], scripted: dict, sampled: dict, study: dict, tokenizer) -> dict:
    """Per K, group kind (scripted, sampled) and variant: `summarize_figures`
    of `pool_figures` over the questions scored so far; plus what the memories were (facts kept per scripted kind,
    sampled memories by facts kept)."""
    results: dict = {}
    for k, k_rows in rows.items():
        ids = {
            kind: [r["id"] for r in k_rows if r["id"] in source]
            for kind, source in (("scripted", scripted), ("sampled", sampled))
        }
        groups = {"scripted": [scripted[i] for i in ids["scripted"]], "sampled": [sampled[i] for i in ids["sampled"]]}
        parts = {r["id"]: gold_token_parts(tokenizer, r) for r in k_rows}
        kept = [sum(h) for g in groups["sampled"] for h in g["held"]]
        cell = results[str(k)] = {
            "questions": {kind: len(g) for kind, g in groups.items()},
            "scripted_facts_kept": {
                name: _mean([sum(g["held"][i]) for g in groups["scripted"]]) for i, name in enumerate(SCRIPTED)
            },
            "sampled_memories": {
                "scored": len(kept),
                "unscored": sum(g["unscored"] for g in groups["sampled"]),
                "by_facts_kept": {str(n): kept.count(n) for n in range(k + 1)},
            },
            "variants": {},
        }
        for variant in VARIANTS:
            settings = variant_settings(variant, study["quantile"])
            cell["variants"][variant] = {}
            for kind, kind_groups in groups.items():
                counts = []
                for group, question in zip(kind_groups, ids[kind]):
                    if len(group["memories"]) >= 2:
                        rewards, advantages = group_advantages(group, settings, parts[question])
                        counts.append(pool_figures(advantages, rewards, [sum(h) for h in group["held"]], k))
                summary = summarize_figures(counts, study["bootstrap"], study["seed"]) if counts else None
                cell["variants"][variant][kind] = summary
    return results


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def plot(summary: dict, path: Path) -> None:
    """AUC and false-positive share per variant x K (scripted and sampled groups) with their 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    variants = list(VARIANTS)
    series = [(k, kind) for k in summary["figures"] for kind in ("scripted", "sampled")]
    width = 0.8 / len(series)
    for ax, metric, title in (
        (axes[0], "auc", "AUC: memories ranked by needed facts kept"),
        (axes[1], "false_positive", "short of a needed fact, positive advantage"),
    ):
        for s, (k, kind) in enumerate(series):
            xs, ys, errs = [], [], [[], []]
            for v, variant in enumerate(variants):
                cell = (summary["figures"][k]["variants"][variant].get(kind) or {}).get(metric)
                if cell is None:
                    continue
                xs.append(v + (s - (len(series) - 1) / 2) * width)
                ys.append(cell["value"])
                errs[0].append(cell["value"] - (cell["low"] if cell["low"] is not None else cell["value"]))
                errs[1].append((cell["high"] if cell["high"] is not None else cell["value"]) - cell["value"])
            ax.bar(xs, ys, width, yerr=errs, capsize=2, label=f"K={k} {kind}")
        ax.set_xticks(range(len(variants)), variants, rotation=35, ha="right", fontsize=8)
        ax.set_title(title)
        ax.set_ylim(0, 1)
    axes[0].axhline(TARGETS["auc"], color="k", lw=0.8, ls="--")
    axes[1].axhline(TARGETS["false_positive"], color="k", lw=0.8, ls="--")
    axes[0].legend(fontsize=8, loc="lower left")
    counts = ", ".join(f"K={k}: {cell['questions']['scripted']}" for k, cell in summary["figures"].items())
    status = "" if summary["complete"] else f" of {summary['questions_per_k']} (partial)"
    status += "" if summary["gate"]["passed"] else ", warm start failed the gate"
    figure.suptitle(
        f"Memory credit on SmolLM2-135M-Instruct (LoRA warm start), 95% bootstrap intervals\n"
        f"validation questions {counts}{status}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/credit_study", help="run directory (cached phases; not in git)")
    add_study_arguments(parser)
    parser.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="where the warm start, gate and scoring run"
    )
    parser.add_argument(
        "--ungated",
        action="store_true",
        help="go on when the warm start fails the gate (a diagnostic: the summary is credit_study_ungated.json)",
    )
    parser.add_argument(
        "--expect",
        help="a committed summary (lab/results/credit_study.json): exit 1 with one error line when this run's figures, "
        "gate or recorded raw-output sha256 differ (a bit-for-bit rebuild check)",
    )
    parser.add_argument(
        "--gate_only",
        action="store_true",
        help="stop once the warm start passed its gate (the RL comparison's warm start: lab/rl_compare.py)",
    )
    parser.add_argument(
        "--sample_minutes",
        type=float,
        help="stop sampling after this many minutes of this run (the summary says `complete: false`); rerun to go on",
    )
    args = parser.parse_args(argv)
    study = study_from_args(args)
    published = is_default_study(args) and args.out == "runs/credit_study"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = RESULTS if published else out
    if not os.access(target if target.exists() else target.parent, os.W_OK):  # written after hours: check first
        print(
            f"error: cannot write the summary into {target}: make it writable or pass another --out", file=sys.stderr
        )
        return 2
    command = shlex.join(["python", "lab/credit_study.py", *(argv if argv is not None else sys.argv[1:])])

    import torch

    from mempo_trl.data import read_jsonl
    from mempo_trl.kit.smollm2 import build_smollm2_model
    from mempo_trl.retrieval import BM25Retriever

    torch.set_num_threads(1)
    phases_path = out / PHASES_FILE
    phases = json.loads(phases_path.read_text()) if phases_path.is_file() else {}

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    def timed(name: str, start: float) -> None:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - start
        phases_path.write_text(json.dumps(phases, indent=1))

    start = time.perf_counter()
    paths = write_world(out, study)
    base = out / "smollm2_base"
    if not (base / "model.safetensors").is_file():
        build_smollm2_model(base)
    retriever = BM25Retriever.from_corpus(str(paths["corpus"]), cache_dir=str(out / "bm25"))
    rows = by_k(read_jsonl(paths["validation"]), study["world"]["horizons"], study["questions"])
    short = {k: len(r) for k, r in rows.items() if len(r) < study["questions"]}
    if short:
        raise SystemExit(
            f"error: the world has too few validation rows for K {short} (need {study['questions']} "
            "each): raise world.rows_per_horizon['validation'] or num_entities in STUDY"
        )
    data_dir = warm_rows_file(out, paths, study, retriever)
    timed("world_and_base", start)

    start = time.perf_counter()
    warm_dir, warm_stats = warm_start(out, base, data_dir, study, log, args.device)
    timed("warm_start", start)
    log(
        f"warm start: {warm_stats.get('rows')} rounds, loss {warm_stats.get('first_logged_loss')} -> "
        f"{warm_stats.get('train_loss')} (mean), {warm_stats['seconds']:.0f} s"
    )

    start = time.perf_counter()
    model, tokenizer = load_warm(base, warm_dir, args.device)
    gate_path, digest = out / "gate.json", warm_digest(study)
    checked = json.loads(gate_path.read_text()) if gate_path.is_file() else {}
    if checked.get("warm_digest") != digest:  # played again for a new warm start
        checked = {"warm_digest": digest, **gate(model, tokenizer, retriever, rows, study)}
        gate_path.write_text(json.dumps(checked, indent=1))
        timed("gate", start)
    thresholds = study["gate"]
    checked = {**checked, "thresholds": thresholds, "passed": gate_passed(checked["by_k"], thresholds)}
    for k, cell in checked["by_k"].items():
        log(
            f"gate K={k}: format-valid {cell['format_valid']:.2f}, searched K times {cell['searched_k']:.2f}, "
            f"searches {cell['searches']:.2f}, EM {cell['em']:.2f}"
        )
    if not checked["passed"] and not args.ungated:
        print(
            f"error: the warm start fails the gate ({gate_path}): every K needs format-valid >= "
            f"{thresholds['min_format_valid']} and searched K times >= {thresholds['min_searched_k']}; train it "
            "longer (STUDY['warm']['max_steps']): a warm start of other settings is trained and gated anew",
            file=sys.stderr,
        )
        return 2

    if args.gate_only:
        log(f"the warm start passed its gate ({gate_path}); stopped there (--gate_only)")
        return 0
    deadline = None if args.sample_minutes is None else time.time() + 60 * args.sample_minutes
    start = time.perf_counter()
    order = interleaved(rows)

    def score(chunk: list[dict]) -> list[dict]:
        sampled = sampled_groups(model, tokenizer, retriever, chunk, study)
        return [
            {"scripted": scripted_group(model, tokenizer, retriever, row, study), "sampled": s}
            for row, s in zip(chunk, sampled)
        ]

    groups = scored_phase(out / f"groups_{digest}.jsonl", order, score, log, "scored", deadline)
    scripted = {i: g["scripted"] for i, g in groups.items()}
    sampled = {i: g["sampled"] for i, g in groups.items()}
    timed("scored", start)

    start = time.perf_counter()
    figures = study_figures(rows, scripted, sampled, study, tokenizer)
    timed("figures", start)
    complete = len(scripted) == len(sampled) == len(order)
    summary = {
        "command": command,
        "study": study,
        "variants": {name: {k: v for k, v in fields.items()} for name, fields in VARIANTS.items()},
        "default_variant": DEFAULT_VARIANT,
        "targets": TARGETS,
        "best_variant": best_variant(figures),
        "questions_per_k": study["questions"],
        "complete": complete,
        "warm_start": warm_stats,
        "gate": checked,
        "figures": figures,
        "seconds": phases,
        "artifacts": artifact_sha256(out, digest),
        "machine": {
            **_machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
    }
    target.mkdir(parents=True, exist_ok=True)
    name = "credit_study" if checked["passed"] else "credit_study_ungated"
    (target / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, target / f"{name}.png")
    best = best_variant(figures)
    line = " | ".join(
        f"K={k}: {v} AUC {_auc(figures[k]['variants'][v]):.3f} FP {_fp(figures[k]['variants'][v]):.3f}"
        for k in figures
        for v in dict.fromkeys((best, DEFAULT_VARIANT))
    )
    log(f"credit study (sampled groups): {line}; {sum(phases.values()) / 60:.1f} min; wrote {target}/{name}.*")
    if args.expect:
        differ = rebuild_mismatches(summary, json.loads(Path(args.expect).read_text()))
        if differ:
            print(f"error: the rebuild differs from {args.expect} in {', '.join(differ)}", file=sys.stderr)
            return 1
        log(f"the rebuild equals {args.expect} (figures, gate, recorded sha256)")
    return 0


def artifact_sha256(out: Path, digest: str) -> dict[str, str | None]:
    """The sha256 of the study's raw outputs in ``out`` (not in git): the scored groups and the warm start's LoRA
    adapter of warm start ``digest``; None for one that is absent."""
    import hashlib

    names = [f"groups_{digest}.jsonl", f"warm_{digest}/adapter_model.safetensors"]
    return {n: hashlib.sha256((out / n).read_bytes()).hexdigest() if (out / n).is_file() else None for n in names}


def rebuild_mismatches(summary: dict, expected: dict) -> list[str]:
    """What a rebuilt summary differs in from ``expected`` (a committed one): the figures, the gate's episodes, and
    each raw output's sha256 that ``expected`` records (`artifact_sha256`).

    >>> rebuild_mismatches({"figures": {"2": 1}, "artifacts": {"a": "x"}}, {"figures": {"2": 1}, "artifacts": {"a": "y"}})
    ['artifacts.a']
    >>> rebuild_mismatches({"figures": {"2": 1}}, {"figures": {"2": 2}, "gate": {"by_k": {"2": {}}}})
    ['figures', 'gate']
    """
    parts = {"figures": lambda x: x.get("figures"), "gate": lambda x: (x.get("gate") or {}).get("by_k")}
    out = [name for name, part in parts.items() if name in expected and part(summary) != part(expected)]
    ours = summary.get("artifacts") or {}
    out += [f"artifacts.{n}" for n, sha in (expected.get("artifacts") or {}).items() if sha and ours.get(n) != sha]
    return out


def best_variant(figures: dict) -> str:
    """The variant that credits best: of those meeting both `TARGETS` at every K, the lowest worst-K false-positive
    share (then the highest worst-K AUC); the highest worst-K AUC when none meets them.

    >>> cell = lambda auc, fp: {"sampled": {"auc": {"value": auc}, "false_positive": {"value": fp}}}
    >>> best_variant({"2": {"variants": {"a": cell(1.0, 0.4), "b": cell(0.95, 0.02), "c": cell(0.8, 0.0)}}})
    'b'
    >>> best_variant({"2": {"variants": {"a": cell(1.0, 0.4), "c": cell(0.8, 0.4)}}})
    'a'
    """
    worst = {}  # variant -> (worst-K false-positive share, worst-K AUC)
    for v in next(iter(figures.values()))["variants"]:
        cells = [figures[k]["variants"][v] for k in figures]
        worst[v] = max(_fp(c) for c in cells), min(_auc(c) for c in cells)
    meeting = [v for v, (fp, auc) in worst.items() if fp <= TARGETS["false_positive"] and auc >= TARGETS["auc"]]
    if meeting:
        return min(meeting, key=lambda v: (worst[v][0], -worst[v][1]))
    return max(worst, key=lambda v: worst[v][1])


def _auc(cell: dict) -> float:
    """The sampled groups' AUC of a variant's cell (the scripted groups' when none was sampled); NaN when none."""
    part = cell.get("sampled") or cell.get("scripted") or {}
    return (part.get("auc") or {}).get("value", float("nan"))


def _fp(cell: dict) -> float:
    part = cell.get("sampled") or cell.get("scripted") or {}
    return (part.get("false_positive") or {}).get("value", float("nan"))


if __name__ == "__main__":
    sys.exit(main())
