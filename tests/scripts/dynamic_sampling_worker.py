"""Run one scripted generation batch with ``dynamic_sampling="refill"`` and dump it (tests/test_distributed.py).

    torchrun --nproc_per_node 2 tests/scripts/dynamic_sampling_worker.py MODEL_DIR OUT_JSON

Six trajectories, G = 2: groups Live1 (rows 0-1), Dead1 (rows 2-3, split over the two processes) and Live2 (rows
4-5). Every answer is one turn: Dead1 is answered wrong by both rows; a Live question right when the process's count
of that question's turns so far plus its rank is even, so every Live pair (even one split over the processes) is
informative. The only dataset prompt, Live3, must replace Dead1 on both processes.
"""

import faulthandler
import json
import os
import re
import sys
from pathlib import Path

from datasets import Dataset
from helpers import EchoRetriever, cpu_config  # tests/ is on PYTHONPATH (`helpers.worker_env`)

from mempo_trl import MemPOTrainer
from mempo_trl.commands.recipe import release_process_groups
from mempo_trl.kit.tiny import load_tiny


BATCH = ["Live1", "Live1", "Dead1", "Dead1", "Live2", "Live2"]


def main(model_dir: str, out_path: str) -> None:
    model, tokenizer = load_tiny(model_dir)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = cpu_config(
        "/tmp/mempo_dynamic_sampling_worker", per_device_train_batch_size=6 // world, dynamic_sampling="refill"
    )
    dataset = Dataset.from_list([{"question": "Live3", "golden_answers": ["Paris"]}])
    trainer = MemPOTrainer(model, EchoRetriever(), args=args, train_dataset=dataset, processing_class=tokenizer)
    rank, n_local = trainer.accelerator.process_index, 6 // world
    turns: dict[str, int] = {}

    def scripted_generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        outs = []
        for ids in prompt_ids:
            question = re.search(r"(Dead|Live)\d", tokenizer.decode(ids)).group()
            n = turns[question] = turns.get(question, -1) + 1
            right = question.startswith("Live") and (n + rank) % 2 == 0
            turn = f"<mem>m</mem><think>t</think><answer>{'Paris' if right else 'Lyon'}</answer>"
            outs.append(tokenizer(turn, add_special_tokens=False)["input_ids"])
        return outs, None

    trainer._generate_single_turn = scripted_generate
    trainer.model.train()
    inputs = [{"question": q, "golden_answers": ["Paris"]} for q in BATCH[rank * n_local : (rank + 1) * n_local]]
    out = trainer._generate_and_score_completions(inputs)
    texts = tokenizer.batch_decode(out["prompt_ids"], skip_special_tokens=True)
    rows = [
        {
            "question": re.search(r"(Dead|Live)\d", text).group(),
            "advantage": round(float(adv[0]), 4),
            "tokens": int(mask.sum()),
        }
        for text, adv, mask in zip(texts, out["advantages"], out["completion_mask"])
    ]
    gathered = trainer.accelerator.gather_for_metrics(rows, use_gather_object=True)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith("dynamic_sampling/")}
    if rank == 0:
        Path(out_path).write_text(json.dumps({"world": world, "rows": gathered, "metrics": metrics}))
    release_process_groups(trainer)


if __name__ == "__main__":
    faulthandler.enable()  # a native abort (SIGABRT) prints every thread's Python stack
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # groups released in main(); skip interpreter finalisation, where gloo threads can still abort
