"""Run one scripted MemPO generation batch and dump the advantages (used by tests/test_distributed.py).

    torchrun --nproc_per_node 2 tests/scripts/pooling_worker.py MODEL_DIR OUT_JSON

Each process handles its contiguous slice of the four trajectories of one question (G = 4), so the question's
memory pool spans both processes. The policy and the answer scorer are scripted: no randomness.
"""

import faulthandler
import json
import os
import re
import sys
from pathlib import Path

from datasets import Dataset
from helpers import EchoRetriever, cpu_config, scripted_scorers  # tests/ is on PYTHONPATH (`helpers.worker_env`)

from mempo_trl import MemPOTrainer
from mempo_trl.commands.recipe import release_process_groups
from mempo_trl.kit.tiny import load_tiny


QUESTION = "Where is Gamma?"
TRAJECTORIES = [
    [
        "<mem>g0 one</mem><think>t</think><search>gamma</search>",
        "<mem>g0 two</mem><think>t</think><answer>Oslo</answer>",
    ],
    [
        "<mem>g1 one</mem><think>t</think><search>gamma</search>",
        "<mem>g1 two</mem><think>t</think><answer>Bern</answer>",
    ],
    [
        "<mem>g2 one</mem><think>t</think><search>gamma</search>",
        "<mem>g2 two</mem><think>t</think><search>gamma 2</search>",
        "<mem>g2 three</mem><think>t</think><answer>Oslo</answer>",
    ],
    [
        "<mem>g3 one</mem><think>t</think><search>gamma</search>",
        "<mem>g3 two</mem><think>t</think><answer>Oslo</answer>",
    ],
]
P_MEM = {"g0 two": 0.9, "g1 two": 0.1, "g2 two": 0.4, "g2 three": 0.7, "g3 two": 0.3}
P_FULL = 0.5


def main(model_dir: str, out_path: str) -> None:
    model, tokenizer = load_tiny(model_dir)
    args = cpu_config(
        "/tmp/mempo_pooling_worker",
        per_device_train_batch_size=4 // int(os.environ.get("WORLD_SIZE", "1")),
        num_generations=4,
        memory_threshold=None,
        memory_threshold_quantile=0.0,  # the smallest answer-token log-prob of ALL processes is filtered out
    )
    dataset = Dataset.from_list([{"question": QUESTION, "golden_answers": ["Oslo"]}])
    trainer = MemPOTrainer(model, EchoRetriever(), args=args, train_dataset=dataset, processing_class=tokenizer)
    rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
    n_local = 4 // world
    mine = list(range(rank * n_local, (rank + 1) * n_local))
    started = iter(mine)

    def scripted_generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        outs = []
        for ids in prompt_ids:
            text = tokenizer.decode(ids, skip_special_tokens=False)
            seen = [(k, j) for k in mine for j, t in enumerate(TRAJECTORIES[k]) if t in text]
            k, j = seen[0] if seen else (next(started, None), -1)
            if k is None:  # the placeholder turn of a process whose episodes have all ended
                outs.append([tokenizer.eos_token_id])
                continue
            outs.append(tokenizer(TRAJECTORIES[k][j + 1], add_special_tokens=False)["input_ids"])
        return outs, None

    def probability(model, context):
        return P_MEM[re.findall(r"<mem>(.*?)</mem>", context)[-1]] if context.endswith("</mem>") else P_FULL

    trainer._generate_single_turn = scripted_generate
    import mempo_trl.memory_scoring as scoring_module

    scoring_module.answer_token_logps, scoring_module.shared_prefix_answer_logps = scripted_scorers(
        tokenizer, probability
    )
    trainer.model.train()
    out = trainer._generate_and_score_completions([{"question": QUESTION, "golden_answers": ["Oslo"]}] * n_local)
    n_real = int((out["completion_mask"].sum(dim=1) > 0).sum())
    rows = [
        [round(v, 6) for v in adv[: int(m.sum())].tolist()]
        for adv, m in zip(out["advantages"][:n_real], out["completion_mask"][:n_real])
    ]
    gathered = trainer.accelerator.gather_for_metrics(rows, use_gather_object=True)
    # Every process must hand the loss the same number of rows (TRL's collectives assume it): padded to the max.
    row_counts = trainer.accelerator.gather_for_metrics([out["completion_mask"].size(0)], use_gather_object=True)
    if rank == 0:
        Path(out_path).write_text(json.dumps({"world": world, "rows": gathered, "row_counts": row_counts}))
    release_process_groups(trainer)


if __name__ == "__main__":
    faulthandler.enable()  # a native abort (SIGABRT) prints every thread's Python stack
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # groups released in main(); skip interpreter finalisation, where gloo threads can still abort
