"""Induction pretraining: the in-context copy skill a pretrained language model brings, given to a learner built
from scratch before its SFT warm start (`lab/long_horizon.py`).

A model that copies what it has seen (an induction head: attend to the token after an earlier occurrence of the
current context, copy it) can then learn in a few hundred SFT steps to write into its memory the value that follows
a name; a learner without one does not learn that lookup from the episodes at all (lab/learning.md; measured on the
bare skill by `lab/induction.py`). The copy task here forms the heads: random token sequences, each repeated after a
gap of random length, the loss on the repeat.
"""

import json
import random
import time
from pathlib import Path


INDUCTION_FILE = "induction.json"
"""Written into the model directory by `induction_pretrain`: its settings and stats."""


def regular_token_ids(tokenizer) -> list[int]:
    """The ids of ``tokenizer``'s vocabulary that are neither special nor added (tags, chat markers)."""
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    return [i for i in range(len(tokenizer)) if i not in special]


def copy_batch(rng: random.Random, token_ids: list[int], batch_size: int, max_length: int) -> tuple[list, list]:
    """``batch_size`` copy examples of the same length ``2 * max_length + 1``: a random sequence of
    ``max_length // 3`` to ``max_length`` tokens from ``token_ids``, a gap of random tokens, the sequence again, right
    padding with ``token_ids[0]``. Labels: the repeat's tokens after its first (-100 elsewhere), so only a model that
    copies from the earlier occurrence can lower the loss; the random lengths keep the offset from being the answer.

    Example:
        >>> ids, labels = copy_batch(random.Random(0), list(range(10, 50)), batch_size=2, max_length=6)
        >>> [len(x) for x in ids], [len(x) for x in labels]
        ([13, 13], [13, 13])
        >>> copied = [t for t, y in zip(ids[0], labels[0]) if y != -100]
        >>> copied == [y for y in labels[0] if y != -100] and len(copied) >= 1
        True
    """
    width = 2 * max_length + 1
    inputs, labels = [], []
    for _ in range(batch_size):
        n = rng.randint(max(2, max_length // 3), max_length)
        gap = rng.randint(0, width - 2 * n)
        sequence = [rng.choice(token_ids) for _ in range(n)]
        ids = sequence + [rng.choice(token_ids) for _ in range(gap)] + sequence
        target = [-100] * (n + gap + 1) + sequence[1:]
        pad = width - len(ids)
        inputs.append(ids + [token_ids[0]] * pad)
        labels.append(target + [-100] * pad)
    return inputs, labels


def induction_pretrain(
    model_dir: str | Path,
    steps: int,
    lr: float = 2e-3,
    batch_size: int = 16,
    max_length: int = 30,
    seed: int = 0,
    use_cpu: bool = True,
) -> dict:
    """Train the model in ``model_dir`` on `copy_batch` examples of its tokenizer's regular tokens for ``steps``
    AdamW steps (``lr`` after a 50-step warm-up, gradients clipped at 1) and save it back.

    Returns ``{"steps", "initial_loss", "final_loss", "seconds"}`` (the losses: mean of the first and last 50 steps,
    nats per copied token; ln V for a model that does not copy, near 0 for one that does), also written to
    ``INDUCTION_FILE`` with the settings. ``use_cpu=False`` trains on the accelerator when there is one. Raises
    ``ValueError`` for ``steps`` < 1.
    """
    if steps < 1:
        raise ValueError(f"induction pretraining needs steps >= 1, got {steps}")
    import torch
    from transformers import AutoModelForCausalLM

    from mempo_trl.loading import load_tokenizer

    start = time.perf_counter()
    model_dir = Path(model_dir)
    tokenizer = load_tokenizer(model_dir)
    token_ids = regular_token_ids(tokenizer)
    device = "cuda" if not use_cpu and torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng, losses = random.Random(seed), []
    for step in range(steps):
        ids, labels = copy_batch(rng, token_ids, batch_size, max_length)
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 50)
        loss = model(input_ids=torch.tensor(ids, device=device), labels=torch.tensor(labels, device=device)).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    model.save_pretrained(model_dir)
    window = min(50, steps)
    stats = {
        "steps": steps,
        "initial_loss": sum(losses[:window]) / window,
        "final_loss": sum(losses[-window:]) / window,
        "seconds": time.perf_counter() - start,
    }
    settings = {"lr": lr, "batch_size": batch_size, "max_length": max_length, "seed": seed}
    (model_dir / INDUCTION_FILE).write_text(json.dumps({"settings": settings, "stats": stats}, indent=2))
    return stats


if __name__ == "__main__":  # a module of the lab's scripts: running it would do nothing
    import sys

    sys.stderr.write(
        "error: lab/induction_pretraining.py is a module, not a script: induction.py and long_horizon.py import it (see lab/README.md).\n"
    )
    sys.exit(2)
