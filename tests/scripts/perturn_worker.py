"""Train one scripted MemPO step with ``dynamic_sampling="refill"`` and record what the loss saw
(tests/test_distributed.py, `test_every_trained_token_carries_its_own_trajectorys_advantage`).

    torchrun --nproc_per_node 2 tests/scripts/perturn_worker.py MODEL_DIR OUT_DIR

`MemPOTrainer.train` runs one optimizer step (two micro-batches: ``gradient_accumulation_steps=2``) on 12
trajectories, G = 4, 6 per process, so the middle group is split over the processes. A ``Dead`` question is searched,
then answered wrong by every trajectory (an all-equal group that refill replaces); a ``Live`` one is answered after
1-3 rounds, right by every other trajectory. Each turn's ``<mem>`` names its trajectory and round. The answer scorer
gives P_full = `P_FULL` and P_mem = `helpers.scripted_p_mem` of the memory. Each process writes ``rank<R>.json``: the
episodes and training rows the rollout handed to `_round_batch` (after refill), and every row `_compute_loss` got.
"""

import faulthandler
import json
import os
import re
import sys
from pathlib import Path

from datasets import Dataset
from helpers import EchoRetriever, cpu_config, scripted_p_mem, scripted_scorers  # tests/ is on PYTHONPATH

from mempo_trl import MemPOTrainer
from mempo_trl.commands.recipe import release_process_groups
from mempo_trl.kit.tiny import load_tiny


QUESTIONS = ["Dead1", "Live1", "Live2", "Dead2", "Live3", "Live4"]
P_FULL = 0.5
_MEM = re.compile(r"<mem>(\S+) r(\d+)</mem>")


def main(model_dir: str, out_dir: str) -> None:
    model, tokenizer = load_tiny(model_dir)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = cpu_config(
        out_dir + "/run",
        per_device_train_batch_size=12 // world // 2,
        gradient_accumulation_steps=2,
        num_generations=4,
        dynamic_sampling="refill",
        memory_threshold=None,
        learning_rate=1e-3,
        disable_tqdm=True,
    )
    dataset = Dataset.from_list([{"question": q, "golden_answers": ["Paris"]} for q in QUESTIONS])
    trainer = MemPOTrainer(model, EchoRetriever(), args=args, train_dataset=dataset, processing_class=tokenizer)
    rank = trainer.accelerator.process_index
    plays: dict[str, int] = {}

    def turn(trajectory: str, question: str, t: int) -> str:
        n = int(trajectory.rsplit(".", 1)[1])
        rounds = 2 if question.startswith("Dead") else 1 + (n + rank) % 3
        if t < rounds:
            return f"<mem>{trajectory} r{t}</mem><think>t</think><search>{question} {t}</search>"
        right = question.startswith("Live") and (n + rank) % 2 == 0
        return f"<mem>{trajectory} r{t}</mem><think>t</think><answer>{'Paris' if right else 'Lyon'}</answer>"

    def scripted_generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        texts = [tokenizer.decode(ids, skip_special_tokens=False) for ids in prompt_ids]
        outs = []
        for text in texts:
            question = re.search(r"(Dead|Live)\d", text).group()
            last = _MEM.findall(text)
            if last:  # the context shows the previous turn: its trajectory's next round
                trajectory, t = last[-1][0], int(last[-1][1]) + 1
            elif len(texts) == 1:  # the placeholder prompt of a process whose episodes have all ended
                outs.append([tokenizer.eos_token_id])
                continue
            else:  # round 1 of a new trajectory
                plays[question] = plays.get(question, -1) + 1
                trajectory, t = f"{question}-k{rank}.{plays[question]}", 1
            outs.append(tokenizer(turn(trajectory, question, t), add_special_tokens=False)["input_ids"])
        return outs, None

    def probability(model, context):
        if not context.endswith("</mem>"):  # the full context ends with the previous round's result
            return P_FULL
        trajectory, t = _MEM.findall(context)[-1]
        return scripted_p_mem(f"{trajectory} r{t}")

    import mempo_trl.memory_scoring as scoring_module

    scoring_module.answer_token_logps, scoring_module.shared_prefix_answer_logps = scripted_scorers(
        tokenizer, probability
    )
    trainer._generate_single_turn = scripted_generate
    record = {"episodes": [], "rows": [], "dropped": [], "loss_rows": []}
    round_batch, compute_loss = trainer._round_batch, trainer._compute_loss

    def recording_round_batch(episodes, rows, mode, dropped):
        record["episodes"] += [{"question": ep.question, "turns": [r.text for r in ep.rounds]} for ep in episodes]
        record["rows"] += [
            {
                "episode": r.episode_index,
                "round": r.round_index,
                "prompt": list(r.prompt_ids),
                "completion": list(r.completion_ids),
            }
            for r in rows
        ]
        record["dropped"] = list(dropped)
        return round_batch(episodes, rows, mode, dropped)

    def recording_compute_loss(model, inputs):
        for i in range(inputs["completion_ids"].size(0)):
            prompt = inputs["prompt_ids"][i][inputs["prompt_mask"][i].bool()].tolist()
            record["loss_rows"].append(
                {
                    "prompt": prompt,
                    "completion": inputs["completion_ids"][i].tolist(),
                    "mask": inputs["completion_mask"][i].tolist(),
                    "advantages": inputs["advantages"][i].tolist(),
                }
            )
        return compute_loss(model, inputs)

    trainer._round_batch, trainer._compute_loss = recording_round_batch, recording_compute_loss
    trainer.train()
    metrics = {k: v for k, v in trainer.state.log_history[0].items() if k.startswith("dynamic_sampling/")}
    record.update(world=world, rank=rank, metrics=metrics)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    release_process_groups(trainer)


if __name__ == "__main__":
    faulthandler.enable()  # a native abort (SIGABRT) prints every thread's Python stack
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # groups released in main(); skip interpreter finalisation, where gloo threads can still abort
