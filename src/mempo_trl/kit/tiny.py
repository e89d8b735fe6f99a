"""A tiny Qwen2-style model and tokenizer built offline, for tests, CPU smoke runs and examples.

`build_tiny_model` trains a byte-level BPE tokenizer with `tokenizers` on the demo corpus, the demo
questions and MemPO-format turns (Qwen2's normalizer and pre-tokenizer, one token per digit), adds the
MemPO tags as single non-special tokens, sets Qwen2.5's chat template (shipped with TRL) and saves it with a
randomly initialised `Qwen2ForCausalLM` (about 0.2 M parameters). Both reload like a Hub model. The same
seed gives the same weights and the same `tokenizer.json`; building takes about a second.

Load tokenizers with `load_tokenizer` (`PreTrainedTokenizerFast`), not `AutoTokenizer`: for a config with
`model_type: qwen2`, `AutoTokenizer` (and a TRL trainer given `processing_class=None`) returns a
`Qwen2Tokenizer`, which replaces the saved normalizer and pre-tokenizer with Qwen2's own. The tiny tokenizer
is built with exactly those, so both give the same ids here, but a `tokenizer.json` built any other way is
then silently tokenized differently.
"""

from importlib import resources
from pathlib import Path

from mempo_trl.loading import load_tokenizer
from mempo_trl.turns import MEMPO_TAGS


# Qwen2.5 also has its tool-call tags as single non-special tokens.
_QWEN_TOOL_TAGS = ("<tool_call>", "</tool_call>")
_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_QWEN_DEFAULT_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def qwen2_5_chat_template() -> str:
    """Qwen2.5's chat template as shipped with TRL (`trl/chat_templates/qwen2_5.jinja`).

    Example:
        >>> qwen2_5_chat_template().count("<|im_start|>") > 0
        True
    """
    return (resources.files("trl") / "chat_templates" / "qwen2_5.jinja").read_text(encoding="utf-8")


def _training_texts(corpus_texts: list[str] | None) -> list[str]:
    """Texts the BPE merges are learned from: the corpus, the prompts and MemPO-format turns of the demo rows."""
    from mempo_trl.context import DEFAULT_SYSTEM_PROMPT, initial_messages, render_gold_answer, render_information
    from mempo_trl.data import read_jsonl
    from mempo_trl.kit.demo_world import demo_paths

    paths = demo_paths()
    passages = {p["id"]: p["contents"] for p in read_jsonl(paths.corpus)}
    texts = list(corpus_texts) if corpus_texts is not None else list(passages.values())
    # The chat template's own words: roles, its default system prompt and the wrapper of tool messages.
    texts += ["system\nuser\nassistant\n<tool_response>\n</tool_response>", _QWEN_DEFAULT_SYSTEM_PROMPT]
    texts.append(DEFAULT_SYSTEM_PROMPT)
    for row in read_jsonl(paths.train) + read_jsonl(paths.test):
        docs = []
        for pid in row["supporting_ids"]:
            title, text = passages[pid].split("\n", 1)
            docs.append({"title": title.strip('"'), "text": text})
        gold, _ = render_gold_answer(row["golden_answers"], row["sub_answers"])
        texts += [
            initial_messages(row["question"])[1]["content"],
            f"<mem> Nothing yet. </mem>\n<think> I must search. </think>\n<search> {row['hop_queries'][0]} </search>",
            render_information(docs),
            f"<mem> The documents say: {gold} </mem>\n<think> I know the answer. </think>\n{gold}",
        ]
    return texts


def build_tiny_model(
    output_dir: str | Path,
    seed: int = 0,
    corpus_texts: list[str] | None = None,
    vocab_size: int = 2048,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
) -> Path:
    """Build and save a tiny `Qwen2ForCausalLM` and its tokenizer into `output_dir`; return the directory.

    The tokenizer is trained on `corpus_texts` (default: the shipped demo corpus) plus the demo questions and
    MemPO-format turns; `vocab_size` is an upper bound. `seed` fixes the weights (the global torch RNG is
    left untouched).

    Example:
        >>> import tempfile
        >>> model, tokenizer = load_tiny(build_tiny_model(tempfile.mkdtemp(), seed=0))
        >>> [tokenizer.decode([i]) for i in tokenizer("<mem> x </mem>").input_ids]
        ['<mem>', ' ', 'x', ' ', '</mem>']
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    out = Path(output_dir)
    # Qwen2's normalizer and pre-tokenizer (one token per digit), so that `Qwen2Tokenizer` gives the same ids.
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_training_texts(corpus_texts), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
        model_max_length=max_position_embeddings,
    )
    # Non-special: `decode(..., skip_special_tokens=True)`, which reward functions see, must keep the tags.
    tokenizer.add_tokens([*MEMPO_TAGS, *_QWEN_TOOL_TAGS], special_tokens=False)
    tokenizer.chat_template = qwen2_5_chat_template()

    dims = (hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, max_position_embeddings)
    return save_random_qwen2(out, tokenizer, len(tokenizer), seed, [tokenizer.eos_token_id], *dims)


def save_random_qwen2(
    output_dir: str | Path,
    tokenizer,
    vocab_size: int,
    seed: int,
    eos_token_ids: list[int],
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    max_position_embeddings: int,
) -> Path:
    """Save a random `Qwen2ForCausalLM` (tied embeddings) and `tokenizer` into `output_dir`; return it.

    `seed` fixes the weights (the global torch RNG is left untouched); generation ends on `eos_token_ids`.
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=list(eos_token_ids), pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    out = Path(output_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def load_tiny(path: str | Path):
    """Load `(model, tokenizer)` saved by `build_tiny_model`; the model is in eval mode on the CPU.

    Example:
        >>> import tempfile
        >>> model, tokenizer = load_tiny(build_tiny_model(tempfile.mkdtemp()))
        >>> model.config.model_type, model.config.hidden_size
        ('qwen2', 64)
    """
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(str(path))
    return model.eval(), load_tokenizer(path)
