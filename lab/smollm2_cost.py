"""What `long_horizon.py --learner smollm2` costs on this machine, before running it: SFT example lengths and the speed
of full fine-tuning SmolLM2-135M-Instruct on them.

Reads the world and base model that ``long_horizon.py --learner smollm2`` wrote (its ``--out``, default
``runs/long_horizon/passage_words_100/smollm2``: run that once, stopping it after the world is written), builds the
oracle SFT examples of ``--rows`` shuffled warm rows in both context modes (`mempo_trl.kit.warmstart.sft_examples`,
as the warm start does) and times ``--steps`` optimizer steps of ``SMOLLM2_WARM``'s batch of memory-mode rounds (fp32,
AdamW, micro-batches of one, so no padding; one thread). Prints tokens per round and tokens per second.

    python lab/smollm2_cost.py
"""

import argparse
import random
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/long_horizon/passage_words_100/smollm2")
    parser.add_argument("--rows", type=int, default=60)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()

    import torch
    from long_horizon import LEARNER_INSTRUCTION, SMOLLM2_WARM, WORLD
    from transformers import AutoModelForCausalLM

    from mempo_trl.data import read_jsonl
    from mempo_trl.kit.warmstart import sft_examples
    from mempo_trl.loading import load_tokenizer
    from mempo_trl.retrieval import BM25Retriever

    torch.set_num_threads(1)
    out = Path(args.out)
    tokenizer = load_tokenizer(out / "smollm2_base")
    retriever = BM25Retriever.from_corpus(str(out / "world" / "corpus.jsonl"), cache_dir=str(out / "bm25"))
    rows = read_jsonl(out / "world" / "warm.jsonl")
    random.Random(0).shuffle(rows)
    examples = {}
    for mode in ("memory", "full_history"):
        examples[mode] = []
        for n, row in enumerate(rows[: args.rows]):
            try:
                examples[mode] += sft_examples(
                    [row],
                    retriever,
                    tokenizer,
                    mode,
                    mem_drop=SMOLLM2_WARM["mem_drop"],
                    seed=n,
                    instruction=LEARNER_INSTRUCTION,
                    max_turns=max(WORLD["horizons"]) + 2,
                )
            except ValueError:  # a row the oracle cannot play: skipped, as by the warm start
                continue
        lengths = [len(p) + len(c) for p, c in examples[mode]]
        print(
            f"{mode}: {len(lengths)} rounds, tokens per round mean {statistics.mean(lengths):.0f}, max {max(lengths)}",
            flush=True,
        )
    model = AutoModelForCausalLM.from_pretrained(str(out / "smollm2_base"), dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=SMOLLM2_WARM["lr"])
    batch_size, pool = SMOLLM2_WARM["batch_size"], examples["memory"]
    random.Random(1).shuffle(pool)
    for step in range(args.steps):
        start, tokens = time.perf_counter(), 0
        for prompt, completion in pool[step * batch_size : (step + 1) * batch_size]:
            ids = torch.tensor([list(prompt) + list(completion)])
            tokens += ids.shape[1]
            (model(input_ids=ids, labels=ids).loss / batch_size).backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds = time.perf_counter() - start
        print(
            f"full fine-tuning step {step}: {seconds:.1f} s, {tokens} tokens, {tokens / seconds:.0f} tokens/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
