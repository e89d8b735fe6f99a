# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "mempo_trl[deepspeed]",
# ]
# ///
"""Train a MemPO search agent: TRL's `TrlParser` over the recipe's arguments, then the recipe's `main` (the steps,
top-down like TRL's `trl/scripts/grpo.py`, are in `mempo_trl/commands/recipe.py`: load the model and tokenizer, the
dataset, the retriever and the reward functions, build the `MemPOTrainer`, train, save, push). `mempo-trl train` runs
the same `main`, adding a short `--help`, a one-second output-directory check and `--accelerate_config`.

Usage (recipes in examples/configs/, launcher configs in accelerate_configs/; any recipe field can be
overridden on the command line, e.g. `--max_steps 10 --output_dir outputs/try`):

    # one process, no launcher (CPU or one GPU); `mempo-trl kit learner --output_dir kit/learner` first
    python examples/train_mempo.py --config examples/configs/quickstart_cpu.yaml

    # the same without this script: `mempo-trl train` starts accelerate itself, with the configs shipped in the
    # package (no clone needed for them): --accelerate_config zero3 --num_processes 8
    mempo-trl train --config examples/configs/qwen2.5-7b-vllm.yaml --accelerate_config zero3 --num_processes 8

    # one GPU, Qwen2.5-3B-Instruct with LoRA
    accelerate launch --config_file accelerate_configs/single_gpu.yaml examples/train_mempo.py \\
        --config examples/configs/qwen2.5-3b-lora.yaml

    # 8 GPUs, Qwen2.5-7B-Instruct full fine-tuning, DeepSpeed ZeRO-3, vLLM colocated
    accelerate launch --config_file accelerate_configs/zero3.yaml examples/train_mempo.py \\
        --config examples/configs/qwen2.5-7b-vllm.yaml

    # 2 CPU processes (DeepSpeed ZeRO-2 over gloo); the recipe must set `use_cpu: true`;
    # `mempo-trl kit tiny --output_dir kit/tiny` first
    accelerate launch --config_file accelerate_configs/cpu_zero2.yaml examples/train_mempo.py \\
        --config examples/configs/tiny_cpu.yaml

On rank 0 the run prints a `mempo-trl: world_size=... distributed_type=... model=...` banner when training
starts (check it: a wrong launcher config can silently run independent copies), then one summary line per
logged step. `report_to: trackio | wandb | tensorboard` logs every metric as TRL does.
"""

import sys

from trl import ModelConfig, TrlParser

from mempo_trl import MemPOConfig, RetrieverArguments
from mempo_trl.commands import quiet_upstream_noise, run
from mempo_trl.commands.recipe import ScriptArguments, main


if __name__ == "__main__":
    quiet_upstream_noise()
    parser = TrlParser((ScriptArguments, MemPOConfig, ModelConfig, RetrieverArguments))
    script_args, training_args, model_args, retriever_args = parser.parse_args_and_config()
    # A fixable error (bad path, data, output directory, retriever) ends in one `error:` line and exit code 2.
    sys.exit(run(main, script_args, training_args, model_args, retriever_args))
