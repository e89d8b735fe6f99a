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
        metadata={
            "help": "Load, merge and save in this dtype (default: the base checkpoint's own).",
            "choices": ["auto", "bfloat16", "float16", "float32"],
        },
    )

    @property
    def adapter_base_model(self) -> str | None:
        """The base model the adapter's `adapter_config.json` names, where it resolves to a directory
        (`resolve_base_model`): an input `output_dir` must stay apart from (`mempo_trl.commands.INPUT_FIELDS`)."""
        import json

        if self.base_model_name_or_path:
            return None
        try:
            recorded = json.loads(Path(self.model_name_or_path, "adapter_config.json").read_text(encoding="utf-8"))
            return resolve_base_model(self.model_name_or_path, recorded["base_model_name_or_path"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # no adapter, or not one: the command says so once the output directory is checked


def resolve_base_model(adapter: str | Path, recorded: str) -> str:
    """The base model of ``adapter``: ``recorded`` (its `adapter_config.json`) when that is a directory or a Hub id,
    else the ``base_model/`` the run wrote inside the adapter directory (`model_name_or_path: tiny`), which moves
    with it.

    Example:
        >>> resolve_base_model("outputs/moved", "/gone/outputs/tiny/base_model")  # doctest: +SKIP
        'outputs/moved/base_model'
    """
    if Path(recorded).is_dir():
        return recorded
    inside = Path(adapter, "base_model")
    if (inside / "config.json").is_file():
        return str(inside)
    if Path(recorded).is_absolute() or recorded.startswith("."):
        raise FileNotFoundError(
            f"base model {recorded} of the adapter {adapter} is not there any more: pass --base_model_name_or_path."
        )
    return recorded  # a Hub id


def write_merged_card(adapter: str | Path, base: str, out: Path) -> None:
    """The adapter's model card, with one line saying what was merged, into the merged directory (if it has one)."""
    card = Path(adapter, "README.md")
    if not card.is_file():
        return
    text = card.read_text(encoding="utf-8")
    text = text.replace(f'"{adapter}"', f'"{out}"').replace(
        f"--model_name_or_path {adapter} ", f"--model_name_or_path {out} "
    )
    note = (
        f"\n> Standalone model: the LoRA adapter `{adapter}` merged into its base model `{base}` with "
        "`mempo-trl merge-lora` (no peft needed to load it).\n"
    )
    _, front, body = text.split("---\n", 2) if text.startswith("---\n") else ("", "", text)
    head, sep, rest = body.partition("\n\n")
    merged = (f"---\n{front}---\n" if front else "") + head + sep + note.lstrip("\n") + "\n" + rest
    (out / "README.md").write_text(merged, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    from peft import PeftConfig

    from mempo_trl.loading import check_adapter_files
    from mempo_trl.merge import merge_lora

    (args,) = parse("mempo-trl merge-lora", [MergeArguments], argv)
    if not Path(args.model_name_or_path, "adapter_config.json").is_file():
        raise FileNotFoundError(f"{args.model_name_or_path} is not a LoRA adapter directory (no adapter_config.json).")
    check_adapter_files(args.model_name_or_path)
    base = args.base_model_name_or_path or resolve_base_model(
        args.model_name_or_path, PeftConfig.from_pretrained(args.model_name_or_path).base_model_name_or_path
    )
    out = merge_lora(args.model_name_or_path, args.output_dir, base=base, dtype=args.dtype)
    write_merged_card(args.model_name_or_path, base, out)
    print(f"merged model saved to {out} (base model {base})")
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    add_command(subparsers, "merge-lora", "merge a LoRA adapter into its base model; save a standalone model", main)
