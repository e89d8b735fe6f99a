"""The model card of a MemPO run: TRL's card (`GRPOTrainer.create_model_card`) made into one a Hub visitor can act on.

`MemPOTrainer.create_model_card` writes TRL's card, then `mempo_model_card` rewrites its `README.md`:

- the base model line names something that resolves (a Hub id, or what the kit's `learner` / `tiny` are), and the
  front matter's license is the base model's (`base_model_license`; none when unknown);
- the quick start installs `mempo_trl` (from its repository) and runs the agent by its Hub id after a push, by its
  directory otherwise, as the task it was trained on writes it (`Task.usage`): a search agent on a question of its own
  training data and with the retriever it was trained with (`search_usage`), an environment agent on its environment
  class (`environment_usage`);
- "Training procedure" holds MemPO: base model, data, retriever, the held-out evaluation before and after training
  (when the run had one), the recipe, and the metrics of the last training step, labelled as such.

`trainer.model_card_info` (set by `mempo-trl train`) supplies ``base_model``, ``dataset``, ``retriever`` (a
description), ``retriever_arg`` (the URL or corpus path to search) and ``example_question``; `heldout_summary`
supplies the held-out result.
"""

import re
import textwrap
from pathlib import Path
from typing import Any


REPOSITORY = "https://github.com/mempo-trl/mempo_trl"
INSTALL = f'pip install "mempo_trl @ git+{REPOSITORY}"'
INSTALL_BLOCK = f"```bash\n{INSTALL}\n```\n\n"
HELDOUT_METRICS = ("em", "f1", "format_valid", "memory_recall")


def heldout_summary(callbacks) -> dict[str, float] | None:
    """``heldout/*`` metrics from a held-out evaluation callback (one with ``curve`` and ``rows``, e.g. the kit's
    `HeldOutEvalCallback`): the question count and, before and after training, the step and `HELDOUT_METRICS`
    ("after" only when a second evaluation ran: none when the evaluation after training was stopped).

    Example:
        >>> class Evaluated:
        ...     rows, curve = [{}, {}], [{"step": 0, "em": 0.5}, {"step": 40, "em": 1.0}]
        >>> heldout_summary([Evaluated()])
        {'heldout/questions': 2, 'heldout/step_before': 0, 'heldout/em_before': 0.5, 'heldout/step_after': 40, 'heldout/em_after': 1.0}
    """
    for callback in callbacks:
        curve, rows = getattr(callback, "curve", None), getattr(callback, "rows", None)
        if curve and rows is not None:
            summary: dict[str, float] = {"heldout/questions": len(rows)}
            for when, point in (("before", curve[0]), ("after", curve[-1]))[: min(len(curve), 2)]:
                summary[f"heldout/step_{when}"] = point["step"]
                summary.update({f"heldout/{k}_{when}": point[k] for k in HELDOUT_METRICS if k in point})
            return summary
    return None


def base_model_license(name: str) -> str | None:
    """The ``license`` in the front matter of the base model's own card: ``README.md`` in its folder (the kit's
    models write one), else in the local Hub cache (never fetched); None when neither says.

    Example:
        >>> base_model_license("Qwen/Qwen2.5-7B-Instruct")  # doctest: +SKIP
        'apache-2.0'
    """
    import yaml

    card = Path(name, "README.md")
    if not card.is_file() and not Path(name).exists():
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.errors import HFValidationError

        try:
            cached = try_to_load_from_cache(name, "README.md")
        except HFValidationError:  # not a Hub id
            cached = None
        card = Path(cached) if isinstance(cached, str) else card
    if not card.is_file():
        return None
    parts = card.read_text(encoding="utf-8").split("---\n", 2)
    if len(parts) < 3 or parts[0].strip():
        return None
    try:
        metadata = yaml.safe_load(parts[1])
    except yaml.YAMLError:
        return None
    value = metadata.get("license") if isinstance(metadata, dict) else None
    return value if isinstance(value, str) else None


def set_license(card: str, license: str | None) -> str:
    r"""TRL's front matter says ``licence: license`` (a misspelt key, a placeholder value): ``license: <license>``,
    or no such line when the license is unknown.

    Example:
        >>> set_license("---\nlibrary_name: transformers\nlicence: license\n---\n", "apache-2.0")
        '---\nlibrary_name: transformers\nlicense: apache-2.0\n---\n'
        >>> set_license("---\nlicence: license\ntags: []\n---\n", None)
        '---\ntags: []\n---\n'
    """
    line = f"license: {license}\n" if license else ""
    return re.sub(r"^licence: license\n", line, card, count=1, flags=re.M)


def describe_base_model(name: str) -> str:
    """The base model line of the card.

    Example:
        >>> describe_base_model("Qwen/Qwen2.5-3B-Instruct")
        '[Qwen/Qwen2.5-3B-Instruct](https://huggingface.co/Qwen/Qwen2.5-3B-Instruct)'
    """
    if Path(name).exists():
        return f"the local model `{name}` (not on the Hub)"
    return f"[{name}](https://huggingface.co/{name})"


def environment_usage(model_id: str, environment_factory) -> str:
    """The card's quick start for an agent trained on an environment: install, then the agent API on that
    environment class."""
    module, name = environment_factory.__module__, environment_factory.__qualname__
    return INSTALL_BLOCK + textwrap.dedent(
        f"""\
        ```python
        from mempo_trl import MemPOAgent
        from {module} import {name}

        agent = MemPOAgent.from_pretrained("{model_id}", environment_factory={name})
        result = agent.run({{...}})  # a row: the keyword arguments of {name}.reset
        print(result.answer, result.num_turns, result.memories)
        ```

        The agent reads its turn protocol (prompt, instruction, max turns) from `mempo_agent.json`, saved with
        the weights. Source and documentation: {REPOSITORY}."""
    )


def search_usage(model_id: str, retriever: str, question: str) -> str:
    """The card's quick start for a search agent: install, then the agent API and the CLI on ``question`` with
    ``retriever``."""
    retriever_flag = "--retriever_url" if retriever.startswith(("http://", "https://")) else "--corpus"
    return INSTALL_BLOCK + textwrap.dedent(
        f"""\
        ```python
        from mempo_trl import MemPOAgent

        agent = MemPOAgent.from_pretrained("{model_id}", retriever="{retriever}")
        result = agent.run({question!r})
        print(result.answer, result.memories)
        ```

        Or from the command line:
        `mempo-trl ask {question!r} --model_name_or_path {model_id} {retriever_flag} {retriever}`.
        The retriever is the one it was trained with (a JSONL corpus `{{"id", "contents"}}` or a Search-R1-style
        server, `mempo-trl serve-retriever --corpus corpus.jsonl`). The agent reads its turn protocol (prompt,
        instruction, max turns, top-k) from `mempo_agent.json`, saved with the weights. Source and documentation:
        {REPOSITORY}."""
    )


def _table(rows: list[tuple[str, str]], header: tuple[str, str]) -> list[str]:
    return [f"| {header[0]} | {header[1]} |", "| --- | --- |", *[f"| {a} | {b} |" for a, b in rows]]


def training_section(
    info: dict[str, Any],
    recipe: dict[str, Any],
    step_metrics: dict[str, float],
    step: int,
    heldout: dict[str, float] | None,
) -> list[str]:
    """The lines of the card's "Training procedure" section."""
    lines = [
        "Trained with [MemPO](https://arxiv.org/abs/2603.00680) (Self-Memory Policy Optimization) using "
        f"[`mempo_trl`]({REPOSITORY}) on [TRL](https://github.com/huggingface/trl): every turn the agent writes a "
        "`<mem>` summary, the next turn sees only that turn and its search result, and a memory-level advantage "
        "(P_mem - P_full of the gold answer) is added on the `<mem>` tokens.",
        "",
        f"- **base model**: {describe_base_model(str(info.get('base_model')))}",
        *[f"- **{key}**: {info[key]}" for key in ("dataset", "retriever") if info.get(key)],
        "",
    ]
    if heldout:
        n, before = int(heldout["heldout/questions"]), int(heldout["heldout/step_before"])
        if "heldout/step_after" in heldout:
            when = f"before (step {before}) and after (step {int(heldout['heldout/step_after'])}) training:"
            columns = ("before", "after")
        else:
            when = f"before training (step {before}) only (the evaluation after training was stopped):"
            columns = ("before",)
        lines += [
            "### Held-out evaluation",
            "",
            f"Greedy, on {n} held-out questions never trained on, {when}",
            "",
            f"| metric | {' | '.join(columns)} |",
            "| --- |" + " --- |" * len(columns),
            *[
                f"| {k} | " + " | ".join(f"{heldout[f'heldout/{k}_{c}']:.3f}" for c in columns) + " |"
                for k in HELDOUT_METRICS
                if f"heldout/{k}_before" in heldout
            ],
            "",
        ]
    lines += [
        "### Recipe",
        "",
        *_table([(f"`{k}`", f"`{v}`") for k, v in recipe.items()], ("field", "value")),
        "",
        "### Last training step",
        "",
        f"Logged at step {step}, each over that step's sampled episodes only (a few questions): a noisy reading, not "
        "an evaluation" + (" (that is the held-out table above)." if heldout else "."),
        "",
        *_table([(f"`{k}`", f"{v:.4g}") for k, v in sorted(step_metrics.items())], ("metric", "value")),
        "",
    ]
    return lines


def mempo_model_card(trainer, dataset_name: str | None = None) -> Path:
    """Rewrite the `README.md` that TRL's `create_model_card` wrote into ``trainer.args.output_dir``; return it."""
    from mempo_trl.config import MemPOConfig

    args = trainer.args
    info = {"base_model": trainer.model.config._name_or_path, "dataset": dataset_name, **trainer.model_card_info}
    card = Path(args.output_dir, "README.md")
    text = set_license(card.read_text(encoding="utf-8"), base_model_license(str(info["base_model"])))
    text = re.sub(
        r"This model is a fine-tuned version of .*?\.\n",
        lambda m: f"This model is a fine-tuned version of {describe_base_model(str(info['base_model']))}.\n",
        text,
        count=1,
    )
    model_id = args.hub_model_id if args.push_to_hub and args.hub_model_id else str(args.output_dir)
    usage = getattr(trainer.task, "usage", None)  # optional for a task of one's own: TRL's quick start stays
    if usage is not None:
        text = re.sub(
            r"(## Quick start\n\n)```python\n.*?```",
            lambda m: m.group(1) + usage(model_id, info),
            text,
            count=1,
            flags=re.S,
        )
    own_fields = [name for name in MemPOConfig.__annotations__ if name not in ("system_prompt", "instruction")]
    recipe = {name: getattr(args, name) for name in own_fields}
    recipe.update({name: getattr(args, name) for name in ("num_generations", "learning_rate", "beta", "loss_type")})
    final = trainer.final_metrics()
    step_metrics = {k: v for k, v in final.items() if k.split("/")[0] in ("episode", "memory", "tokens")}
    section = training_section(
        info,
        recipe,
        step_metrics,
        int(final.get("step", trainer.state.global_step)),
        heldout_summary(trainer.callback_handler.callbacks),
    )
    # TRL's "Training procedure" holds only tracking badges (empty without a tracker) and the method's paper line.
    procedure = re.search(r"## Training procedure\n(.*?)(?=\n### Framework versions)", text, flags=re.S)
    badges = (
        "\n".join(line for line in procedure.group(1).splitlines() if line.strip().startswith("["))
        if procedure
        else ""
    )
    body = "\n".join(["## Training procedure", "", *([badges, ""] if badges else []), *section])
    if procedure:
        text = text[: procedure.start()] + body + text[procedure.end() :]
    else:
        text += "\n" + body
    card.write_text(text, encoding="utf-8")
    return card
