"""Fold a trained LoRA adapter into its base model, for serving (vLLM) or evaluation (`mempo-trl merge-lora`).

    mempo-trl merge-lora --model_name_or_path outputs/qwen2.5-3b-lora --output_dir outputs/qwen2.5-3b-mempo-merged
    vllm serve outputs/qwen2.5-3b-mempo-merged

The base model is the one named in the adapter's `adapter_config.json` (`base_model_name_or_path`), or
`--base_model_name_or_path` when it has moved. The output is a standalone model (safetensors, config, generation
config) plus the tokenizer saved with the adapter (the base model's when the adapter directory has none) and the
turn protocol (`mempo_agent.json`), loadable with `from_pretrained` and without peft.
"""

import shutil
from pathlib import Path


def merge_lora(adapter: str | Path, out: str | Path, base: str | None = None, dtype: str = "auto") -> Path:
    """Load the base model and the adapter, merge them (`merge_and_unload`) and save model + tokenizer to `out`.

    `dtype` is the dtype the base model is loaded, merged and saved in (`auto`: the checkpoint's own).
    """
    import torch
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    from mempo_trl.loading import load_tokenizer
    from mempo_trl.protocol import PROTOCOL_FILE

    adapter = str(adapter)
    base = base or PeftConfig.from_pretrained(adapter).base_model_name_or_path
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype if dtype == "auto" else getattr(torch, dtype))
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    out = Path(out)
    merged.save_pretrained(out)
    tokenizer_dir = adapter if Path(adapter, "tokenizer_config.json").is_file() else base
    load_tokenizer(tokenizer_dir).save_pretrained(out)
    if Path(adapter, PROTOCOL_FILE).is_file():  # the agent's turn protocol travels with the merged weights
        shutil.copy(Path(adapter, PROTOCOL_FILE), out / PROTOCOL_FILE)
    return out
