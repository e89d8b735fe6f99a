"""Probe for the closing note of issue 25: a short `mempo-trl train` run on each kit environment in both context modes.

Each environment trains the model `probe_environments_warm.py` warm-started on its oracle turns (/tmp/envs_warm_kv,
/tmp/envs_warm_safe). Per-step metrics are merged into /tmp/envs_closing/closing.json (committed as
bench/results/environments_training.json).

    python bench/probe_environments_training.py 10 keyvault safe
"""

import json
import sys
import time
from pathlib import Path

from mempo_trl.commands.recipe import build_trainer
from mempo_trl.commands.train import parse_args


RESULTS = Path("/tmp/envs_closing/closing.json")
MODELS = {"keyvault": "/tmp/envs_warm_kv", "safe": "/tmp/envs_warm_safe"}
out = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
for env in sys.argv[2:]:
    model, recipe = MODELS[env], f"examples/configs/{env}_cpu.yaml"
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
RESULTS.write_text(json.dumps(out, indent=1))
