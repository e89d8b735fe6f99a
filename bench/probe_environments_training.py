"""Probe for the closing note of issue 25: a short `mempo-trl train` run on each kit environment in both context modes.

keyvault: the model `probe_environments_warm.py` warm-started (/tmp/envs_warm_kv); safe: the tiny model as built
(/tmp/envs_tiny, `build_tiny_model(seed=0)`). Per-step metrics go to /tmp/envs_closing/closing.json (committed as
bench/results/environments_training.json).

    python bench/probe_environments_training.py 10
"""

import json
import sys
import time

from mempo_trl.commands.train import build_trainer, parse_args


out = {}
for env, model, recipe in [
    ("keyvault", "/tmp/envs_warm_kv", "examples/configs/keyvault_cpu.yaml"),
    ("safe", "/tmp/envs_tiny", "examples/configs/safe_cpu.yaml"),
]:
    for mode in ("memory", "full_history"):
        argv = [
            "--config",
            recipe,
            "--model_name_or_path",
            model,
            "--context_mode",
            mode,
            "--output_dir",
            f"/tmp/envs_closing/{env}_{mode}",
            "--max_steps",
            sys.argv[1],
            "--per_device_train_batch_size",
            "8",
            "--num_generations",
            "4",
            "--disable_tqdm",
            "true",
            "--overwrite_output_dir",
            "true",
        ]
        script_args, training_args, model_args, retriever_args = parse_args(argv)
        trainer = build_trainer(script_args, training_args, model_args, retriever_args)
        t0 = time.time()
        trainer.train()
        dt = time.time() - t0
        logs = [e for e in trainer.state.log_history if "tokens/prompt_per_round" in e]
        keys = [
            "tokens/prompt_per_round",
            "tokens/prompt_peak",
            "episode/turns",
            "episode/tool_calls",
            "episode/format_valid",
            "episode/em",
            "reward",
            "memory/scored_rounds",
            "memory/reward",
        ]
        out[f"{env} {mode}"] = {k: [round(e[k], 3) for e in logs if k in e] for k in keys} | {"seconds": round(dt, 1)}
        print(
            env,
            mode,
            json.dumps(
                {k: (sum(v) / len(v) if isinstance(v, list) and v else v) for k, v in out[f"{env} {mode}"].items()}
            ),
            flush=True,
        )
json.dump(out, open("/tmp/envs_closing/closing.json", "w"), indent=1)
