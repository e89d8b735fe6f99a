"""`mempo-trl train --help`: the fields a MemPO run is about, first and short, printed without importing torch or TRL.

MemPO's own fields are read from the source of `MemPOConfig` (importing it would import TRL, tens of seconds), its
turn and memory fields from where they are declared (`TurnProtocol`, `MemoryRewardSettings`: their field metadata);
the recipe's `ScriptArguments` are read from source too; the retrieval and launch options come from their dataclasses. `--help_all` prints TRL's full parser help (every
field of `GRPOConfig`, `TrainingArguments` and `ModelConfig`).
"""

import ast
import importlib.util
from dataclasses import MISSING, fields
from pathlib import Path

from mempo_trl.protocol import TurnProtocol
from mempo_trl.settings import MemoryRewardSettings


COMMON_TRL_FIELDS = (
    "model_name_or_path", "output_dir", "overwrite_output_dir", "max_steps", "learning_rate", "num_generations",
    "per_device_train_batch_size", "max_completion_length", "temperature", "beta", "seed", "use_cpu", "bf16",
    "use_peft", "lora_r", "lora_target_modules", "use_vllm", "vllm_mode", "report_to", "push_to_hub", "hub_model_id",
    "resume_from_checkpoint",
)  # fmt: skip
"""GRPOConfig / ModelConfig fields a MemPO recipe usually sets, listed by name only."""

RECIPE = "mempo_trl.commands.recipe"
TRL_DATA_FIELDS = [
    ("dataset_name", "str", "", "QA data: a .jsonl/.json/.parquet file, a directory of {split}.jsonl files or a "
     "`datasets` name (FlashRAG or Search-R1 rows); with `environment`, a .jsonl of its reset rows."),
    ("dataset_config", "str", "", "`datasets` config name of `dataset_name`."),
    ("dataset_train_split", "str", "'train'", "Split to train on."),
    ("dataset_test_split", "str", "'test'", "Split (or QA file) to evaluate on (`heldout_questions`, "
     "`eval_strategy`); never the training rows."),
]  # fmt: skip
"""The fields of TRL's `ScriptArguments` a MemPO recipe uses (importing it would import TRL)."""


SETTINGS = {"TurnProtocol": TurnProtocol, "MemoryRewardSettings": MemoryRewardSettings}
"""The classes whose fields `MemPOConfig` re-exposes with `flat_field`."""


def config_fields(module: str = "mempo_trl.config", cls: str = "MemPOConfig") -> list[tuple[str, str, str, str]]:
    """(name, type, default, help) of the fields `cls` declares itself, read from its source; a `flat_field(Source,
    name)` field takes its default and help from ``Source``'s field (`mempo_trl.settings`).

    Example:
        >>> config_fields()[0]
        ('max_turns', 'int', '8', 'Rounds per episode at most.')
    """
    source = Path(importlib.util.find_spec(module).origin).read_text(encoding="utf-8")
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    found = []
    for item in node.body:
        if not isinstance(item, ast.AnnAssign) or not isinstance(item.value, ast.Call):
            continue
        kind = ast.get_source_segment(source, item.annotation)
        if isinstance(item.value.func, ast.Name) and item.value.func.id == "flat_field":
            source_cls, name = (SETTINGS[item.value.args[0].id], item.value.args[1].value)
            declared = next(f for f in fields(source_cls) if f.name == name)
            default = repr(declared.default)
            found.append(
                (
                    item.target.id,
                    kind,
                    default if len(default) <= 60 else default[:56] + "...",
                    declared.metadata["help"],
                )
            )
            continue
        keywords = {k.arg: k.value for k in item.value.keywords}
        default = ast.get_source_segment(source, keywords["default"]) if "default" in keywords else ""
        text = ""
        if "metadata" in keywords:
            metadata = keywords["metadata"]
            for key, value in zip(metadata.keys, metadata.values):
                if isinstance(key, ast.Constant) and key.value == "help":
                    text = ast.literal_eval(value)
        found.append((item.target.id, kind, default, text))
    return found


def _dataclass_fields(cls) -> list[tuple[str, str, str, str]]:
    rows = []
    for f in fields(cls):
        default = (
            f.default
            if f.default is not MISSING
            else (f.default_factory() if f.default_factory is not MISSING else "")
        )
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        rows.append(
            (f.name, kind, repr(default) if isinstance(default, str) else str(default), f.metadata.get("help", ""))
        )
    return rows


def _section(title: str, rows) -> list[str]:
    lines = [title]
    for name, kind, default, text in rows:
        shown = f" (default: {default})" if default not in ("", "None") else ""
        lines.append(f"  --{name} {kind.upper().replace(' | NONE', '')}")
        lines.append(f"      {text}{shown}")
    return [*lines, ""]


def short_help() -> str:
    """The text of `mempo-trl train --help`."""
    from mempo_trl.commands.launch import packaged_accelerate_configs
    from mempo_trl.retrieval.settings import RetrieverArguments

    launch = [
        ("accelerate_config", "name", "", f"Start the processes with this accelerate config: one shipped with the "
         f"package ({', '.join(sorted(packaged_accelerate_configs()))}) or a YAML path."),
        ("num_processes", "int", "", "Processes to start (with no --accelerate_config: cpu_ddp for a `use_cpu` recipe, "
         "else multi_gpu)."),
        ("main_process_port", "int", "", "Port of the launcher's rendezvous (also --num_machines, --machine_rank, "
         "--main_process_ip)."),
    ]  # fmt: skip
    lines = [
        "usage: mempo-trl train [--config recipe.yaml] [--FIELD VALUE ...] [--accelerate_config NAME --num_processes N]",
        "",
        "Train a MemPO search agent (TRL's GRPOTrainer with a multi-turn search rollout and the memory advantage).",
        "Every field can be set in the YAML recipe (`--config`) or on the command line, which wins.",
        "",
        *_section("MemPO (MemPOConfig's own fields):", config_fields()),
        *_section("Data and rewards (ScriptArguments):", TRL_DATA_FIELDS + config_fields(RECIPE, "ScriptArguments")),
        *_section("Retrieval:", _dataclass_fields(RetrieverArguments)),
        *_section("Launch (mempo-trl starts `accelerate launch` itself):", launch),
        "TRL fields a recipe usually sets (GRPOConfig, ModelConfig):",
        "  " + ", ".join(f"--{name}" for name in COMMON_TRL_FIELDS),
        "",
        "Every field of GRPOConfig, TrainingArguments and ModelConfig: mempo-trl train --help_all",
    ]
    return "\n".join(lines)
