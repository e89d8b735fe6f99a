"""One training step: MemPOTrainer vs TRL's GRPOTrainer with its built-in tool loop (full history), same workload.

Both trainers get the same random Qwen2 model (saved once, loaded fresh for each run), the same questions (demo train
set, G trajectories each), the same BM25 retriever (top-3 over the demo corpus) and play exactly the same number of
rounds with turns of exactly ``--turn-tokens`` tokens:

- generation is REAL: each trainer's `_generate_single_turn` is wrapped so that it runs the original method (HF
  ``generate``, sampling) with ``min_new_tokens = max_new_tokens = turn_tokens``, paying the real cost of generating
  that many tokens at that context length, and then returns scripted ids of the same length instead of the sampled
  ones (`bench_memory_scoring.ScriptedPolicy`): for MemPO ``<mem>..</mem><think>..</think><search>..</search>``
  (``<answer>`` in the last round); for the stock trainer the Qwen2.5 ``<tool_call>{"name": "search", ...}</tool_call>``
  turn that its `_tool_call_loop` parses (``<answer>`` in the last round);
- MemPO: ``max_turns = rounds``; its context is rebuilt every round (memory mode) and every round is a training row;
- stock: ``tools=[search]`` where ``search(query)`` calls the same retriever and returns the same rendered passages,
  ``max_tool_calling_iterations = rounds - 1``; the context (and the single training row) is the full history, and
  ``max_completion_length`` (its budget over ALL turns) is set high enough that no turn is cut (checked).

Each configuration runs ``--warmup-steps`` + ``--steps`` optimizer steps of `trainer.train()` on the same batch; the
warm-up steps (the first steps pay one-off costs: kernel selection, allocator growth, lazy initialisation) are
reported apart and left out of the table, which reports the median of the other steps and their parts, in wall seconds and in process CPU seconds (less sensitive to other jobs on the machine):
generation (the wrapped original `_generate_single_turn`), retrieval (MemPO's retriever calls; the stock trainer's
tool function), memory scoring (MemPO's `_memory_rewards`, what its ``time/memory_scoring`` metric times), loss
forward+backward (`training_step` minus `_prepare_inputs`), optimizer (the step minus `training_step`) and other
(the rest of `_prepare_inputs`: rewards, parsing, padding, logging). The bench's own scripting cost is excluded.
Run-time checks: every step plays exactly ``rounds`` generation calls, every trajectory ends on its gold answer
(reward 1, so no turn was cut), the stock trainer made ``trajectories x (rounds - 1)`` tool calls and generated
``rounds x turn_tokens`` tokens per trajectory, MemPO built ``trajectories x rounds`` training rows.

Workload options: ``--shape qwen2.5-1.5b`` (a random model with that released model's shape and Qwen2.5's real
tokenizer and 151,936-row vocabulary, built on the device; without it, a random Qwen2 of ``--hidden-size`` /
``--layers`` with the tiny tokenizer), ``--passage-words 100`` (every passage padded to wiki-length, ~100 words, with
`bench_context_tokens.wiki_length_corpus`), ``--generation paged`` (TRL's transformers continuous batching,
``use_transformers_continuous_batching``, for both trainers; ``hf`` is padded ``generate``), ``--grad-accum N``
(each step's trajectories go through the loss in N micro-batches, one optimizer step) and
``--activation-checkpointing``. ``--model-dir DIR`` runs a saved model instead of the random one, e.g. the real
SmolLM2-135M-Instruct of ``mempo-trl kit smollm2``; its tokenizer gets Qwen2.5's chat template (same ChatML
tokens) because TRL's tool loop only parses the tool calls of chat templates it knows, and both trainers render with
it. ``--json PATH`` writes the results with the command, versions, machine and load.

What each configuration costs against the stock step (the second table, one row per MemPO trainer and configuration):
the CPU-time, wall-time and FLOP ratios (``--flops``: the first warm-up step counted by `torch.utils.flop_counter`,
attention included, causal attention as half), the loss's forwarded tokens (every position the loss's forwards give
the model, padding and a shared prefix's pass included), the peak RSS (``--isolate``: each configuration in a process
of its own) and memory scoring's share of the step. ``--kinds`` picks the trainers (`KINDS`; ``shared_prefix_loss``
is MemPO with ``loss_forward="shared_prefix"``), ``--num-generations`` takes several G (``--questions`` questions x G
trajectories each), ``--before-src DIR`` also runs the MemPO kinds with the ``mempo_trl`` of another ``src`` directory
(main's, say), isolated, labelled ``before`` / ``after``, and ``--merge A.json B.json`` prints the tables of earlier
runs together. `bench/gpu_train_step.sh` is the GPU run, sized for one 10-minute call.

    python bench/bench_train_step.py                 # rounds 2/4/8, 4 trajectories, ~3 min on 2 cores
    python bench/bench_train_step.py --rounds 4 8 --trajectories 8 --steps 3
    # before (main's src) / after (this tree), one process per configuration, FLOPs, G 2 / 4 / 8 (bench/README.md)
    python bench/bench_train_step.py --rounds 4 8 --num-generations 2 4 8 --kinds stock shared_prefix \
        shared_prefix_loss --isolate --flops --before-src ../main/src --steps 1
    # the real SmolLM2 (mempo-trl kit smollm2 --output_dir kit/smollm2), one thread
    python bench/bench_train_step.py --model-dir kit/smollm2 --rounds 3 --steps 1 \
        --json bench/results/smollm2_step.json
    python bench/bench_train_step.py --device cuda --hidden-size 1024 --layers 8 --trajectories 8 --steps 3  # GPU
    # GPU, a realistic batch: >= 1B parameters, 128 trajectories, wiki-length passages, 8 rounds, batching engine
    python bench/bench_train_step.py --device cuda --shape qwen2.5-1.5b --trajectories 128 --num-generations 4 \
        --rounds 8 --passage-words 100 --generation paged --grad-accum 8 --activation-checkpointing --steps 2
"""

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
from bench_memory_scoring import MODEL_DIMS, ScriptedPolicy, demo_rows  # run as a script: bench/ is on sys.path
from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback

from mempo_trl.context import DEFAULT_SYSTEM_PROMPT, initial_messages, render_information
from mempo_trl.kit.demo_world import demo_paths
from mempo_trl.kit.tiny import build_tiny_model, qwen2_5_chat_template
from mempo_trl.loading import load_tokenizer
from mempo_trl.retrieval import BM25Retriever
from mempo_trl.rewards import exact_match  # noqa: E402


TOPK = 3
PHASES = ("generation", "retrieval", "memory_scoring", "loss_fwd_bwd", "optimizer", "other")
KINDS = {
    "stock": "GRPOTrainer + tools (full history)",
    "batched": "MemPO, batched",
    "shared_prefix": "MemPO, shared_prefix",
    "shared_prefix_loss": "MemPO, shared_prefix + shared-prefix loss",
}
"""The trainers the bench runs: TRL's tool loop, and MemPO by ``memory_scoring`` (and ``loss_forward``)."""
# Released Qwen2.5 shapes: hidden size, layers, attention heads, KV heads, MLP size, tied embeddings, embedding rows
# (the 7B config pads the vocabulary to 152,064). "dry-run" keeps Qwen2.5's vocabulary with a tiny body, for CPU dry
# runs of the real-size scripts.
QWEN2_5_SHAPES = {
    "dry-run": (64, 2, 2, 1, 128, True, 151936),
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864, True, 151936),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, True, 151936),
    "qwen2.5-3b": (2048, 36, 16, 2, 11008, True, 151936),
    "qwen2.5-7b": (3584, 28, 28, 4, 18944, False, 152064),
}


def qwen2_5_shaped(shape: str, tokenizer, device: str, dtype=torch.float32, seed: int = 0):
    """A random `Qwen2ForCausalLM` with the shape of a released Qwen2.5 model (`QWEN2_5_SHAPES`, embedding rows
    included), initialised directly on ``device`` in ``dtype`` with seed ``seed`` (the global RNG is left as is)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    hidden, layers, heads, kv_heads, intermediate, tied, vocab = QWEN2_5_SHAPES[shape]
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=32768,
        tie_word_embeddings=tied,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[torch.device(device)] if torch.device(device).type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def wiki_length_retriever(words: int, cache_dir: str | Path | None = None):
    """BM25 over the demo corpus with every passage padded to ``words`` words (the demo corpus itself at 0)."""
    if words <= 0:
        return BM25Retriever.from_corpus(demo_paths().corpus)
    import json

    from bench_context_tokens import wiki_length_corpus

    passages = [json.loads(line) for line in demo_paths().corpus.read_text(encoding="utf-8").splitlines()]
    path = Path(cache_dir or tempfile.mkdtemp(prefix="bench_step_corpus_")) / f"corpus_{words}w.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in wiki_length_corpus(passages, words)), encoding="utf-8")
    return BM25Retriever.from_corpus(path)


def count_cpu_attention_flops() -> None:
    """Teach `torch.utils.flop_counter` the CPU kernels of ``scaled_dot_product_attention`` (it knows the CUDA ones
    only), with its dense formulas; a causal call counts half (the kernel skips the masked blocks)."""
    from torch.utils import flop_counter

    aten = torch.ops.aten
    forward, backward = (
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_flash_attention_for_cpu_backward,
    )
    if forward in flop_counter.flop_registry:
        return

    def forward_flops(query, key, value, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs):
        flops = flop_counter.sdpa_flop_count(query, key, value)
        return flops // 2 if is_causal else flops

    def backward_flops(
        grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs
    ):
        flops = flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)
        return flops // 2 if is_causal else flops

    flop_counter.register_flop_formula(forward, get_raw=False)(forward_flops)
    flop_counter.register_flop_formula(backward, get_raw=False)(backward_flops)


class Clock:
    """Accumulated wall and CPU seconds (``key`` and ``key + "_cpu"``) and counts of one trainer run.

    On CUDA every reading waits for the device (``torch.cuda.synchronize``), so a phase owns its kernels.
    """

    def __init__(self, device: str = "cpu"):
        self.values = defaultdict(float)
        self.in_loss = False  # inside `training_step` but not `_prepare_inputs`: the loss forward and backward
        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    @contextmanager
    def measure(self, key: str):
        self.sync()
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.sync()
            self.values[key] += time.perf_counter() - wall
            self.values[key + "_cpu"] += time.process_time() - cpu

    def count(self, key: str, value: float = 1) -> None:
        self.values[key] += value

    def snapshot(self) -> dict:
        return dict(self.values)

    def since(self, snapshot: dict) -> dict:
        return {k: v - snapshot.get(k, 0.0) for k, v in self.values.items()}


class StepTimer(TrainerCallback):
    """Wall and CPU time of every optimizer step (on_step_begin -> on_step_end) and the clock deltas within it."""

    def __init__(self, clock: Clock, trainer_ref: list, count_flops: bool = False):
        self.clock = clock
        self.trainer_ref = trainer_ref
        self.steps: list[dict] = []
        self.flops = None
        self._counter = None
        self._count_flops = count_flops

    def on_step_begin(self, args, state, control, **kwargs):
        if self._count_flops and not self.steps:  # the first (warm-up) step: the same shapes as every other
            from torch.utils.flop_counter import FlopCounterMode

            count_cpu_attention_flops()
            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()
        self.clock.sync()
        self._snap = self.clock.snapshot()
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.sync()
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self.flops, self._counter = self._counter.get_total_flops(), None
        step = self.clock.since(self._snap)
        step["step"] = time.perf_counter() - self._wall
        step["step_cpu"] = time.process_time() - self._cpu
        metrics = self.trainer_ref[0]._metrics["train"]
        for name in ("episode/turns", "reward", "completions/max_length"):
            if metrics.get(name):
                step[name] = metrics[name][-1]
        self.steps.append(step)


class TimedRetriever:
    """MemPO's retriever, timed (the stock trainer's tool function is timed itself)."""

    def __init__(self, retriever, clock: Clock):
        self.retriever = retriever
        self.clock = clock

    def search(self, queries, topk):
        with self.clock.measure("retrieval"):
            return self.retriever.search(queries, topk)


def instrument(trainer, policy: ScriptedPolicy, turn_tokens: int, clock: Clock) -> None:
    """Wrap `_generate_single_turn` (real generation of exactly `turn_tokens` tokens, then the scripted ids),
    `_prepare_inputs`, `training_step` and, for MemPO, `_memory_rewards` with timers."""
    tokenizer = trainer._tokenizer
    original_generate = trainer._generate_single_turn
    original_prepare = trainer._prepare_inputs
    original_step = trainer.training_step

    config = trainer.generation_config
    config.max_new_tokens = config.min_new_tokens = turn_tokens
    if trainer.use_transformers_continuous_batching:
        # Continuous batching ends a request only on eos or its budget: no eos, so every turn runs to the budget, as
        # `min_new_tokens` makes `generate` do; MemPO's stop strings off, as the stock trainer has none.
        config.eos_token_id = -1
        trainer.continuous_batching_stops = None

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        with clock.measure("script"):
            scripted = [policy.turn(tokenizer.decode(p, skip_special_tokens=False)) for p in prompt_ids]
        with clock.measure("generation"):
            sampled, _ = original_generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        if any(len(ids) != turn_tokens for ids in sampled):
            raise AssertionError(f"generation did not produce exactly {turn_tokens} tokens per prompt")
        clock.count("generate_calls")
        clock.count("prefill_tokens", sum(len(p) for p in prompt_ids))
        return scripted, None

    def prepare(*args, **kwargs):
        clock.in_loss = False
        with clock.measure("prepare"):
            out = original_prepare(*args, **kwargs)
        clock.in_loss = True
        clock.count("loss_rows", out["completion_ids"].shape[0])
        clock.count("loss_tokens", out["prompt_ids"].numel() + out["completion_ids"].numel())
        return out

    def training_step(*args, **kwargs):
        clock.in_loss = True
        try:
            with clock.measure("training_step"):
                return original_step(*args, **kwargs)
        finally:
            clock.in_loss = False

    def count_loss_tokens(_module, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids")
        if clock.in_loss and ids is not None:
            clock.count("loss_forwarded_tokens", ids.numel())

    # every forward of the loss (padding included) reaches the backbone: count its input positions
    trainer.accelerator.unwrap_model(trainer.model).base_model.register_forward_pre_hook(
        count_loss_tokens, with_kwargs=True
    )

    trainer._generate_single_turn = generate
    trainer._prepare_inputs = prepare
    trainer.training_step = training_step
    if hasattr(trainer, "_memory_rewards"):
        original_memory = trainer._memory_rewards

        def memory_rewards(*args, **kwargs):
            with clock.measure("memory_scoring"):
                return original_memory(*args, **kwargs)

        trainer._memory_rewards = memory_rewards


def make_search_tool(retriever, clock: Clock):
    """The stock trainer's tool: the same retriever and the same rendered passages as MemPO's environment."""

    def search(query: str) -> str:
        """Search the knowledge base and return the top passages.

        Args:
            query: The search query.
        """
        with clock.measure("retrieval"):
            result = render_information(retriever.search([query], TOPK)[0])
        clock.count("tool_calls")
        return result

    return search


def answer_reward(completions, golden_answers, **kwargs):
    """Exact match of the last turn's ``<answer>`` (the stock trainer's outcome reward)."""
    scores = []
    for completion, golds in zip(completions, golden_answers):
        text = completion[-1].get("content", "") if completion else ""
        match = re.search(r"<answer>(.*?)</answer>", text or "", re.DOTALL)
        scores.append(exact_match(match.group(1) if match else None, golds))
    return scores


def _common_args(output_dir: str, cfg: dict) -> dict:
    if cfg["trajectories"] % cfg["grad_accum"]:
        raise ValueError(
            f"trajectories ({cfg['trajectories']}) must be a multiple of grad_accum ({cfg['grad_accum']})"
        )
    return {
        "output_dir": output_dir,
        "per_device_train_batch_size": cfg["trajectories"] // cfg["grad_accum"],
        "gradient_accumulation_steps": cfg["grad_accum"],
        "num_generations": cfg["num_generations"],
        "max_steps": cfg["warmup_steps"] + cfg["steps"],
        "learning_rate": 1e-5,
        "use_cpu": cfg["device"] == "cpu",
        "bf16": cfg["device"] == "cuda",  # fp32 weights, bf16 autocast: the GPU recipes' setting
        "activation_checkpointing": cfg["activation_checkpointing"],
        "use_transformers_continuous_batching": cfg["generation"] == "paged",
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        "seed": 0,
    }


def run_trainer(kind: str, model_dir: Path, rows: list[dict], retriever, rounds: int, cfg: dict) -> dict:
    """Train ``cfg['steps']`` steps with one trainer kind (`KINDS`)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from mempo_trl import MemPOConfig, MemPOTrainer

    if cfg.get("shape"):
        from mempo_trl.kit.qwen import build_qwen2_5_tokenizer

        tokenizer = build_qwen2_5_tokenizer()
        model = qwen2_5_shaped(cfg["shape"], tokenizer, cfg["device"])
    else:
        tokenizer = load_tokenizer(model_dir)
        if "<tool_call>" not in (tokenizer.chat_template or ""):  # a template TRL's tool loop cannot parse
            tokenizer.chat_template = qwen2_5_chat_template()
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    clock = Clock(cfg["device"])
    output_dir = tempfile.mkdtemp(prefix=f"bench_step_{kind}_")
    common = _common_args(output_dir, cfg)
    turn_tokens = cfg["turn_tokens"]
    trainer_ref: list = []
    timer = StepTimer(clock, trainer_ref, count_flops=cfg.get("count_flops", False) and cfg["warmup_steps"] > 0)
    if kind == "stock":
        policy = ScriptedPolicy(tokenizer, rows, rounds, turn_tokens, style="tool_call")
        dataset = Dataset.from_list(
            [{"prompt": initial_messages(r["question"]), "golden_answers": r["golden_answers"]} for r in rows]
        )
        # The budget over all turns: every turn plus every tool result, with room to spare (checked below).
        budget = rounds * turn_tokens + (rounds - 1) * 1024
        args = GRPOConfig(**common, max_completion_length=budget, max_tool_calling_iterations=rounds - 1)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[answer_reward],
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            tools=[make_search_tool(retriever, clock)],
            callbacks=[timer],
        )
    else:
        policy = ScriptedPolicy(tokenizer, rows, rounds, turn_tokens, cfg["mem_tokens"], style="mempo")
        dataset = Dataset.from_list([{"question": r["question"], "golden_answers": r["golden_answers"]} for r in rows])
        args = MemPOConfig(
            **common,
            max_completion_length=turn_tokens,
            max_turns=rounds,
            retrieval_topk=TOPK,
            memory_scoring=kind.removesuffix("_loss"),
            system_prompt=DEFAULT_SYSTEM_PROMPT,
            **({"loss_forward": "shared_prefix"} if kind == "shared_prefix_loss" else {}),
        )
        trainer = MemPOTrainer(
            model,
            TimedRetriever(retriever, clock),
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[timer],
        )
    trainer.remove_callback(PrinterCallback)  # keep stdout to the tables
    trainer_ref.append(trainer)
    instrument(trainer, policy, turn_tokens, clock)
    trainer.train()

    trajectories = cfg["trajectories"]
    warmup, timer.steps = timer.steps[: cfg["warmup_steps"]], timer.steps[cfg["warmup_steps"] :]
    for step in warmup + timer.steps:
        if step.get("generate_calls") != rounds:
            raise AssertionError(f"{kind}: {step.get('generate_calls')} generation calls in a step, wanted {rounds}")
        if kind == "stock" and step.get("tool_calls") != trajectories * (rounds - 1):
            raise AssertionError(f"{kind}: {step.get('tool_calls')} tool calls, wanted {trajectories * (rounds - 1)}")
        if step.get("reward") != 1.0:  # the scripted final answers are gold: every trajectory must end on one
            raise AssertionError(f"{kind}: mean outcome reward {step.get('reward')}, wanted 1 (a turn was cut?)")
        if kind == "stock" and step.get("completions/max_length") != rounds * turn_tokens:
            raise AssertionError(f"{kind}: {step.get('completions/max_length')} generated tokens per trajectory")
        if kind != "stock" and step.get("episode/turns") != rounds:
            raise AssertionError(f"{kind}: {step.get('episode/turns')} turns per episode, wanted {rounds}")
        if kind != "stock" and step.get("loss_rows") != trajectories * rounds:
            raise AssertionError(f"{kind}: {step.get('loss_rows')} training rows, wanted {trajectories * rounds}")
        for suffix in ("", "_cpu"):
            script = step.get("script" + suffix, 0.0)
            for phase in ("retrieval", "memory_scoring"):
                step.setdefault(phase + suffix, 0.0)
            step["loss_fwd_bwd" + suffix] = step["training_step" + suffix] - step["prepare" + suffix]
            step["optimizer" + suffix] = step["step" + suffix] - step["training_step" + suffix]
            step["other" + suffix] = (
                step["prepare" + suffix]
                - script
                - sum(step[p + suffix] for p in ("generation", "retrieval", "memory_scoring"))
            )
            step["step" + suffix] -= script  # the bench's scripting is not part of either trainer's step
    keys = [key + suffix for key in ("step", *PHASES) for suffix in ("", "_cpu")]
    median = {key: statistics.median(s[key] for s in timer.steps) for key in keys}
    last = timer.steps[-1]
    median.update(
        kind=kind,
        rounds=rounds,
        prefill_tokens=last["prefill_tokens"],
        loss_rows=last["loss_rows"],
        loss_tokens=last["loss_tokens"],
        loss_forwarded_tokens=last["loss_forwarded_tokens"],
        flops=timer.flops,
        num_generations=cfg["num_generations"],
        trajectories=trajectories,
        steps=[s["step"] for s in timer.steps],
        steps_cpu=[s["step_cpu"] for s in timer.steps],
        warmup_steps=[s["step"] for s in warmup],
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cfg["device"] == "cuda" else None,
    )
    if cfg["device"] == "cuda":
        torch.cuda.reset_peak_memory_stats()
    del trainer, model
    if cfg["device"] == "cuda":
        torch.cuda.empty_cache()
    return median


def run(
    rounds_list=(2, 4, 8),
    trajectories: int = 4,
    num_generations: int = 2,
    turn_tokens: int = 64,
    mem_tokens: int = 32,
    steps: int = 2,
    kinds=("stock", "batched", "shared_prefix"),
    dims: dict | None = None,
    model_dir: str | Path | None = None,
    device: str = "cpu",
    warmup_steps: int = 0,
    shape: str | None = None,
    passage_words: int = 0,
    generation: str = "hf",
    grad_accum: int = 1,
    activation_checkpointing: bool = False,
    count_flops: bool = False,
    isolate: bool = False,
    before_src: str | Path | None = None,
) -> list[dict]:
    """The bench's core: one result per (rounds, trainer kind, code); see `run_trainer`. ``warmup_steps`` more steps
    run first and are reported apart (``warmup_steps`` of each result), not in its medians; with ``count_flops`` the
    first warm-up step's FLOPs are counted (``flops``; `torch.utils.flop_counter`). ``isolate``: every configuration
    in a process of its own (`run_isolated`), which adds its peak RSS; ``before_src``: a ``src`` directory of another
    mempo_trl tree (e.g. main's) whose MemPO kinds also run, isolated, beside this tree's (``code``: ``before`` /
    ``after``; the stock trainer is TRL's either way and runs once)."""
    if trajectories % num_generations:
        raise ValueError("trajectories must be a multiple of num_generations")
    if generation not in ("hf", "paged"):
        raise ValueError(f"generation must be 'hf' or 'paged', got {generation!r}")
    if shape is not None and shape not in QWEN2_5_SHAPES:
        raise ValueError(f"unknown shape {shape!r}; use one of {sorted(QWEN2_5_SHAPES)}")
    model_dir = Path(model_dir or tempfile.mkdtemp(prefix="bench_step_model_"))
    if shape is None and not (model_dir / "config.json").exists():
        build_tiny_model(model_dir, seed=0, **(dims or MODEL_DIMS))
    cfg = {
        "trajectories": trajectories,
        "num_generations": num_generations,
        "turn_tokens": turn_tokens,
        "mem_tokens": mem_tokens,
        "steps": steps,
        "device": device,
        "warmup_steps": warmup_steps,
        "shape": shape,
        "generation": generation,
        "grad_accum": grad_accum,
        "activation_checkpointing": activation_checkpointing,
        "count_flops": count_flops,
        "passage_words": passage_words,
        "threads": torch.get_num_threads(),
    }
    codes = [("after", None)] + ([("before", str(before_src))] if before_src else [])
    results = []
    retriever = rows = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for rounds in rounds_list:
            for kind in kinds:
                for code, src in reversed(codes):  # before, then after
                    if code == "before" and kind in ("stock", "shared_prefix_loss"):
                        continue  # TRL's trainer does not change; the shared-prefix loss is new
                    if isolate or src:
                        result = run_isolated(kind, model_dir, rounds, cfg, src)
                    else:
                        if retriever is None:
                            retriever = wiki_length_retriever(passage_words)
                            rows = demo_rows(trajectories // num_generations)
                        result = run_trainer(kind, model_dir, rows, retriever, rounds, cfg)
                    result["code"] = "" if kind == "stock" or not before_src else code
                    results.append(result)
                    rss = result.get("peak_rss_mib")
                    print(
                        f"done: rounds {rounds} G {num_generations} {_label(result)}: step {result['step_cpu']:.2f} s "
                        f"CPU, memory scoring {result['memory_scoring_cpu']:.2f} s CPU, loss forwarded tokens "
                        f"{int(result['loss_forwarded_tokens']):,}"
                        + (f", peak RSS {rss:,.0f} MiB" if rss else "")
                        + f"; load average {os.getloadavg()[0]:.1f}",
                        file=sys.stderr,
                        flush=True,
                    )
    return results


def run_isolated(kind: str, model_dir: Path, rounds: int, cfg: dict, src: str | None = None) -> dict:
    """`run_trainer` in a new process (``src``: the ``mempo_trl`` source directory it imports, else this one's), with
    that process's peak RSS (``peak_rss_mib``) and its RSS high-water mark before the trainer is built
    (``base_rss_mib``: imports, data, retriever)."""
    import json
    import subprocess

    import mempo_trl

    src = str(Path(src or Path(mempo_trl.__file__).parents[1]).resolve())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(Path(__file__).resolve().parent)])}
    payload = json.dumps({"kind": kind, "model_dir": str(model_dir), "rounds": rounds, "cfg": cfg})
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", payload], env=env, capture_output=True, text=True
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("BENCH_RESULT ")]
    if done.returncode or not lines:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise RuntimeError(f"{kind} at {rounds} rounds (mempo_trl from {src}) failed with exit code {done.returncode}")
    result = json.loads(lines[-1].removeprefix("BENCH_RESULT "))
    result["src"] = src
    return result


def child(payload: str) -> None:
    """One `run_isolated` configuration: run it, print ``BENCH_RESULT <json>``."""
    import json
    import resource

    spec = json.loads(payload)
    cfg = spec["cfg"]
    torch.set_num_threads(cfg["threads"])
    retriever = wiki_length_retriever(cfg["passage_words"])
    rows = demo_rows(cfg["trajectories"] // cfg["num_generations"])
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_trainer(spec["kind"], Path(spec["model_dir"]), rows, retriever, spec["rounds"], cfg)
    result.update(base_rss_mib=base, peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print("BENCH_RESULT " + json.dumps(result))


def _label(r: dict) -> str:
    return KINDS[r["kind"]] + (f" ({r['code']})" if r.get("code") else "")


def ratios(results: list[dict]) -> list[dict]:
    """Each MemPO result against the stock result of the same rounds and G: CPU-time, wall-time and FLOP ratios,
    forwarded loss tokens, peak RSS (None where not measured), and memory scoring's share of the step (CPU)."""
    stock = {(r["rounds"], r["num_generations"]): r for r in results if r["kind"] == "stock"}

    def ratio(r, base, key):
        return r[key] / base[key] if r.get(key) and base.get(key) else None

    rows = []
    for r in results:
        base = stock.get((r["rounds"], r["num_generations"]))
        if r["kind"] == "stock" or base is None:
            continue

        rows.append(
            {
                "rounds": r["rounds"],
                "num_generations": r["num_generations"],
                "trainer": _label(r),
                "step_cpu": ratio(r, base, "step_cpu"),
                "step": ratio(r, base, "step"),
                "flops": ratio(r, base, "flops"),
                "loss_forwarded_tokens": ratio(r, base, "loss_forwarded_tokens"),
                "peak_rss": ratio(r, base, "peak_rss_mib"),
                "memory_scoring_share_cpu": r["memory_scoring_cpu"] / r["step_cpu"],
                "memory_scoring_share": r["memory_scoring"] / r["step"],
            }
        )
    return rows


def print_tables(results: list[dict]) -> None:
    print(
        "| rounds | G | trainer | step s | generation | retrieval | memory scoring | loss fwd+bwd | optimizer | other "
        "| step CPU s | CPU: generation | memory scoring | loss fwd+bwd | GFLOP | prefill tokens | loss rows x width "
        "| loss forwarded tokens | peak RSS MiB |"
    )
    print("|---:|---:|---|" + "---:|" * 16)
    for r in results:
        width = r["loss_tokens"] // max(r["loss_rows"], 1)
        flops = f"{r['flops'] / 1e9:.1f}" if r.get("flops") else ""
        rss = f"{r['peak_rss_mib']:,.0f}" if r.get("peak_rss_mib") else ""
        print(
            f"| {r['rounds']} | {r['num_generations']} | {_label(r)} | {r['step']:.2f} | "
            + " | ".join(f"{r[p]:.2f}" for p in PHASES)
            + f" | {r['step_cpu']:.2f} | "
            + " | ".join(f"{r[p + '_cpu']:.2f}" for p in ("generation", "memory_scoring", "loss_fwd_bwd"))
            + f" | {flops} | {int(r['prefill_tokens']):,} | {int(r['loss_rows'])} x {int(width)} "
            f"| {int(r.get('loss_forwarded_tokens', 0)):,} | {rss} |"
        )
    print()
    print(
        "| rounds | G | MemPO trainer | step / stock: CPU | wall | FLOPs | loss forwarded tokens / stock | peak RSS / stock "
        "| memory scoring % of step: CPU | wall |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")

    def cell(value, digits=2):
        return "" if value is None else f"{value:.{digits}f}"

    for row in ratios(results):
        print(
            f"| {row['rounds']} | {row['num_generations']} | {row['trainer']} | {cell(row['step_cpu'])} | "
            f"{cell(row['step'])} | {cell(row['flops'])} | {cell(row['loss_forwarded_tokens'])} | "
            f"{cell(row['peak_rss'])} | {100 * row['memory_scoring_share_cpu']:.1f}% | "
            f"{100 * row['memory_scoring_share']:.1f}% |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument(
        "--trajectories", type=int, help="trajectories per step (questions x G; default --questions x G)"
    )
    parser.add_argument("--questions", type=int, default=2, help="questions per step, when --trajectories is not set")
    parser.add_argument("--num-generations", type=int, nargs="+", default=[2], help="G (several: one sweep each)")
    parser.add_argument("--kinds", nargs="+", choices=list(KINDS), default=["stock", "batched", "shared_prefix"])
    parser.add_argument("--turn-tokens", type=int, default=64, help="tokens generated per turn (forced)")
    parser.add_argument("--mem-tokens", type=int, default=32, help="upper bound of MemPO's <mem> notes, in tokens")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per configuration; the median is shown")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (see bench/README.md)")
    parser.add_argument("--hidden-size", type=int, default=MODEL_DIMS["hidden_size"])
    parser.add_argument("--layers", type=int, default=MODEL_DIMS["num_layers"])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: bf16 autocast, synced timers")
    parser.add_argument("--warmup-steps", type=int, default=1, help="steps run first and reported apart (median-free)")
    parser.add_argument("--flops", action="store_true", help="count the FLOPs of the first warm-up step")
    parser.add_argument(
        "--isolate", action="store_true", help="one process per configuration; adds each one's peak RSS"
    )
    parser.add_argument(
        "--before-src",
        help="also run the MemPO kinds with the mempo_trl of this src directory (isolated): before/after",
    )
    parser.add_argument("--shape", choices=sorted(QWEN2_5_SHAPES), help="a Qwen2.5 shape with its real tokenizer")
    parser.add_argument(
        "--passage-words", type=int, default=0, help="pad every passage to this many words (wiki: 100)"
    )
    parser.add_argument("--generation", choices=("hf", "paged"), default="hf", help="paged: continuous batching")
    parser.add_argument(
        "--grad-accum", type=int, default=1, help="loss micro-batches per step (gradient accumulation)"
    )
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--model-dir", help="a saved model (e.g. `mempo-trl kit smollm2`) instead of a random one")
    parser.add_argument("--json", help="write the results, command, versions, machine and load to this file")
    parser.add_argument(
        "--merge", nargs="+", metavar="JSON", help="print (and with --json, write) the results of earlier --json runs"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)  # `run_isolated`'s process
    args = parser.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if args.child:
        child(args.child)
        return
    if args.merge:
        merge(args.merge, args.json, argv if argv is not None else sys.argv[1:])
        return
    torch.set_num_threads(args.threads)
    dims = {**MODEL_DIMS, "hidden_size": args.hidden_size, "num_layers": args.layers}
    start = time.perf_counter()
    model_dir = args.model_dir or tempfile.mkdtemp(prefix="bench_step_model_")
    results = []
    for g in args.num_generations:
        results += run(
            args.rounds,
            args.trajectories or args.questions * g,
            g,
            args.turn_tokens,
            args.mem_tokens,
            args.steps,
            kinds=tuple(args.kinds),
            dims=dims,
            device=args.device,
            warmup_steps=args.warmup_steps,
            shape=args.shape,
            passage_words=args.passage_words,
            generation=args.generation,
            grad_accum=args.grad_accum,
            activation_checkpointing=args.activation_checkpointing,
            model_dir=model_dir,
            count_flops=args.flops,
            isolate=args.isolate,
            before_src=args.before_src,
        )
    results.sort(key=lambda r: (r["rounds"], r["num_generations"]))  # stable: each configuration's trainers together
    precision = f"bf16 autocast on {torch.cuda.get_device_name()}" if args.device == "cuda" else "fp32 on the CPU"
    model = f"random {args.shape} shape, Qwen2.5 tokenizer" if args.shape else f"random Qwen2 {dims}, tiny tokenizer"
    if args.model_dir:
        model = f"{args.model_dir} (its weights and tokenizer, Qwen2.5's chat template)"
    passages = f"passages padded to {args.passage_words} words" if args.passage_words else "demo passages"
    engine = "continuous batching (paged)" if args.generation == "paged" else "HF generate"
    per_step = f"{args.trajectories} trajectories" if args.trajectories else f"{args.questions} questions x G"
    print(
        f"model: {model}, {precision}, sdpa; {per_step} per step (G = {', '.join(map(str, args.num_generations))}); "
        f"turns of exactly {args.turn_tokens} generated tokens (MemPO <mem> <= {args.mem_tokens} tokens) by "
        f"{engine}; BM25 top-{TOPK}, {passages}; loss dapo, beta 0, {args.grad_accum} micro-batch(es) per step, "
        f"activation checkpointing {'on' if args.activation_checkpointing else 'off'}; median of {args.steps} warm "
        f"steps after {args.warmup_steps} warm-up step(s); torch threads {args.threads}; torch {torch.__version__}, "
        f"Python {sys.version.split()[0]}"
        + (f"; before = mempo_trl from {args.before_src}, after = this tree" if args.before_src else "")
    )
    print()
    print_tables(results)
    print()
    for r in results:
        wall = ", ".join(f"{s:.2f}" for s in r["steps"])
        cpu = ", ".join(f"{s:.2f}" for s in r["steps_cpu"])
        warm = ", ".join(f"{s:.2f}" for s in r["warmup_steps"]) or "none"
        peak = f"; peak {r['peak_gib']:.1f} GiB allocated" if r["peak_gib"] is not None else ""
        print(
            f"rounds {r['rounds']} G {r['num_generations']} {_label(r)}: warm-up steps {warm} s; steps {wall} s "
            f"wall, {cpu} s CPU{peak}"
        )
    print(
        "wall seconds per step (median), the bench's scripting excluded; step CPU s = process CPU time of the step "
        "(robust to other jobs on the machine); GFLOP = FLOPs of the first warm-up step (torch.utils.flop_counter; "
        "matmuls and attention, causal attention counted half; --flops); prefill tokens = prompt tokens given to "
        "generate over all rounds; loss rows x width = the padded [prompt | completion] batch of the loss; loss "
        "forwarded tokens = positions the loss's forwards gave the model (padding and a shared prefix's pass "
        "included); peak RSS = the configuration's process high-water mark (--isolate)."
    )
    print(f"total bench time {time.perf_counter() - start:.1f} s; load average {os.getloadavg()[0]:.1f}")
    if args.json:
        write_json(args.json, results, argv if argv is not None else sys.argv[1:], time.perf_counter() - start)


def merge(paths: list[str], json_path: str | None, argv: list[str]) -> None:
    """The tables of the results of several ``--json`` reports, in their order (each report's commands, load averages
    and sources are kept under ``runs`` of the merged report)."""
    import json

    reports = [json.loads(Path(path).read_text(encoding="utf-8")) for path in paths]
    results = [r for report in reports for r in report["results"]]
    print_tables(results)
    for report in reports:
        print(f"{report['command']}: {report['seconds']:.0f} s, load average {report['load_average'][0]:.1f}")
    if json_path:
        write_json(json_path, results, argv, sum(report["seconds"] for report in reports))
        merged = json.loads(Path(json_path).read_text(encoding="utf-8"))
        merged["runs"] = [
            {key: report[key] for key in ("command", "seconds", "load_average", "sources")} for report in reports
        ]
        Path(json_path).write_text(json.dumps(merged, indent=1) + "\n", encoding="utf-8")


def _git_revision(src: str | None) -> str | None:
    import subprocess

    if not src:
        return None
    done = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or None


def write_json(path: str, results: list[dict], argv: list[str], seconds: float) -> None:
    """Write ``results`` with the ratios, the command, versions, machine and load average to ``path``."""
    import json
    import platform

    import transformers
    import trl

    import mempo_trl

    sources = sorted({r["src"] for r in results if r.get("src")})
    report = {
        "command": "python bench/bench_train_step.py " + " ".join(argv),
        "results": results,
        "ratios": ratios(results),
        "seconds": seconds,
        "sources": {src: _git_revision(src) for src in sources}
        or {str(Path(mempo_trl.__file__).parents[1]): _git_revision(str(Path(mempo_trl.__file__).parents[1]))},
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
        },
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}",
        "load_average": os.getloadavg(),
    }
    Path(path).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
