"""Train MemPO for two steps with TRL's vLLM generation on a fake engine and dump what each episode got.

    torchrun --nproc_per_node 2 tests/scripts/vllm_worker.py MODE MODEL_DIR OUT_DIR   (used by tests/test_vllm.py)

MODE is ``server`` (TRL's server mode), ``colocate_tp`` (colocate, tensor_parallel_size = world size) or
``colocate`` (tensor_parallel_size 1). Four questions Q0..Q3, G = 2, two per process; episode Q<k> ends in round
``1 + k % 4`` (`fake_vllm.end_round`), so from round 2 on the processes send different numbers of prompts.
Each process writes ``OUT_DIR/rank<r>.json``: every episode's question and turn texts, the weight syncs and
generate calls the fake engine saw, and the logged metrics.
"""

import faulthandler
import json
import os
import sys
from pathlib import Path

import fake_vllm  # tests/ is on PYTHONPATH (`helpers.worker_env`)
from datasets import Dataset
from helpers import EchoRetriever, cpu_config

from mempo_trl import MemPOTrainer
from mempo_trl.commands.recipe import release_process_groups
from mempo_trl.kit.tiny import load_tiny


def main(mode: str, model_dir: str, out_dir: str) -> None:
    fake_vllm.install(model_dir)
    fake_vllm.NAN_ROUNDS.update({(1, 2), (3, 1)})  # a NaN (None) sampling log-prob in two turns
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model, tokenizer = load_tiny(model_dir)
    args = cpu_config(
        Path(out_dir) / "run",
        per_device_train_batch_size=4 // world,  # 2 questions x G = 2 per step, on any world size
        max_turns=4,
        max_steps=2,
        learning_rate=1e-3,
        use_vllm=True,
        vllm_mode="server" if mode == "server" else "colocate",
        vllm_tensor_parallel_size=world if mode == "colocate_tp" else 1,
        disable_tqdm=True,
    )
    dataset = Dataset.from_list([{"question": f"Q{k} where?", "golden_answers": [f"A{k}"]} for k in range(4)])
    trainer = MemPOTrainer(model, EchoRetriever(), args=args, train_dataset=dataset, processing_class=tokenizer)
    episodes = []
    play = trainer.rollout_engine.play

    def recording_play(*a, **kw):
        rollout = play(*a, **kw)
        episodes.extend(rollout.episodes)
        return rollout

    trainer.rollout_engine.play = recording_play
    trainer.train()
    engine = fake_vllm.engine_of(trainer)
    rank = trainer.accelerator.process_index
    out = {
        "rank": rank,
        "episodes": [{"question": ep.row["question"], "turns": [r.text for r in ep.rounds]} for ep in episodes],
        "engine": None if engine is None else engine.counters.__dict__,
        "log_history": trainer.state.log_history,
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    release_process_groups(trainer)  # as `mempo-trl train` does: the TP group must not be left to interpreter exit


if __name__ == "__main__":
    faulthandler.enable()  # a native abort (SIGABRT) prints every thread's Python stack
    main(*sys.argv[1:4])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # groups released in main(); skip interpreter finalisation, where gloo threads can still abort
