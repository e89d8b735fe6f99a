"""Loading a policy's tokenizer exactly as it was trained; checking a model path before anything is loaded."""

import os
from pathlib import Path


def check_model_path(path: str) -> None:
    """Raise `FileNotFoundError` with a fix when `path` names a local model that is not there or not a model.

    A Hub id (`name` or `org/name`, not an existing path) passes unless `HF_HUB_OFFLINE` is set and it is not in the
    local cache.

    Example:
        >>> check_model_path("./no/such/model")
        Traceback (most recent call last):
        FileNotFoundError: model path ./no/such/model does not exist. Pass a directory written by save_pretrained ...
    """
    local, fix = Path(path).expanduser(), "Pass a directory written by save_pretrained or a Hub id such as org/name."
    if local.is_file():
        raise FileNotFoundError(f"model path {path} is a file, not a model directory. {fix}")
    if local.is_dir():
        from mempo_trl.checkpoints import check_final_save

        check_final_save(local)
        if not (local / "config.json").is_file():
            raise FileNotFoundError(f"model path {path} is not a model directory (no config.json). {fix}")
        return
    if path.startswith((".", "/", "~")) or path.count("/") > 1 or os.sep != "/" and os.sep in path:
        raise FileNotFoundError(f"model path {path} does not exist. {fix}")
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(path, "config.json")
        except ValueError:  # not a valid repo id either
            cached = None
        if not isinstance(cached, str):
            raise FileNotFoundError(
                f"model {path!r} is neither a local directory nor in the Hugging Face cache, and HF_HUB_OFFLINE is "
                f"set. {fix}"
            )


def load_tokenizer(path: str | Path, revision: str | None = None):
    """The tokenizer of a model directory or Hub id.

    A directory with a ``tokenizer.json`` is loaded as a `PreTrainedTokenizerFast`, exactly as that file says:
    `AutoTokenizer` swaps in `Qwen2Tokenizer` for ``model_type: qwen2`` configs, which re-tokenizes a custom
    ``tokenizer.json`` differently. Anything else goes through `AutoTokenizer`.

    Example:
        >>> load_tokenizer("outputs/my-agent").eos_token  # doctest: +SKIP
        '<|im_end|>'
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if Path(path, "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path), revision=revision)
