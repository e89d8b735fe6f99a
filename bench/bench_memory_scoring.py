"""Memory-scoring cost vs rounds: naive batched scoring of every round's full history vs the shared-prefix scheme.

MemPO scores ``log p(gold answer | full history before round t)`` for every round t >= 2 (P_full, docs/algorithm.md).
The naive scheme (`mempo_trl.scoring.answer_token_logps`, ``memory_scoring="batched"``) forwards each round's full
history as its own padded sequence, so a trajectory of N rounds costs O(N^2) context tokens. The shared-prefix scheme
(`shared_prefix_answer_logps`, ``memory_scoring="shared_prefix"``) forwards each trajectory's longest history once
into a KV cache, then one answer block per round over it behind a 4D attention mask: O(N) tokens, the same log-probs.

Scripted episodes of exactly N rounds are played on the demo world through the real `RolloutEngine` (memory context)
and BM25 retriever (top-3): every turn is ``<mem> [k] notes </mem>\\n<think> ... </think>\\n<search> hop query </search>``
(``<answer> gold </answer>`` in round N), exactly ``--turn-tokens`` tokens long, with a ``<mem>`` of at most
``--mem-tokens`` tokens (the question and the title + first sentence of every passage seen, newest kept). The
full-history contexts are then scored with both schemes on a randomly initialised Qwen2 model bigger than the test one.

    python bench/bench_memory_scoring.py                     # 16 trajectories, rounds 2/4/8, ~1-2 min on 2 cores
    python bench/bench_memory_scoring.py --rounds 2 4 8 16 --trajectories 32 --repeats 5

The scripted policy (`ScriptedPolicy`) is shared with `bench_train_step.py`.
"""

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from mempo_trl.data import read_jsonl
from mempo_trl.kit.demo_world import demo_paths
from mempo_trl.memory import answer_probability
from mempo_trl.protocol import TurnProtocol
from mempo_trl.retrieval import BM25Retriever
from mempo_trl.rollout import RolloutEngine, memory_scoring_items
from mempo_trl.scoring import (
    answer_token_logps,
    pack_shared_prefix,
    shared_prefix_answer_logps,
)


MODEL_DIMS = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512}
_QUESTION = re.compile(r"Question: (.*?)<\|im_end\|>", re.DOTALL)
_MARKER = re.compile(r"<(?:mem|think)> \[(\d+)\] (.*?) </(?:mem|think)>", re.DOTALL)
_DOC = re.compile(r"Doc \d+\(Title: (.*?)\) ([^.\n]*\.?)")


class ScriptedPolicy:
    """A stateless scripted agent: every turn is exactly ``turn_tokens`` token ids.

    It reads everything it needs from the prompt: the question (``Question: ...``), the round (the ``[k]`` marker of
    the last turn in the prompt) and the last ``<information>`` block. ``style="mempo"`` writes
    ``<mem> [k] notes </mem>\\n<think> filler </think>\\n<search> query </search>`` (``<answer> gold </answer>`` in the
    last round); ``style="tool_call"`` writes the Qwen2.5 tool-call turn that TRL's tool loop parses:
    ``<think> [k] filler </think>\\n<tool_call>\\n{"name": "search", ...}\\n</tool_call><|im_end|>`` and
    ``<think> [k] filler </think>\\n<answer> gold </answer><|im_end|>`` in the last round. The filler is one
    single-token word repeated to reach the length exactly.
    """

    def __init__(self, tokenizer, rows, rounds: int, turn_tokens: int, mem_tokens: int = 64, style: str = "mempo"):
        if style not in ("mempo", "tool_call"):
            raise ValueError(f"style must be 'mempo' or 'tool_call', got {style!r}")
        self.tokenizer = tokenizer
        self.rows = {row["question"]: row for row in rows}
        self.rounds = rounds
        self.turn_tokens = turn_tokens
        self.mem_tokens = mem_tokens
        self.style = style
        self.filler = next(ids[0] for word in (" step", " the", " a", " x") if len(ids := self._ids(word)) == 1)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _notes(self, question: str, previous: str, information: str) -> str:
        """The question and all passage notes so far, cut to the ``mem_tokens`` budget (newest kept)."""
        notes = previous.split(" || ") if previous else [f"Q: {question}"]
        notes += [f"{title}: {first}" for title, first in _DOC.findall(information)]
        ids = self._ids(" || ".join(notes))
        return self.tokenizer.decode(ids[-self.mem_tokens :]).strip()

    def turn(self, prompt_text: str) -> list[int]:
        """The scripted turn for a prompt given as text."""
        question = _QUESTION.search(prompt_text).group(1)
        row = self.rows[question]
        markers = list(_MARKER.finditer(prompt_text))
        last = markers[-1] if markers else None
        k = int(last.group(1)) + 1 if last else 1
        info = prompt_text.rsplit("<information>", 1)[1].split("</information>")[0] if k > 1 else ""
        final = k >= self.rounds
        if self.style == "mempo":
            notes = self._notes(question, last.group(2) if last else "", info)
            head = self._ids(f"<mem> [{k}] {notes} </mem>\n<think>")
            if final:
                tail = self._ids(f" </think>\n<answer> {row['golden_answers'][0]} </answer>")
            else:
                query = row["hop_queries"][(k - 1) % len(row["hop_queries"])]
                tail = self._ids(f" </think>\n<search> {query} </search>")
        else:
            head = self._ids(f"<think> [{k}]")
            if final:
                tail = self._ids(f" done </think>\n<answer> {row['golden_answers'][0]} </answer><|im_end|>")
            else:
                query = row["hop_queries"][(k - 1) % len(row["hop_queries"])]
                call = '{"name": "search", "arguments": {"query": "' + query.replace('"', "'") + '"}}'
                tail = self._ids(f" done </think>\n<tool_call>\n{call}\n</tool_call><|im_end|>")
        room = self.turn_tokens - len(head) - len(tail)
        if room < 0:
            raise ValueError(f"a turn needs {len(head) + len(tail)} tokens, more than turn_tokens={self.turn_tokens}")
        return head + [self.filler] * room + tail

    def __call__(self, prompts: list[list[int]]):
        """`mempo_trl.rollout.GenerateFn`: one scripted turn per prompt (token ids), no log-probs."""
        return [self.turn(self.tokenizer.decode(p, skip_special_tokens=False)) for p in prompts], None


def demo_rows(n: int) -> list[dict]:
    """The first ``n`` demo training questions (all have hop queries)."""
    rows = read_jsonl(demo_paths().train)
    if n > len(rows):
        raise ValueError(f"only {len(rows)} demo training questions, asked for {n}")
    return rows[:n]


def build_model(model_dir: str | Path, dims: dict | None = None):
    """Build (seed 0) and load the bench model: a random Qwen2 with the tiny tokenizer; eval mode, fp32, sdpa.

    A ``model_dir`` that already holds a model is loaded as is (``dims`` are then ignored).
    """
    from mempo_trl.kit.tiny import build_tiny_model, load_tiny

    if not (Path(model_dir) / "config.json").exists():
        build_tiny_model(model_dir, seed=0, **(dims or MODEL_DIMS))
    return load_tiny(model_dir)


def play_episodes(tokenizer, retriever, rows, rounds: int, turn_tokens: int, mem_tokens: int):
    """Scripted MemPO episodes of exactly ``rounds`` rounds (memory context, real retrieval, top-3)."""
    engine = RolloutEngine(tokenizer, TurnProtocol(max_turns=rounds, retrieval_topk=3), retriever)
    policy = ScriptedPolicy(tokenizer, rows, rounds, turn_tokens, mem_tokens)
    episodes = engine.play(rows, policy).episodes
    assert all(len(ep.rounds) == rounds and ep.format_valid for ep in episodes), "scripted episodes must be valid"
    return episodes


class _TokenCounter:
    """Forward pre-hook that sums ``input_ids.numel()`` (padding included) and counts forwards."""

    def __init__(self, model):
        self.tokens = 0
        self.forwards = 0
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.tokens += ids.numel()
        self.forwards += 1

    def close(self):
        self.handle.remove()


def _timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def measure_scoring(model, tokenizer, episodes, batch_size: int = 8, repeats: int = 3) -> dict:
    """Score the full-history contexts of ``episodes`` with both schemes: tokens, median times, P differences.

    Every timed run also counts the tokens forwarded (a forward pre-hook on the model). The naive scheme is
    `answer_token_logps` (`memory_scoring="batched"`, which batches contexts of similar length). The mem contexts (scored the same way by both trainer modes) are only counted.
    """
    keys, full, mem = [], [], []
    for e, ep in enumerate(episodes):
        for pair in memory_scoring_items(ep, tokenizer):
            keys.append(e)
            full.append(pair.full)
            mem.append(pair.mem)
    pad_id = tokenizer.pad_token_id
    rows = pack_shared_prefix(full, keys)
    out = {
        "items": len(full),
        "naive_real_tokens": sum(len(it.context_ids) + len(it.answer_ids) for it in full),
        "shared_real_tokens": sum(len(p) + sum(len(full[i].answer_ids) for i in idx) for p, idx in rows),
        "shared_rows": len(rows),
        "mem_real_tokens": sum(len(it.context_ids) + len(it.answer_ids) for it in mem),
    }
    schemes = [
        ("naive", lambda: answer_token_logps(model, full, pad_id, batch_size)),
        ("shared", lambda: shared_prefix_answer_logps(model, full, keys, pad_id, batch_size)),
    ]
    for name, fn in schemes:
        counter = _TokenCounter(model)
        try:
            out[f"{name}_s"], out[f"{name}_result"] = _timed(fn, repeats)
        finally:
            counter.close()
        out[f"{name}_padded_tokens"] = counter.tokens // repeats
        out[f"{name}_forwards"] = counter.forwards // repeats
    (naive, naive_mask), (shared, shared_mask) = out.pop("naive_result"), out.pop("shared_result")
    if not torch.equal(naive_mask, shared_mask):
        raise AssertionError("the two schemes disagree on the gold-answer mask")
    out["max_abs_logp_diff"] = float((naive - shared).abs().max())
    p_naive, p_shared = answer_probability(naive, naive_mask, None), answer_probability(shared, shared_mask, None)
    out["p_naive"], out["p_shared"] = p_naive, p_shared
    out["max_abs_p_diff"] = float((p_naive - p_shared).abs().max())
    out["max_rel_p_diff"] = float(((p_naive - p_shared).abs() / p_naive.abs().clamp(min=1e-30)).max())
    return out


def run(
    rounds_list=(2, 4, 8),
    trajectories: int = 8,
    turn_tokens: int = 64,
    mem_tokens: int = 32,
    batch_size: int = 8,
    repeats: int = 3,
    dims: dict | None = None,
    model_dir: str | Path | None = None,
) -> list[dict]:
    """The bench's core: one result dict per round count (see `measure_scoring`), plus ``rounds``."""
    model_dir = model_dir or tempfile.mkdtemp(prefix="bench_scoring_")
    model, tokenizer = build_model(model_dir, dims)
    retriever = BM25Retriever.from_corpus(demo_paths().corpus)
    rows = demo_rows(trajectories)
    results = []
    for rounds in rounds_list:
        episodes = play_episodes(tokenizer, retriever, rows, rounds, turn_tokens, mem_tokens)
        with torch.no_grad():
            result = measure_scoring(model, tokenizer, episodes, batch_size, repeats)
        result["rounds"] = rounds
        result["params"] = sum(p.numel() for p in model.parameters())
        result["peak_context"] = max(len(r.prompt_ids) for ep in episodes for r in ep.rounds)
        result["full_context_at_last_round"] = statistics.mean(
            len(it.full.context_ids) for ep in episodes for it in memory_scoring_items(ep, tokenizer)[-1:]
        )
        results.append(result)
    return results


def print_table(results: list[dict]) -> None:
    print(
        "| rounds | scored rounds | naive tokens: real / forwarded (forwards) | shared-prefix tokens: real / forwarded "
        "(forwards) | forwarded-token ratio | naive s | shared-prefix s | speed-up | max abs P diff | max rel P diff "
        "| max abs log p diff |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['rounds']} | {r['items']} "
            f"| {r['naive_real_tokens']:,} / {r['naive_padded_tokens']:,} ({r['naive_forwards']}) "
            f"| {r['shared_real_tokens']:,} / {r['shared_padded_tokens']:,} ({r['shared_forwards']}) "
            f"| {r['naive_padded_tokens'] / r['shared_padded_tokens']:.2f}x "
            f"| {r['naive_s']:.3f} | {r['shared_s']:.3f} | {r['naive_s'] / r['shared_s']:.2f}x "
            f"| {r['max_abs_p_diff']:.2e} | {r['max_rel_p_diff']:.2e} | {r['max_abs_logp_diff']:.2e} |"
        )


BEFORE_REV = "5fc6f81"
"""The last revision before scoring ran without a KV cache, in eval mode, with each row's own LM-head positions and
the 4D mask built on the model's device (the "before" of `compare_revisions`)."""
QWEN_DIMS = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def probe(spec: dict) -> dict:
    """One side of `compare_revisions`, in a fresh process: score as the trainer does with ``memory_scoring="auto"``
    using the scoring module at ``spec["scoring_path"]``; median seconds and peak RSS above the RSS before scoring."""
    import importlib.util
    import inspect
    import resource

    from transformers import AutoModelForCausalLM

    from mempo_trl.loading import load_tokenizer

    torch.set_num_threads(spec["threads"])
    module_spec = importlib.util.spec_from_file_location("scoring_under_test", spec["scoring_path"])
    scoring = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(scoring)
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = load_tokenizer(spec["model_dir"])
    retriever = BM25Retriever.from_corpus(demo_paths().corpus)
    rows = demo_rows(spec["trajectories"])
    episodes = play_episodes(tokenizer, retriever, rows, spec["rounds"], spec["turn_tokens"], spec["mem_tokens"])
    keys, full, mem = [], [], []
    for e, ep in enumerate(episodes):
        # Since the rollout builds the scoring items, a revision's scoring module may not have them.
        for pair in getattr(scoring, "memory_scoring_items", memory_scoring_items)(ep, tokenizer):
            keys.append(e)
            full.append(pair.full)
            mem.append(pair.mem)
    pad_id, bs = tokenizer.pad_token_id, spec["batch_size"]

    # Each side scores as its revision's trainer did: before the two-pass scheme (`pack_shared_prefix` takes
    # `max_block_tokens`), mem contexts batched apart; since, a trajectory's full and mem contexts in one call.
    two_pass = "max_block_tokens" in inspect.signature(scoring.pack_shared_prefix).parameters

    def score():
        with torch.no_grad():
            if two_pass:
                logps, mask = scoring.shared_prefix_answer_logps(model, full + mem, keys + keys, pad_id, bs)
                return logps[: len(full)], mask[: len(full)], logps[len(full) :], mask[len(full) :]
            f, fm = scoring.shared_prefix_answer_logps(model, full, keys, pad_id, bs)
            m, mm = scoring.answer_token_logps(model, mem, pad_id, bs)
        return f, fm, m, mm

    model.eval()
    rss_before, peak_before = _rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds, cpu_seconds, (f, fm, m, mm) = [], [], (None,) * 4
    for _ in range(spec["repeats"]):
        start, start_cpu = time.perf_counter(), time.process_time()
        f, fm, m, mm = score()
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - start_cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "seconds": statistics.median(seconds),
        "cpu_seconds": statistics.median(cpu_seconds),
        "peak_extra_mib": (peak - rss_before) / 2**20,
        "new_peak": peak > peak_before,
        "items": len(full),
        "full_context_last_round": statistics.mean(len(it.context_ids) for it in full[-1:]),
        "max_context": max(len(it.context_ids) for it in full),
        "p_full": answer_probability(f, fm, None).tolist(),
        "p_mem": answer_probability(m, mm, None).tolist(),
    }


def compare_revisions(
    before_rev: str = BEFORE_REV,
    rounds: int = 8,
    trajectories: int = 8,
    turn_tokens: int = 128,
    mem_tokens: int = 64,
    batch_size: int = 8,
    repeats: int = 3,
    threads: int = 1,
) -> dict:
    """Scoring memory and time, ``before_rev``'s `mempo_trl/scoring.py` vs the current one, each in its own process
    (peak RSS is per process), on a random Qwen2.5-shaped model (Qwen2.5's 151,936-token vocabulary, so the LM head
    costs what it costs on the real model)."""
    import json
    import subprocess

    from mempo_trl.kit.qwen import build_qwen2_5_model

    root = Path(__file__).resolve().parents[1]
    work = Path(tempfile.mkdtemp(prefix="bench_scoring_revs_"))
    before_path = work / "scoring_before.py"
    before_path.write_text(
        subprocess.run(
            ["git", "show", f"{before_rev}:src/mempo_trl/scoring.py"],
            cwd=root,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    model_dir = build_qwen2_5_model(work / "model", seed=0, max_position_embeddings=32768, **QWEN_DIMS)
    results = {}
    for name, path in (("before", before_path), ("after", root / "src" / "mempo_trl" / "scoring.py")):
        spec = {
            "scoring_path": str(path),
            "model_dir": str(model_dir),
            "rounds": rounds,
            "trajectories": trajectories,
            "turn_tokens": turn_tokens,
            "mem_tokens": mem_tokens,
            "batch_size": batch_size,
            "repeats": repeats,
            "threads": threads,
        }
        out = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--probe", json.dumps(spec)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        results[name] = json.loads(out.strip().splitlines()[-1])
    return results


def print_revisions(results: dict, before_rev: str) -> None:
    before, after = results["before"], results["after"]
    p_diff = max(abs(a - b) for key in ("p_full", "p_mem") for a, b in zip(before[key], after[key]))
    print(
        f"scoring at {before['items']} scored rounds (full-history context of the last round: "
        f"{before['full_context_last_round']:.0f} tokens, longest {before['max_context']}); before = {before_rev}"
    )
    print("| | before | after | after / before |")
    print("|---|---:|---:|---:|")
    for key, label in (
        ("peak_extra_mib", "peak RSS above the pre-scoring RSS (MiB)"),
        ("seconds", "wall s (median)"),
        ("cpu_seconds", "CPU s (median)"),
    ):
        print(f"| {label} | {before[key]:.1f} | {after[key]:.1f} | {after[key] / before[key]:.2f} |")
    print(
        f"max abs P difference before/after: {p_diff:.2e}; new peak reached while scoring: "
        f"{before['new_peak']} / {after['new_peak']}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--turn-tokens", type=int, default=64, help="tokens of every scripted turn")
    parser.add_argument("--mem-tokens", type=int, default=32, help="upper bound of the <mem> notes, in tokens")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward (memory_scoring_batch_size)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats; the median is reported")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (see bench/README.md)")
    parser.add_argument("--hidden-size", type=int, default=MODEL_DIMS["hidden_size"])
    parser.add_argument("--layers", type=int, default=MODEL_DIMS["num_layers"])
    parser.add_argument(
        "--compare-rev",
        nargs="?",
        const=BEFORE_REV,
        default=None,
        metavar="REV",
        help="instead: scoring memory/time of REV's scoring.py vs the current one at 8 trajectories x 8 rounds x "
        f"~2k tokens on a Qwen2.5-shaped model (REV defaults to {BEFORE_REV})",
    )
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # internal: one side of --compare-rev
    args = parser.parse_args(argv)

    if args.probe:
        import json

        print(json.dumps(probe(json.loads(args.probe))))
        return
    if args.compare_rev:
        results = compare_revisions(args.compare_rev, repeats=args.repeats, threads=args.threads)
        print_revisions(results, args.compare_rev)
        print(f"load average {os.getloadavg()[0]:.1f}")
        return
    torch.set_num_threads(args.threads)
    dims = {**MODEL_DIMS, "hidden_size": args.hidden_size, "num_layers": args.layers}
    start = time.perf_counter()
    results = run(
        args.rounds, args.trajectories, args.turn_tokens, args.mem_tokens, args.batch_size, args.repeats, dims
    )
    params = results[0]["params"]
    print(
        f"model: random Qwen2 {dims} ({params / 1e6:.2f} M parameters, fp32, sdpa); {args.trajectories} trajectories; "
        f"turns of {args.turn_tokens} tokens, <mem> <= {args.mem_tokens} tokens; BM25 top-3 on the demo corpus; "
        f"batch {args.batch_size} sequences per forward; median of {args.repeats}; torch threads {args.threads}; "
        f"torch {torch.__version__}, Python {sys.version.split()[0]}"
    )
    for r in results:
        print(
            f"rounds {r['rounds']}: peak generation context {r['peak_context']} tokens, "
            f"full-history context of the last round {r['full_context_at_last_round']:.0f} tokens (mean); "
            f"the mem contexts (scored alike in both trainer modes) hold {r['mem_real_tokens']:,} tokens"
        )
    print()
    print_table(results)
    print()
    print(
        "tokens real = context + answer tokens of the sequences scored (no padding); forwarded = input_ids.numel() "
        "summed over the forwards actually run (padding included), per scoring pass. P is the geometric "
        "mean answer probability with no confidence threshold (the random model puts every token under log 0.5)."
    )
    print(f"total bench time {time.perf_counter() - start:.1f} s; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
