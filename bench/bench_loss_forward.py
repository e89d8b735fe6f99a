"""The loss forward+backward alone, on a MemPO-shaped batch: TRL's fused head on every position vs the trained tokens
only (`loss_forward="padded"`) vs the shared-prefix forward (`loss_forward="shared_prefix"`).

The batch is what `MemPOTrainer` gives the loss at ``--rounds`` rounds: ``--questions`` x G trajectories, one row per
round; every row's prompt starts with its question's prefix (``--prefix`` tokens: system prompt, instruction,
question, of which ``--common`` are the same for every question), round 1's prompt is that prefix alone and every
later round's adds ``--tail`` tokens (its memory and search result), then a ``--completion``-token turn; prompts
left-padded and completions right-padded, as `round_tensors` pads them (random ids). Each path runs the
per-token log-probs and entropies (what TRL's `_compute_loss` asks for) and the backward of a weighted sum, on the
bench's random Qwen2 (`bench_memory_scoring.MODEL_DIMS`) with a ``--vocab``-row vocabulary, fp32, one thread;
``--repeats`` times, the minimum CPU time shown. It also checks that all paths agree (log-probs and gradients).

    python bench/bench_loss_forward.py                      # the bench's 8-round batch, tiny vocabulary
    python bench/bench_loss_forward.py --vocab 151936       # Qwen2.5's vocabulary
"""

import argparse
import time
from types import SimpleNamespace

import torch
from bench_memory_scoring import MODEL_DIMS  # run as a script: bench/ is on sys.path

from mempo_trl.grpo_mirror import GRPOMirror
from mempo_trl.loss_forward import shared_prefix_inputs


class Host(GRPOMirror):
    """What `_get_per_token_logps_and_entropies` reads of a trainer."""

    def __init__(self, loss_forward: str):
        from accelerate import Accelerator

        self.accelerator = Accelerator(cpu=True)
        self.args = SimpleNamespace(loss_forward=loss_forward)


def loss_batch(args, generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(input_ids, attention_mask, K)`` of the MemPO-shaped batch described in the module docstring."""
    common = torch.randint(10, args.vocab, (args.common,), generator=generator).tolist()
    prompts = []
    for _ in range(args.questions):
        question = torch.randint(10, args.vocab, (args.prefix - args.common,), generator=generator).tolist()
        for _ in range(args.num_generations):
            for t in range(args.rounds):
                tail = torch.randint(10, args.vocab, (args.tail if t else 0,), generator=generator).tolist()
                prompts.append(common + question + tail)
    width, k = max(map(len, prompts)), args.completion
    ids = torch.zeros((len(prompts), width + k), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) : width], mask[i, width - len(prompt) :] = torch.tensor(prompt), 1
        ids[i, width:] = torch.randint(10, args.vocab, (k,), generator=generator)
    return ids, mask, k


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--num-generations", type=int, default=2)
    parser.add_argument("--prefix", type=int, default=115, help="prompt tokens shared by a question's rows")
    parser.add_argument("--common", type=int, default=60, help="of those, the tokens shared by every question")
    parser.add_argument("--tail", type=int, default=167, help="prompt tokens after the prefix, rounds >= 2")
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1616)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    dims = MODEL_DIMS
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=dims["hidden_size"],
        intermediate_size=dims["intermediate_size"],
        num_hidden_layers=dims["num_layers"],
        num_attention_heads=dims["num_heads"],
        num_key_value_heads=dims["num_kv_heads"],
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).train()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    ids, mask, k = loss_batch(args, generator)
    shared = shared_prefix_inputs(ids, mask, k)
    paths = {
        "TRL 1.16 (head on every position)": (
            lambda: GRPOTrainer._get_per_token_logps_and_entropies(
                Host("padded"), model, ids, mask, k, compute_entropy=True
            ),
            ids.numel(),
            ids.numel() - ids.size(0),
        ),
        'loss_forward="padded" (head on trained tokens)': (
            lambda: Host("padded")._get_per_token_logps_and_entropies(model, ids, mask, k, compute_entropy=True),
            ids.numel(),
            int(mask[:, -k:].sum()),
        ),
        'loss_forward="shared_prefix"': (
            lambda: Host("shared_prefix")._get_per_token_logps_and_entropies(
                model, ids, mask, k, compute_entropy=True
            ),
            shared.tokens,
            int(mask[:, -k:].sum()),
        ),
    }
    weights = torch.randn(ids.size(0), k, generator=generator)
    print(
        f"batch: {ids.size(0)} rows x {ids.size(1)} ({args.questions} questions x G {args.num_generations} x "
        f"{args.rounds} rounds; prefix {args.prefix}, tail {args.tail}, completion {k}); vocabulary {args.vocab}; "
        f"model {dims}; fp32, 1 thread; min of {args.repeats}"
    )
    print()
    print("| loss forward | forwarded tokens | LM-head positions | fwd+bwd CPU s | vs TRL |")
    print("|---|---:|---:|---:|---:|")
    reference = base = None
    for name, (compute, tokens, head) in paths.items():
        times = []
        for _ in range(args.repeats):
            model.zero_grad()
            start = time.process_time()
            logps, entropies, _ = compute()
            ((logps + 0.01 * entropies) * weights).sum().backward()
            times.append(time.process_time() - start)
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        if reference is None:
            reference, base = (logps.detach(), grads), min(times)
        else:
            torch.testing.assert_close(logps.detach(), reference[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(grads, reference[1], rtol=1e-3, atol=1e-4)
        print(f"| {name} | {tokens:,} | {head:,} | {min(times):.2f} | {min(times) / base:.2f} |")


if __name__ == "__main__":
    main()
