"""A deterministic stand-in for vLLM, run under TRL's own `VLLMGeneration` (no GPU, no vllm package).

`install()` replaces what `trl.generation.vllm_generation` imports from vLLM (`LLM`, `SamplingParams`,
`VLLMClient`, `is_vllm_available`), so that TRL's real code paths run: server mode (gather, generate on the main
process, broadcast, slice by position), colocate mode with tensor parallelism (all-gather inside the TP group, slice by
position), `extract_logprobs` (NaN -> None), sleep mode and weight syncs.

The fake engine plays a scripted MemPO agent: a prompt holding the question ``Question: Q<k> ...`` gets the turn
``<mem>q<k> r<t></mem><think>t</think><search>q<k> r<t></search>``, ``t`` the round (one more than the last ``r<t>``
in the prompt), and ``<answer>A<k></answer>`` in round ``end_round(k) = 1 + k % 4``. So every completion names the
episode and the round it was generated for. Its log-probs are the real ones of a copy of the model loaded from the
same directory and kept in step by the weight syncs, so the trainer's importance-sampling ratio is 1 when rows and
tokens are aligned. ``NAN_ROUNDS`` ((k, t) pairs) makes the first log-prob of those turns NaN (None in server mode),
as vLLM reports it.
"""

import math
import re
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from mempo_trl.loading import load_tokenizer


NAN_ROUNDS: set[tuple[int, int]] = set()
SERVER_MODEL_DIR: list[str] = []
_QUESTION = re.compile(r"Question: Q(\d+)")
_ROUND = re.compile(r"q\d+ r(\d+)</mem>")


def end_round(k: int) -> int:
    """The round in which the scripted episode of question ``Q<k>`` answers."""
    return 1 + k % 4


def turn_text(k: int, t: int) -> str:
    if t >= end_round(k):
        return f"<mem>q{k} r{t}</mem><think>t</think><answer>A{k}</answer>"
    return f"<mem>q{k} r{t}</mem><think>t</think><search>q{k} r{t}</search>"


@dataclass
class Counters:
    syncs: int = 0  # weight loads that start a sync (first tensor of each pass)
    generate_calls: int = 0
    sleeps: int = 0
    prompts: list[int] = field(default_factory=list)  # prompts per generate call


class Engine:
    """The scripted policy plus a copy of the model for log-probs and weight loads."""

    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM

        self.tokenizer = load_tokenizer(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.params = dict(self.model.named_parameters())
        self.counters = Counters()
        self._first_name = next(iter(self.params))

    def load_weights(self, weights):
        for name, tensor in weights:
            if name == self._first_name:
                self.counters.syncs += 1
            self.params[name].data.copy_(tensor.to(self.params[name].dtype))

    def complete(self, prompt_ids: list[int]) -> tuple[list[int], list[float], tuple[int, int] | None]:
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        question = _QUESTION.search(text)
        if question is None:  # not an episode prompt
            ids = self.tokenizer("<think>t</think><answer>x</answer>", add_special_tokens=False)["input_ids"]
            key = None
        else:
            k = int(question.group(1))
            rounds = _ROUND.findall(text)
            t = int(rounds[-1]) + 1 if rounds else 1
            ids = self.tokenizer(turn_text(k, t), add_special_tokens=False)["input_ids"]
            key = (k, t)
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1 : -1]
        logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1)
        logps = logps.tolist()
        if key in NAN_ROUNDS:
            logps[0] = math.nan
        return ids, logps, key

    def run(self, prompts: list[list[int]]):
        self.counters.generate_calls += 1
        self.counters.prompts.append(len(prompts))
        return [self.complete(list(p)) for p in prompts]


@dataclass
class _Logprob:
    logprob: float
    rank: int = 1


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class FakeLLM:
    """`vllm.LLM` in colocate mode: ``generate`` returns `RequestOutput`-like objects."""

    def __init__(self, model: str, **kwargs):
        self.engine = Engine(model)
        self.kwargs = kwargs
        runner = SimpleNamespace(model=self.engine)
        self.llm_engine = SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner))
        )

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        limit = self.kwargs.get("max_model_len")
        for prompt in prompts:  # as vLLM's input processor (VLLMValidationError)
            if limit is not None and len(prompt["prompt_token_ids"]) > limit:
                raise ValueError(f"prompt of {len(prompt['prompt_token_ids'])} tokens > max_model_len={limit}")
        outputs = []
        for prompt, (ids, logps, _) in zip(prompts, self.engine.run([p["prompt_token_ids"] for p in prompts])):
            logprobs = [{token: _Logprob(lp)} for token, lp in zip(ids, logps)]
            completion = SimpleNamespace(token_ids=ids, logprobs=logprobs)
            outputs.append(SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"], outputs=[completion]))
        return outputs

    def sleep(self, level=1):
        self.engine.counters.sleeps += 1

    def wake_up(self, tags=None):
        pass

    def reset_prefix_cache(self):
        pass


class FakeVLLMClient:
    """`trl.generation.vllm_client.VLLMClient` talking to a fake server (built on the main process only)."""

    def __init__(self, base_url=None, group_port=None, connection_timeout=None, **kwargs):
        self.engine = Engine(SERVER_MODEL_DIR[0])

    def init_communicator(self, device=None):
        pass

    def get_server_info(self):
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}

    def generate(self, prompts, features=None, n=1, logprobs=0, **kwargs):
        assert n == 1, "MemPO generates one turn per prompt"
        results = self.engine.run(prompts)
        return {
            "prompt_ids": [list(p) for p in prompts],
            "completion_ids": [ids for ids, _, _ in results],
            "logprobs": [[[None if math.isnan(x) else x] for x in logps] for _, logps, _ in results],
            "logprob_token_ids": [[[token] for token in ids] for ids, _, _ in results],
        }

    def update_named_params(self, metadata, params):
        self.engine.load_weights(params)

    def reset_prefix_cache(self):
        pass


def colocate_env() -> dict[str, str]:
    """The environment TRL's colocate init writes (RANK, ..., a free MASTER_PORT), to set before it in one process."""
    from helpers import free_port

    port = str(free_port())
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}


def install(model_dir: str) -> None:
    """Make TRL's `VLLMGeneration` use the fakes (``model_dir``: the model the fake server serves)."""
    import trl.generation.vllm_generation as vllm_generation

    SERVER_MODEL_DIR[:] = [str(model_dir)]
    vllm_generation.is_vllm_available = lambda *args, **kwargs: True
    vllm_generation.LLM = FakeLLM
    vllm_generation.SamplingParams = FakeSamplingParams
    vllm_generation.VLLMClient = FakeVLLMClient


def engine_of(trainer) -> Engine | None:
    """The fake engine behind a trainer's `vllm_generation` (None on non-main processes in server mode)."""
    generation = trainer.vllm_generation
    if generation.mode == "colocate":
        return generation.llm.engine
    client = getattr(generation, "vllm_client", None)
    return client.engine if client is not None else None
