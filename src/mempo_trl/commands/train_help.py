"""`mempo-trl train --help`: the fields a MemPO run is about, first and short, printed without importing torch.

Every section is generated from the dataclasses that declare the fields, with their own help: MemPO's fields from
their homes (`TurnProtocol`, `MemoryRewardSettings`, `DynamicSamplingSettings`, `RolloutLogSettings`,
`LossForwardSettings`, whose fields `MemPOConfig` re-exposes flat), the recipe's `ScriptArguments` (TRL's, with
MemPO's additions), the retrieval options; the TRL fields a recipe usually sets are listed by name. `--help_all` prints TRL's full parser help (every field of `GRPOConfig`,
`TrainingArguments` and `ModelConfig`).
"""

from dataclasses import MISSING, fields

from mempo_trl.protocol import TurnProtocol
from mempo_trl.settings import (
    DynamicSamplingSettings,
    LossForwardSettings,
    MemoryRewardSettings,
    RolloutLogSettings,
)


COMMON_TRL_FIELDS = (
    "model_name_or_path",
    "output_dir",
    "max_steps",
    "learning_rate",
    "num_generations",
    "per_device_train_batch_size",
    "max_completion_length",
    "temperature",
    "beta",
    "seed",
    "use_cpu",
    "bf16",
    "activation_checkpointing",
    "use_peft",
    "lora_r",
    "lora_target_modules",
    "use_vllm",
    "vllm_mode",
    "report_to",
    "push_to_hub",
    "hub_model_id",
    "resume_from_checkpoint",
)
"""GRPOConfig / ModelConfig fields a MemPO recipe usually sets, listed by name only."""

SETTINGS_HOMES = (
    (TurnProtocol, ("action", "max_completion_length", "chat_template_kwargs")),
    (MemoryRewardSettings, ()),
    (DynamicSamplingSettings, ()),
    (RolloutLogSettings, ()),
    (LossForwardSettings, ()),
)
"""The classes whose fields `MemPOConfig` re-exposes flat (`flat_field`), each with the fields it keeps to itself:
the turn protocol's ``action`` follows the retriever or environment, and ``max_completion_length`` and
``chat_template_kwargs`` are GRPO's own."""


def mempo_fields() -> list:
    """The dataclass fields `MemPOConfig` adds to `GRPOConfig` for MemPO, from their homes (`SETTINGS_HOMES`).

    Example:
        >>> mempo_fields()[0].name, mempo_fields()[0].default
        ('system_prompt', 'You are a helpful assistant.')
    """
    return [f for home, kept in SETTINGS_HOMES for f in fields(home) if f.name not in kept]


UNUSED_FIELDS = ("ignore_bias_buffers",)
"""Fields of TRL's `ScriptArguments` that MemPO's recipe does not read (left out of the help)."""


def _dataclass_fields(declared) -> list[tuple[str, str, str, str]]:
    """(name, type, default, help) of a dataclass's fields (or of a list of fields); a field with choices shows them
    as its type."""
    rows = []
    for f in fields(declared) if isinstance(declared, type) else declared:
        if f.name in UNUSED_FIELDS:
            continue
        default = (
            f.default
            if f.default is not MISSING
            else (f.default_factory() if f.default_factory is not MISSING else "")
        )
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if "choices" in f.metadata:
            kind = "{" + ",".join(map(str, f.metadata["choices"])) + "}"
        shown = repr(default) if isinstance(default, str) else str(default)
        rows.append((f.name, kind, shown if len(shown) <= 60 else shown[:56] + "...", f.metadata.get("help", "")))
    return rows


def _section(title: str, rows) -> list[str]:
    lines = [title]
    for name, kind, default, text in rows:
        shown = f" (default: {default})" if default not in ("", "None") else ""
        lines.append(f"  --{name} {kind if kind.startswith('{') else kind.upper().replace(' | NONE', '')}")
        lines.append(f"      {text}{shown}")
    return [*lines, ""]


def short_help() -> str:
    """The text of `mempo-trl train --help`."""
    from mempo_trl.commands.launch import packaged_accelerate_configs
    from mempo_trl.commands.recipe import ScriptArguments
    from mempo_trl.retrieval.settings import RetrieverArguments

    launch = [
        (
            "accelerate_config",
            "name",
            "",
            f"Start the processes with this accelerate config: one shipped with the "
            f"package ({', '.join(sorted(packaged_accelerate_configs()))}) or a YAML path.",
        ),
        (
            "num_processes",
            "int",
            "",
            "Processes to start (with no --accelerate_config: cpu_ddp for a `use_cpu` recipe, else multi_gpu).",
        ),
        (
            "main_process_port",
            "int",
            "",
            "Port of the launcher's rendezvous (also --num_machines, --machine_rank, --main_process_ip).",
        ),
    ]
    lines = [
        "usage: mempo-trl train [--config recipe.yaml] [--FIELD VALUE ...] [--accelerate_config NAME --num_processes N]",
        "",
        "Train a MemPO search agent (TRL's GRPOTrainer with a multi-turn search rollout and the memory advantage).",
        "Every field can be set in the YAML recipe (`--config`) or on the command line, which wins.",
        "",
        *_section("MemPO (MemPOConfig's own fields):", _dataclass_fields(mempo_fields())),
        *_section("Data and rewards (ScriptArguments):", _dataclass_fields(ScriptArguments)),
        *_section("Retrieval:", _dataclass_fields(RetrieverArguments)),
        *_section("Launch (mempo-trl starts `accelerate launch` itself):", launch),
        "TRL fields a recipe usually sets (GRPOConfig, ModelConfig):",
        "  " + ", ".join(f"--{name}" for name in COMMON_TRL_FIELDS),
        "",
        "Every field of GRPOConfig, TrainingArguments and ModelConfig: mempo-trl train --help_all",
    ]
    return "\n".join(lines)
