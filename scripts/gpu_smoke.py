"""vLLM-free GPU smoke test, one stage per call (driven by scripts/gpu_smoke.sh, which adds a timeout per stage).

    python scripts/gpu_smoke.py STAGE WORK_DIR [--cpu]

Stages (each prints one JSON line ``{"stage", "ok", ...}`` and exits 0 when ``ok``):

- ``retriever``: build and query the BM25 retriever in a process where bm25s is not yet imported: the device's free
  memory must not drop (bm25s starts JAX when it is installed, which preallocates 75% of the GPU; `mempo_trl`
  imports bm25s with JAX hidden); reports whether JAX is installed.
- ``model``: build the offline tiny model with head_dim 32 (hidden 128, 4 heads) into ``WORK_DIR/model``.
- ``scoring``: memory scoring of scripted 4-round episodes in bf16 on CUDA, shared-prefix vs batched: the two schemes
  must agree (answer log-probs within ``0.1``, the bf16 rounding of two different kernels).
- ``lora``: 3 MemPO steps with LoRA and gradient checkpointing in bf16, on scripted 4-round turns: finite loss,
  3 steps, and LoRA's B matrices (zero at the start) have moved, so gradients flow through the checkpointed forward.
- ``vllm_emulation``: 2 MemPO steps through TRL's `VLLMGeneration` (colocate) on the fake engine of
  ``tests/fake_vllm.py``, whose log-probs come from a synced fp32 copy of the model: TRL's importance-sampling ratio
  must be ~1 (rows and tokens aligned over rounds >= 2), one weight sync per step.
- ``zero3``: 2 steps of ``mempo-trl train`` under DeepSpeed ZeRO-3 with one process (accelerate launch).
- ``qwen``: Qwen2.5's real tokenizer and 151,936-row vocabulary (`mempo_trl.kit.qwen`, hidden 256) in bf16: the
  scoring agreement above on scripted 4-round episodes, then 2 MemPO steps whose turns are those scripted turns
  (multi-token tags: rows, ``<mem>`` spans and P_full / P_mem scored on the device; every episode 4 rounds, EM 1).
- ``quickstart``: the README quick start (``mempo-trl kit learner``, then ``mempo-trl train --config
  examples/configs/quickstart_cpu.yaml``) in ``WORK_DIR`` on the device (fp32, as the
  recipe): its held-out EM line must rise; reports the wall time.
- ``realsize`` (not in the default list; ``GPU_SMOKE_STAGES=realsize``): Qwen2.5-1.5B and -7B shapes (random weights,
  the real tokenizer and vocabulary, bf16, activation checkpointing), LoRA and full fine-tuning, 4 and 8 rounds
  (``GPU_SMOKE_REALSIZE="qwen2.5-7b:lora:8 ..."`` picks configurations), each in its own process (`realsize_one`):
  peak memory against `REALSIZE_BUDGET_GIB`, warm step time split, memory scoring share, one real generation round.

``--cpu`` runs the same stages on the CPU in fp32 (a dry run of the script, minutes on a laptop).
"""

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch


ROOT = Path(__file__).resolve().parents[1]


def _setup(cpu: bool):
    if not cpu and not torch.cuda.is_available():
        raise SystemExit(json.dumps({"ok": False, "error": "no CUDA device (use --cpu for a dry run)"}))
    return ("cpu", torch.float32) if cpu else ("cuda", torch.bfloat16)


def _load(work: Path, device: str, dtype):
    from mempo_trl.kit.tiny import load_tiny

    model, tokenizer = load_tiny(work / "model")
    return model.to(device=device, dtype=dtype), tokenizer


def _common_args(work: Path, cpu: bool, steps: int) -> dict:
    return {
        "output_dir": str(work / "run"),
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_completion_length": 32,
        "max_turns": 4,
        "max_steps": steps,
        "learning_rate": 1e-4,
        "use_cpu": cpu,
        "bf16": not cpu,
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
    }


def stage_model(work: Path, cpu: bool) -> dict:
    from mempo_trl.kit.tiny import build_tiny_model

    build_tiny_model(work / "model", seed=0, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
    config = json.loads((work / "model" / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    return {"ok": head_dim >= 32, "head_dim": head_dim}


def stage_retriever(work: Path, cpu: bool) -> dict:
    import importlib.util

    device, _ = _setup(cpu)
    if "bm25s" in sys.modules:
        return {"ok": False, "error": "bm25s was imported before the stage began"}
    free = (lambda: torch.cuda.mem_get_info()[0]) if device == "cuda" else (lambda: 0)
    if device == "cuda":
        torch.zeros(1, device=device)  # this process's own CUDA context first
    before = free()
    from mempo_trl.kit.demo_world import demo_paths
    from mempo_trl.retrieval import BM25Retriever

    retriever = BM25Retriever.from_corpus(demo_paths().corpus, cache_dir=work / "bm25")
    hits = retriever.search(["where did Dethbre Leinhenmor die"], topk=3)[0]
    after = free()
    import bm25s

    drop_gib = (before - after) / 2**30
    jax_started = bool(bm25s.selection.JAX_IS_AVAILABLE)
    ok = len(hits) == 3 and drop_gib < 0.5 and not jax_started
    return {
        "ok": ok,
        "jax_installed": importlib.util.find_spec("jax") is not None,
        "bm25s_started_jax": jax_started,
        "free_gib_before": round(before / 2**30, 2),
        "free_gib_after": round(after / 2**30, 2),
    }


def stage_scoring(work: Path, cpu: bool) -> dict:
    from bench_memory_scoring import demo_rows, play_episodes

    from mempo_trl.kit.demo_world import demo_paths
    from mempo_trl.retrieval import BM25Retriever

    device, dtype = _setup(cpu)
    model, tokenizer = _load(work, device, dtype)
    episodes = play_episodes(tokenizer, BM25Retriever.from_corpus(demo_paths().corpus), demo_rows(8), 4, 64, 32)
    return {**_agreement(model, tokenizer, episodes), "dtype": str(dtype)}


def _agreement(model, tokenizer, episodes) -> dict:
    """Answer log-probs of every P_full item, batched vs shared-prefix: same mask, within bf16 rounding."""
    from mempo_trl.memory import answer_probability
    from mempo_trl.rollout import memory_scoring_items
    from mempo_trl.scoring import answer_token_logps, shared_prefix_answer_logps

    keys, items = [], []
    for e, ep in enumerate(episodes):
        for pair in memory_scoring_items(ep, tokenizer):
            keys.append(e)
            items.append(pair.full)
    batched, mask = answer_token_logps(model, items, tokenizer.pad_token_id)
    shared, shared_mask = shared_prefix_answer_logps(model, items, keys, tokenizer.pad_token_id)
    diff = float((batched - shared).abs().max())
    p_diff = float(
        (answer_probability(batched, mask, None) - answer_probability(shared, shared_mask, None)).abs().max()
    )
    ok = torch.equal(mask, shared_mask) and diff < 0.1 and bool(torch.isfinite(shared).all())
    return {"ok": ok, "items": len(items), "max_abs_logp_diff": diff, "max_abs_p_diff": p_diff}


def _scripted_trainer(
    model, tokenizer, retriever, work: Path, cpu: bool, steps: int, turn_tokens: int, rounds: int = 4, **config
):
    """A MemPOTrainer on the 8 first demo questions whose turns are scripted ``rounds``-round turns of ``turn_tokens``
    tokens (`bench_memory_scoring.ScriptedPolicy`): a random model's own turns are invalid, so they would leave every
    advantage, and the loss's gradient, at zero. No confidence filter: a random model's P is far below 0.5.
    ``config``: more `MemPOConfig` fields (they win over the defaults), ``peft_config`` and ``callbacks``."""
    from bench_memory_scoring import ScriptedPolicy, demo_rows
    from datasets import Dataset

    from mempo_trl import MemPOConfig, MemPOTrainer, mempo_format_reward, mempo_outcome_reward

    rows = demo_rows(8)
    peft_config = config.pop("peft_config", None)
    callbacks = config.pop("callbacks", None)
    common = {
        **_common_args(work, cpu, steps),
        "max_completion_length": turn_tokens,
        "memory_threshold": None,
        "max_turns": rounds,
    }
    trainer = MemPOTrainer(
        model,
        retriever,
        reward_funcs=[mempo_outcome_reward, mempo_format_reward],
        args=MemPOConfig(**{**common, **config}),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=callbacks,
    )
    policy = ScriptedPolicy(tokenizer, rows, rounds=rounds, turn_tokens=turn_tokens, mem_tokens=32)
    trainer._generate_single_turn = lambda prompt_ids, *args, **kwargs: policy(prompt_ids)
    return trainer


def stage_lora(work: Path, cpu: bool) -> dict:
    from peft import LoraConfig

    from mempo_trl.kit.demo_world import demo_paths
    from mempo_trl.retrieval import BM25Retriever

    device, dtype = _setup(cpu)
    model, tokenizer = _load(work, device, dtype)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    retriever = BM25Retriever.from_corpus(demo_paths().corpus)
    trainer = _scripted_trainer(
        model, tokenizer, retriever, work, cpu, 3, 64, activation_checkpointing=True, peft_config=lora
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    # LoRA's B matrices start at zero: they move only if gradients flow through the checkpointed bf16 forward.
    lora_b = [p for name, p in trainer.model.named_parameters() if "lora_B" in name]
    moved = max(float(p.detach().abs().max()) for p in lora_b)
    ok = trainer.state.global_step == 3 and all(math.isfinite(x) for x in losses) and moved > 0
    return {"ok": ok, "steps": trainer.state.global_step, "losses": losses, "lora_b_max_abs": moved}


def stage_vllm_emulation(work: Path, cpu: bool) -> dict:
    import fake_vllm
    from datasets import Dataset

    from mempo_trl import MemPOConfig, MemPOTrainer
    from mempo_trl.retrieval import Passage

    class Retriever:
        def search(self, queries, topk):
            return [[Passage(id=q, title=q, text=f"about {q}")] for q in queries]

    os.environ.update(fake_vllm.colocate_env())
    device, dtype = _setup(cpu)
    fake_vllm.install(work / "model")
    model, tokenizer = _load(work, device, dtype)
    args = MemPOConfig(**_common_args(work, cpu, steps=2), use_vllm=True, vllm_mode="colocate")
    dataset = Dataset.from_list([{"question": f"Q{k} where?", "golden_answers": [f"A{k}"]} for k in (2, 3, 1, 3)])
    trainer = MemPOTrainer(model, Retriever(), args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    ratios = [entry["sampling/importance_sampling_ratio/mean"] for entry in steps]
    deltas = [entry["sampling/sampling_logp_difference/mean"] for entry in steps]
    syncs = fake_vllm.engine_of(trainer).counters.syncs
    tolerance = 1e-4 if cpu else 5e-2  # fp32 vs fp32, or bf16 trainer vs fp32 engine
    ok = (
        len(steps) == 2 and syncs == 2 and all(abs(r - 1) < tolerance for r in ratios) and max(deltas) < 10 * tolerance
    )
    return {"ok": ok, "is_ratio_mean": ratios, "logp_difference_mean": deltas, "weight_syncs": syncs}


def stage_zero3(work: Path, cpu: bool) -> dict:
    from mempo_trl.kit.demo_world import demo_paths

    config = "cpu_zero3.yaml" if cpu else "zero3.yaml"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "accelerate_configs" / config),
        "--num_processes",
        "1",
        str(ROOT / "examples" / "train_mempo.py"),
        "--config",
        str(ROOT / "examples" / "configs" / "tiny_cpu.yaml"),
        "--model_name_or_path",
        str(work / "model"),
        "--output_dir",
        str(work / "zero3"),
        "--dataset_name",
        str(demo_paths().train.parent),
        "--corpus",
        str(demo_paths().corpus),
        "--use_cpu",
        str(cpu).lower(),
        "--bf16",
        str(not cpu).lower(),
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
        "--heldout_questions",
        "0",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    tail = (result.stdout + result.stderr)[-1500:]
    ok = result.returncode == 0 and "DEEPSPEED" in result.stdout + result.stderr
    return {"ok": ok, "returncode": result.returncode, **({} if ok else {"tail": tail})}


def stage_qwen(work: Path, cpu: bool) -> dict:
    from bench_memory_scoring import demo_rows, play_episodes
    from transformers import Qwen2ForCausalLM

    from mempo_trl.kit.demo_world import demo_paths
    from mempo_trl.kit.qwen import build_qwen2_5_model
    from mempo_trl.loading import load_tokenizer
    from mempo_trl.retrieval import BM25Retriever

    device, dtype = _setup(cpu)
    dims = {"hidden_size": 256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512}
    path = build_qwen2_5_model(work / "qwen", seed=0, **dims)
    tokenizer = load_tokenizer(path)
    model = Qwen2ForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    retriever, rows = BM25Retriever.from_corpus(demo_paths().corpus), demo_rows(8)
    agreement = _agreement(model, tokenizer, play_episodes(tokenizer, retriever, rows, 4, 96, 32))

    trainer = _scripted_trainer(model, tokenizer, retriever, work, cpu, steps=2, turn_tokens=96)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    ok = (
        agreement["ok"]
        and len(logs) == 2
        and all(math.isfinite(e["loss"]) and e["episode/turns"] == 4 and e["episode/em"] == 1 for e in logs)
        and all(e["memory/scored_rounds"] == 3 * trainer.args.per_device_train_batch_size for e in logs)
        and all(0 < e["memory/p_full"] < 1 and 0 < e["memory/p_mem"] < 1 for e in logs)
    )
    keep = ("loss", "episode/turns", "episode/em", "memory/scored_rounds", "memory/p_full", "memory/p_mem")
    return {**agreement, "ok": ok, "dtype": str(dtype), "steps": [{k: e[k] for k in keep} for e in logs]}


# Peak-memory budget (GiB, `torch.cuda.max_memory_allocated`) of each real-size configuration: the GPU class it must
# fit on (24 / 40 / 80 GiB), with room for the CUDA context and fragmentation. Rounds 4 and 8 share a budget.
REALSIZE_BUDGET_GIB = {
    ("qwen2.5-1.5b", "lora"): 20,
    ("qwen2.5-1.5b", "full"): 20,
    ("qwen2.5-7b", "lora"): 36,
    ("qwen2.5-7b", "full"): 72,
}
REALSIZE_GPU = " ".join(
    f"{shape}:{mode}:{rounds}"
    for shape in ("qwen2.5-1.5b", "qwen2.5-7b")
    for mode in ("lora", "full")
    for rounds in (4, 8)
)
REALSIZE_CPU = "dry-run:lora:2 dry-run:full:2"


def stage_realsize(work: Path, cpu: bool) -> dict:
    """Every configuration of ``$GPU_SMOKE_REALSIZE`` (``shape:mode:rounds``, default `REALSIZE_GPU`, or
    `REALSIZE_CPU` with ``--cpu``) in its own process (`realsize_one`), so that each starts from an empty device."""
    configs = os.environ.get("GPU_SMOKE_REALSIZE") or (REALSIZE_CPU if cpu else REALSIZE_GPU)
    results = []
    for config in configs.split():
        cmd = [sys.executable, __file__, "realsize_one", str(work), config, *(["--cpu"] if cpu else [])]
        result = subprocess.run(cmd, capture_output=True, text=True)
        lines = result.stdout.strip().splitlines()
        try:
            report = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            report = {"ok": False, "error": f"exit {result.returncode}: {(result.stdout + result.stderr)[-1500:]}"}
        results.append({"config": config, **{k: v for k, v in report.items() if k != "stage"}})
        print(json.dumps(results[-1]), file=sys.stderr)
    return {"ok": bool(results) and all(r["ok"] for r in results), "configs": results}


def realsize_one(work: Path, config: str, cpu: bool) -> dict:
    """One real-size configuration: a random model of a released Qwen2.5 shape with the real tokenizer and its
    151,936-row vocabulary, built on the device in bf16 (fp32 on the CPU), activation checkpointing, LoRA (r 16,
    all-linear) or full fine-tuning, 16 trajectories (8 questions x G=2) of scripted ``rounds``-round turns of 96
    tokens (the CPU dry run: 2 trajectories, 1 timed step). One warm-up step, then 2 timed steps: peak memory, step time split (memory scoring, loss forward+backward,
    optimizer, the rest of batch preparation), scoring share, and the time of one real forced-length ``generate`` of
    a round (16 prompts x 96 tokens), which scripted steps do not pay. Fails on a non-finite loss or a peak over
    `REALSIZE_BUDGET_GIB`."""
    import statistics

    from bench_train_step import Clock, StepTimer, qwen2_5_shaped, wiki_length_retriever
    from peft import LoraConfig

    from mempo_trl.kit.qwen import build_qwen2_5_tokenizer

    shape, mode, rounds = config.split(":")
    rounds = int(rounds)
    device, dtype = _setup(cpu)
    tokenizer = build_qwen2_5_tokenizer()
    model = qwen2_5_shaped(shape, tokenizer, device, dtype)
    params = sum(p.numel() for p in model.parameters())
    lora = (
        LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM") if mode == "lora" else None
    )
    clock = Clock(device)
    trainer_ref: list = []
    timer = StepTimer(clock, trainer_ref)
    steps, trajectories = (2, 2) if cpu else (3, 16)  # the CPU dry run: 1 warm step, 1 question
    trainer = _scripted_trainer(
        model,
        tokenizer,
        wiki_length_retriever(0, work),
        work,
        cpu,
        steps,
        96,
        rounds=rounds,
        per_device_train_batch_size=trajectories,
        activation_checkpointing=True,
        peft_config=lora,
        callbacks=[timer],
    )
    trainer_ref.append(trainer)
    for name, key in (
        ("_prepare_inputs", "prepare"),
        ("training_step", "training_step"),
        ("_memory_rewards", "scoring"),
    ):
        original = getattr(trainer, name)

        def timed(*args, _original=original, _key=key, **kwargs):
            with clock.measure(_key):
                return _original(*args, **kwargs)

        setattr(trainer, name, timed)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    warm = timer.steps[1:]
    split = {
        "step": statistics.median(s["step"] for s in warm),
        "memory_scoring": statistics.median(s.get("scoring", 0.0) for s in warm),
        "loss_fwd_bwd": statistics.median(s["training_step"] - s["prepare"] for s in warm),
        "optimizer": statistics.median(s["step"] - s["training_step"] for s in warm),
        "other_preparation": statistics.median(s["prepare"] - s.get("scoring", 0.0) for s in warm),
    }
    # One real round of generation at this size: the first round's 16 prompts, exactly 96 new tokens each.
    engine = trainer.rollout_engine
    questions = trajectories // 2
    prompts = [
        engine.fit_prompt(episode) for episode in engine.new_episodes(trainer.train_dataset.select(range(questions)))
    ]
    generation_round = _time_generate(trainer, prompts * 2, 96, clock)
    budget = REALSIZE_BUDGET_GIB.get((shape, mode))
    ok = (
        len(losses) == steps
        and all(math.isfinite(x) for x in losses)
        and all(entry["episode/turns"] == rounds for entry in trainer.state.log_history if "loss" in entry)
        and (peak is None or budget is None or peak <= budget)
    )
    return {
        "ok": ok,
        "parameters_b": round(params / 1e9, 3),
        "peak_gib": None if peak is None else round(peak, 2),
        "budget_gib": budget,
        "losses": losses,
        "warmup_step_s": round(timer.steps[0]["step"], 3),
        "warm_steps_s": [round(s["step"], 3) for s in warm],
        **{f"{k}_s": round(v, 3) for k, v in split.items()},
        "memory_scoring_share": round(split["memory_scoring"] / split["step"], 4),
        "generate_round_s": round(generation_round, 3),
    }


def _time_generate(trainer, prompts: list[list[int]], new_tokens: int, clock) -> float:
    """Seconds of one `generate` of ``new_tokens`` tokens (forced: min = max) for ``prompts``, TRL's HF path."""
    config = trainer.generation_config
    saved = config.max_new_tokens, config.min_new_tokens
    config.max_new_tokens = config.min_new_tokens = new_tokens
    original = type(trainer)._generate_single_turn
    trainer.model.eval()
    try:
        with clock.measure("generate_round"):
            original(trainer, prompts, None, {}, num_generations=1)
    finally:
        config.max_new_tokens, config.min_new_tokens = saved
        trainer.model.train()
    return clock.values["generate_round"]


def stage_quickstart(work: Path, cpu: bool) -> dict:
    kit = [sys.executable, "-m", "mempo_trl", "kit", "learner", "--output_dir", "kit/learner"]
    cmd = [
        sys.executable,
        "-m",
        "mempo_trl",
        "train",
        "--config",
        str(ROOT / "examples" / "configs" / "quickstart_cpu.yaml"),
        "--output_dir",
        str(work / "quickstart"),
        "--use_cpu",
        str(cpu).lower(),
        "--disable_tqdm",
        "true",
    ]
    start = time.perf_counter()
    subprocess.run(kit, capture_output=True, text=True, cwd=work, check=True)  # the README's two commands, in `work`
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
    seconds = time.perf_counter() - start
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "held-out EM" in line]
    em = [float(x) for x in re.findall(r"(\d\.\d+) (?:before|after)", lines[-1])] if lines else []
    ok = result.returncode == 0 and len(em) == 2 and em[1] > em[0]
    tail = {} if ok else {"tail": (result.stdout + result.stderr)[-1500:]}
    return {"ok": ok, "seconds": round(seconds, 1), "line": lines[-1] if lines else None, **tail}


STAGES = {
    "retriever": stage_retriever,
    "model": stage_model,
    "scoring": stage_scoring,
    "lora": stage_lora,
    "vllm_emulation": stage_vllm_emulation,
    "zero3": stage_zero3,
    "qwen": stage_qwen,
    "quickstart": stage_quickstart,
    "realsize": stage_realsize,
}


def main(argv: list[str]) -> int:
    cpu = "--cpu" in argv
    stage, work, *rest = [a for a in argv if a != "--cpu"]
    try:
        if stage == "realsize_one":
            report = realsize_one(Path(work), rest[0], cpu)
        else:
            report = STAGES[stage](Path(work), cpu)
    except Exception as error:  # noqa: BLE001 - the smoke reports every failure as one JSON line
        report = {"ok": False, "error": f"{type(error).__name__}: {error}"[-1500:]}
    print(json.dumps({"stage": stage, **report}))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
