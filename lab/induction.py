"""Does induction pretraining give the long-horizon learner the lookup its memory needs? Side by side, one run.

The lookup: a list of facts ``key : value .`` and then the keys again in another order, each ``key :`` to be
completed with its value (multi-query associative recall with a separator, as in a memory ``Name: 1801.``: the
token before the value is the ``:`` every fact shares, so the value must be found by the key one token further
back). The learner is `lab/long_horizon.py`'s (`mempo_trl.kit.learner.LEARNER_SIZE`, its `VOCABULARY_SIZE`); keys and
values are its regular tokens. Two arms from the same random weights:

- ``from_scratch``: trained on the lookup for ``--lookup_steps`` steps;
- ``induction``: `induction_pretraining.induction_pretrain` for ``--induction_steps`` steps first (the copy task),
  then the same lookup training.

Printed and written (``--out``, default ``lab/results/induction.json``): the copy loss of the induction stage, and
the lookup accuracy (greedy, 100 held-out lists) of each arm every 250 steps.

    python lab/induction.py                          # ~10 min on one core
    python lab/induction.py --quick --out /tmp/induction.json   # CI smoke
"""

import argparse
import json
import math
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from induction_pretraining import induction_pretrain, regular_token_ids
from long_horizon import VOCABULARY_SIZE


FACTS = 6
"""Facts per lookup list."""


def lookup_example(rng: random.Random, tokens: list[int], colon: int, dot: int) -> tuple[list, list, list]:
    """``FACTS`` facts ``key colon value dot`` of random tokens, then every key again in a random order followed by
    ``colon``, its value (labelled) and ``dot``. Returns ``(ids, labels, value positions)``.

    Example:
        >>> ids, labels, where = lookup_example(random.Random(0), list(range(10, 99)), colon=1, dot=2)
        >>> len(ids) == len(labels) == 8 * FACTS and len(where) == FACTS
        True
        >>> all(ids[p - 1] == 1 and labels[p] == ids[p] == ids[ids.index(ids[p - 2]) + 2] for p in where)
        True
    """
    keys = rng.sample(tokens, FACTS)
    values = [rng.choice(tokens) for _ in keys]
    ids = [t for key, value in zip(keys, values) for t in (key, colon, value, dot)]
    labels, where = [-100] * len(ids), []
    for i in rng.sample(range(FACTS), FACTS):
        ids += [keys[i], colon]
        labels += [-100, -100]
        where.append(len(ids))
        ids += [values[i], dot]
        labels += [values[i], -100]
    return ids, labels, where


def train_lookup(model, tokens, colon, dot, steps: int, lr: float, every: int, seed: int) -> list[dict]:
    """Train ``model`` on `lookup_example` batches of 16 (AdamW, ``lr`` after a 50-step warm-up, cosine to 0);
    return the held-out accuracy at step 0, every ``every`` steps and at the end."""
    import torch

    held_out = [lookup_example(random.Random(10_000 + i), tokens, colon, dot) for i in range(100)]

    def accuracy() -> float:
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids for ids, _, _ in held_out])).logits
        model.train()
        hits = [
            logits[n, p - 1].argmax().item() == ids[p] for n, (ids, _, where) in enumerate(held_out) for p in where
        ]
        return sum(hits) / len(hits)

    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    curve = [{"step": 0, "accuracy": accuracy()}]
    model.train()
    for step in range(1, steps + 1):
        batch = [lookup_example(rng, tokens, colon, dot) for _ in range(16)]
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, step / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
        loss = model(input_ids=torch.tensor([b[0] for b in batch]), labels=torch.tensor([b[1] for b in batch])).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % every == 0 or step == steps:
            curve.append({"step": step, "accuracy": accuracy()})
            print(f"  step {step}: lookup accuracy {curve[-1]['accuracy']:.3f}", flush=True)
    return curve


def main(argv: list[str] | None = None) -> int:
    import torch
    import transformers

    import mempo_trl
    from mempo_trl.kit.learner import LEARNER_SIZE
    from mempo_trl.kit.tiny import build_tiny_model
    from mempo_trl.loading import load_tokenizer
    from mempo_trl.outputs import OutputError, check_writable

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--induction_steps", type=int, default=3000)
    parser.add_argument("--lookup_steps", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="a few steps of each stage (CI smoke)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "induction.json")
    args = parser.parse_args(argv)
    if args.quick and args.out == parser.get_default("out"):
        print(
            "error: --quick would overwrite lab/results/induction.json; give --out a path of its own", file=sys.stderr
        )
        return 2
    try:  # the result is written after ~15 minutes: check its folder first
        check_writable(args.out.parent)
    except OutputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.quick:
        args.induction_steps, args.lookup_steps = 3, 3
    torch.set_num_threads(1)
    start = time.perf_counter()
    work = Path(tempfile.mkdtemp())
    try:
        base = build_tiny_model(work / "scratch", seed=0, **{**LEARNER_SIZE, "vocab_size": VOCABULARY_SIZE})
        tokenizer = load_tokenizer(base)
        colon, dot = (tokenizer(s, add_special_tokens=False)["input_ids"][0] for s in (":", "."))
        tokens = [i for i in regular_token_ids(tokenizer) if i not in (colon, dot)]
        induced = shutil.copytree(base, work / "induction")
        print(f"induction pretraining, {args.induction_steps} steps ...", flush=True)
        stats = induction_pretrain(induced, args.induction_steps)
        print(f"  copy loss {stats['initial_loss']:.3f} -> {stats['final_loss']:.3f}", flush=True)
        arms = {}
        for arm, path in (("from_scratch", base), ("induction", induced)):
            print(f"{arm}: lookup training, {args.lookup_steps} steps", flush=True)
            model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
            curve = train_lookup(model, tokens, colon, dot, args.lookup_steps, lr=1e-3, every=250, seed=0)
            arms[arm] = {"curve": curve, "final_accuracy": curve[-1]["accuracy"]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    command = "python lab/induction.py" + (" --quick" if args.quick else "")
    if not args.quick and (args.induction_steps, args.lookup_steps) != (3000, 1000):
        command += f" --induction_steps {args.induction_steps} --lookup_steps {args.lookup_steps}"
    result = {
        "learner": {**LEARNER_SIZE, "vocab_size": VOCABULARY_SIZE},
        "facts_per_list": FACTS,
        "induction": stats,
        "arms": arms,
        "command": command,
        "seconds": time.perf_counter() - start,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "mempo_trl": mempo_trl.__version__,
        },
        "machine": f"{platform.machine()} {platform.processor() or platform.platform()}, one thread",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(" | ".join(f"{arm}: lookup accuracy {cell['final_accuracy']:.3f}" for arm, cell in arms.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
