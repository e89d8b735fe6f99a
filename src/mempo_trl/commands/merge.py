"""`mempo-trl merge-lora`: fold a trained LoRA adapter into its base model (`mempo_trl.merge.merge_lora`)."""

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from mempo_trl.commands import add_command, parse


@dataclass
class MergeArguments:
    """The adapter to merge and where the standalone model goes."""

    model_name_or_path: str = field(metadata={"help": "Directory of the trained adapter (a training output_dir)."})
    output_dir: str = field(metadata={"help": "Directory for the merged model."})
    base_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Base model path or Hub id (default: the one named in the adapter config)."}
    )
    dtype: str = field(
        default="auto",
        metadata={"help": "Load, merge and save in this dtype (default: the base checkpoint's own).",
                  "choices": ["auto", "bfloat16", "float16", "float32"]},
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from mempo_trl.merge import merge_lora

    (args,) = parse("mempo-trl merge-lora", [MergeArguments], argv)
    if not Path(args.model_name_or_path, "adapter_config.json").is_file():
        raise FileNotFoundError(f"{args.model_name_or_path} is not a LoRA adapter directory (no adapter_config.json).")
    out = merge_lora(args.model_name_or_path, args.output_dir, base=args.base_model_name_or_path, dtype=args.dtype)
    print(f"merged model saved to {out}")
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    add_command(subparsers, "merge-lora", "merge a LoRA adapter into its base model; save a standalone model", main)
