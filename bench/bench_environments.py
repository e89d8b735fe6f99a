"""Context tokens per round on the kit's tool environments, MemPO memory context vs full history (TRL's append-only
context), with a perfect policy.

The kit's oracle (`mempo_trl.kit.envs.ORACLES`) plays every row through the real `RolloutEngine` and the
environment's tools (via `mempo_trl.evaluation.evaluate`, which does the token accounting); its ``<mem>`` carries
every code or digit found so far. Both context modes get the same turns and tool results; only the context differs.
Longer tasks (`--boxes`, `--digits`) mean more rounds.

    python bench/bench_environments.py --output bench/results/environments.json   # Qwen2.5's tokenizer, 20 rows
    python bench/bench_environments.py --tokenizer DIR       # any local tokenizer with a chat template
"""

import argparse
import json
import os
import platform
import sys

from mempo_trl.agent import MemPOAgent, load_chat_tokenizer
from mempo_trl.evaluation import compare_modes, evaluate
from mempo_trl.kit.envs import ORACLES, KeyVaultEnv, OracleGenerator, SafeEnv, key_vault_rows, safe_rows
from mempo_trl.protocol import TurnProtocol


def measure(tokenizer, name: str, factory, rows: list[dict]) -> dict:
    """Per-round prompt tokens, peak and total tokens per episode in both context modes, and the reductions."""
    generator = OracleGenerator(tokenizer, ORACLES[name])
    agent = MemPOAgent(tokenizer, None, generator, TurnProtocol(max_turns=16), environment_factory=factory)
    results = {mode: evaluate(agent, rows, context_mode=mode, progress=False) for mode in ("memory", "full_history")}
    report = {}
    for mode, result in results.items():
        overall = result.metrics["overall"]
        report[mode] = {
            "prompt_tokens_per_round": [round(x, 1) for x in overall["prompt_tokens_per_round"]],
            "peak_context_tokens": overall["peak_context_tokens"],
            "total_tokens_per_episode": overall["total_tokens_per_question"],
            "format_valid": overall["format_valid"],
            "score": overall["reward"] if "reward" in overall else overall["em"],
        }
    comparison = compare_modes(results["memory"], results["full_history"])
    report["reduction_pct"] = {
        key: round(comparison[key], 1) for key in ("total_token_reduction_pct", "peak_context_reduction_pct")
    }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default=None, help="a local tokenizer directory (default: Qwen2.5's, offline)")
    parser.add_argument("--rows", type=int, default=20, help="rows per task")
    parser.add_argument("--boxes", type=int, nargs="+", default=[3, 6], help="KeyVaultEnv trail lengths")
    parser.add_argument("--digits", type=int, nargs="+", default=[3, 5], help="SafeEnv code lengths")
    parser.add_argument("--output", default=None, help="also write the report to this JSON file")
    args = parser.parse_args()
    if args.tokenizer:
        tokenizer = load_chat_tokenizer(args.tokenizer)
    else:
        from mempo_trl.kit.qwen import build_qwen2_5_tokenizer

        tokenizer = build_qwen2_5_tokenizer()
    report = {}
    for boxes in args.boxes:
        rows = key_vault_rows(args.rows, seed=1, num_boxes=boxes)
        report[f"keyvault, {boxes} boxes"] = measure(tokenizer, "keyvault", KeyVaultEnv, rows)
    for digits in args.digits:
        rows = [{**row, "num_items": 8} for row in safe_rows(args.rows, seed=1, num_digits=digits)]
        report[f"safe, {digits} digits"] = measure(tokenizer, "safe", SafeEnv, rows)
    print(json.dumps(report, indent=2))
    if args.output:
        record = {
            "command": "python bench/bench_environments.py " + " ".join(sys.argv[1:]),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "tasks": report,
        }
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
