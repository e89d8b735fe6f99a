"""Loading a policy's tokenizer exactly as it was trained."""

from pathlib import Path


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
