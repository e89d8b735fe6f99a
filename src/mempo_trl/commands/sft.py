"""`mempo-trl sft`: TRL's `SFTTrainer` on the rows of `mempo-trl distill` (the warm start before MemPO).

    mempo-trl sft --model_name_or_path HuggingFaceTB/SmolLM2-135M-Instruct --dataset_name distilled \\
        --output_dir warm --num_train_epochs 3 --use_peft --lora_r 16
    accelerate launch -m mempo_trl sft --dataset_name distilled ...

The arguments are TRL's (`SFTConfig`, with the CPU defaults of `mempo_trl.config.MemPOSFTConfig`; `ModelConfig`: ``--use_peft``, ``--lora_r``, ...) and ``dataset_name``: a
distill output directory (its ``train.jsonl``) or a ``train.jsonl`` beside the ``mempo_agent.json`` it was played
with. The rows are TRL's conversational prompt-completion rows, so the loss is on the teacher's turns only
(``completion_only_loss``) and each context is rendered with the student's chat template. The model is saved with
``mempo_agent.json``, the turn protocol of the rows, which `ask`, `eval` and `train` read. A LoRA run saves the
adapter: `mempo-trl merge-lora` folds it into the base model.
"""

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from mempo_trl.commands import add_command, parse


@dataclass
class SFTDataArguments:
    """The distilled rows to train on."""

    dataset_name: str = field(
        metadata={"help": "A `mempo-trl distill` output directory, or its train.jsonl (with mempo_agent.json beside)."}
    )


ROW_EXAMPLE = '{"prompt": [{"role": "user", ...}], "completion": [{"role": "assistant", ...}]}'
"""What a row of a distill output's train.jsonl looks like (shown by errors)."""


def distilled_rows(dataset_name: str):
    """``(rows path, TurnProtocol)`` of a distill output; `DataError` when either is missing, or when the rows file
    holds no row or a line that is not a JSON object (a cut last line), naming the line."""
    from mempo_trl.data import DataError, iter_jsonl
    from mempo_trl.distill import ROWS_FILE
    from mempo_trl.protocol import PROTOCOL_FILE, TurnProtocol

    path = Path(dataset_name)
    rows = path / ROWS_FILE if path.is_dir() else path
    if not rows.is_file():
        raise DataError(f"{rows} does not exist: pass a `mempo-trl distill` output directory or its {ROWS_FILE}.")
    protocol = TurnProtocol.from_pretrained(rows.parent)
    if protocol is None:
        raise DataError(
            f"{rows.parent} has no {PROTOCOL_FILE}: sft saves the turn protocol its rows were played with; pass a "
            "`mempo-trl distill` output directory."
        )
    if not sum(1 for _ in iter_jsonl(rows, expected=ROW_EXAMPLE)):  # every line read: a cut one is named
        raise DataError(f"{rows} holds no rows: distill kept no episode (see distill_report.json).")
    return rows, protocol


def check_rows(dataset, source: Path, tokenizer, max_length: int | None) -> None:
    """`DataError` naming the row when it is not a conversational prompt-completion row, or renders longer than
    ``max_length`` tokens (the completion would be cut)."""
    from mempo_trl.data import DataError

    if not len(dataset):
        raise DataError(f"{source} holds no rows: distill kept no episode (see distill_report.json).")
    for index, row in enumerate(dataset):
        prompt, completion = row.get("prompt"), row.get("completion")
        if not (
            isinstance(prompt, list)
            and prompt
            and isinstance(completion, list)
            and len(completion) == 1
            and completion[0].get("role") == "assistant"
        ):
            raise DataError(
                f"{source}, row {index + 1}: not a conversational prompt-completion row (prompt: messages, "
                "completion: [one assistant message]); write the rows with `mempo-trl distill`."
            )
        if max_length is not None:
            length = len(
                tokenizer.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)["input_ids"]
            )
            if length > max_length:
                raise DataError(
                    f"{source}, row {index + 1} (id {row.get('id')!r}): {length} tokens, more than max_length="
                    f"{max_length}, so its completion would be cut: raise --max_length or drop the row."
                )


def main(argv: list[str] | None = None) -> int:
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM
    from trl import ModelConfig, SFTTrainer, get_peft_config

    from mempo_trl.agent import load_chat_tokenizer
    from mempo_trl.callbacks import DropSetAsideOnSave
    from mempo_trl.config import MemPOSFTConfig
    from mempo_trl.loading import check_model_path
    from mempo_trl.outputs import drop_set_aside
    from mempo_trl.processes import end_with_parent

    end_with_parent()  # started by a run's process (`child_env`): it ends when that one dies
    data_args, training_args, model_args = parse(
        "mempo-trl sft", [SFTDataArguments, MemPOSFTConfig, ModelConfig], argv
    )
    if not model_args.model_name_or_path:
        raise ValueError("no model: pass --model_name_or_path (the student: a model directory or a Hub id).")
    check_model_path(model_args.model_name_or_path)
    source, protocol = distilled_rows(data_args.dataset_name)
    dataset = load_dataset("json", data_files=str(source), split="train")
    tokenizer = load_chat_tokenizer(model_args.model_name_or_path, revision=model_args.model_revision)
    check_rows(dataset, source, tokenizer, training_args.max_length)
    model = AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path,
        revision=model_args.model_revision,
        dtype=model_args.dtype,
        attn_implementation=model_args.attn_implementation,
    )
    trainer = SFTTrainer(
        model=model,
        args=training_args,
        train_dataset=dataset.select_columns(["prompt", "completion"]),
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        callbacks=[DropSetAsideOnSave()],
    )
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        protocol.save(training_args.output_dir)
        drop_set_aside(training_args.output_dir)  # the model is in place
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        print(
            json.dumps(
                {
                    "rows": len(dataset),
                    "train_loss": result.training_loss,
                    "first_logged_loss": losses[0] if losses else None,
                    "train_runtime": result.metrics.get("train_runtime"),
                }
            )
        )
        print(f"model saved to {training_args.output_dir} with its turn protocol (mempo_agent.json)")
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    add_command(subparsers, "sft", "SFT a student on distilled MemPO turns (TRL's SFTTrainer)", main)
