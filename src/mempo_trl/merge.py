"""`mempo-trl merge-lora`: fold a trained LoRA adapter into its base model, for serving (vLLM) or evaluation.

    mempo-trl merge-lora --adapter outputs/qwen2.5-3b-lora --out outputs/qwen2.5-3b-mempo-merged
    vllm serve outputs/qwen2.5-3b-mempo-merged

The base model is the one named in the adapter's `adapter_config.json` (`base_model_name_or_path`), or `--base`
when it has moved. The output is a standalone model (safetensors, config, generation config) plus the tokenizer
saved with the adapter (the base model's when the adapter directory has none), loadable with `from_pretrained`
and without peft.
"""

import argparse
from pathlib import Path

from mempo_trl.outputs import prepare_output_dir


def merge_lora(adapter: str | Path, out: str | Path, base: str | None = None, dtype: str = "auto") -> Path:
    """Load the base model and the adapter, merge them (`merge_and_unload`) and save model + tokenizer to `out`.

    `dtype` is the dtype the base model is loaded, merged and saved in (`auto`: the checkpoint's own).
    """
    import torch
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    from mempo_trl.loading import load_tokenizer

    adapter = str(adapter)
    base = base or PeftConfig.from_pretrained(adapter).base_model_name_or_path
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype if dtype == "auto" else getattr(torch, dtype))
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    out = Path(out)
    merged.save_pretrained(out)
    tokenizer_dir = adapter if Path(adapter, "tokenizer_config.json").is_file() else base
    load_tokenizer(tokenizer_dir).save_pretrained(out)
    return out


def _merge_cli(args: argparse.Namespace) -> int:
    if not Path(args.adapter, "adapter_config.json").is_file():
        raise FileNotFoundError(f"{args.adapter} is not a LoRA adapter directory (no adapter_config.json).")
    prepare_output_dir(args.out, overwrite=args.overwrite_output_dir)
    out = merge_lora(args.adapter, args.out, base=args.base, dtype=args.dtype)
    print(f"merged model saved to {out}")
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "merge-lora", help="merge a LoRA adapter into its base model; save a standalone model + tokenizer"
    )
    parser.add_argument("--adapter", required=True, help="Directory of the trained adapter (a training output_dir).")
    parser.add_argument("--out", required=True, help="Directory for the merged model.")
    parser.add_argument(
        "--overwrite_output_dir", action="store_true", help="Write into an --out that already holds files."
    )
    parser.add_argument("--base", help="Base model path or Hub id (default: the one named in the adapter config).")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="Load, merge and save in this dtype (default: the base checkpoint's own).",
    )
    parser.set_defaults(func=_merge_cli)
