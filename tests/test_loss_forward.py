"""The loss forward: `GRPOMirror._get_per_token_logps_and_entropies` projects only the trained completion tokens
through the LM head, and with ``loss_forward="shared_prefix"`` forwards the rows' shared prompt prefixes once
(`mempo_trl.loss_forward`). Both must give TRL's per-token log-probs, entropies and gradients (fp32), on models
shaped by the three tokenizers the tests run under, and the same loss through the real trainer step.
"""

from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from datasets import Dataset
from helpers import GOLDS, SCRIPT, EchoRetriever, cpu_config, play_script
from trl import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

from mempo_trl import MemPOTrainer
from mempo_trl.grpo_mirror import GRPOMirror
from mempo_trl.kit.tiny import load_tiny
from mempo_trl.loss_forward import prefix_groups, shared_prefix_inputs, trained_mask


class Host(GRPOMirror):
    """What `_get_per_token_logps_and_entropies` reads of a trainer: ``accelerator`` and ``args.loss_forward``."""

    def __init__(self, loss_forward: str = "padded"):
        self.accelerator = Accelerator(cpu=True)
        self.args = SimpleNamespace(loss_forward=loss_forward)


def tiny_model(tokenizer, attention: str = "sdpa"):
    """A random 2-layer model with ``tokenizer``'s vocabulary (Llama for SmolLM2's, Qwen2 otherwise), fp32, with
    TRL's fused LM head."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    llama = tokenizer.pad_token_id == tokenizer.eos_token_id  # SmolLM2's
    config_class, model_class = (LlamaConfig, LlamaForCausalLM) if llama else (Qwen2Config, Qwen2ForCausalLM)
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        attn_implementation=attention,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_class(config)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model.train()


def loss_batch(tokenizer):
    """Rows as `round_tensors` pads them: two questions' rounds (one shared system prompt, a question each, different
    tails), completions of different lengths, one fully masked completion (a dropped row) and a placeholder row."""
    system = "<|im_start|>system\nYou are a search agent. Think, keep notes in <mem>, then act.<|im_end|>\n"
    questions = ["Where was the author of Dune born?", "Which river flows through the capital of Peru?"]
    tails = [
        "",
        "<information>Doc 1: Frank Herbert</information>",
        "<mem>notes on Tacoma</mem><information>x</information>",
    ]
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [encode(system + "<|im_start|>user\n" + q + "<|im_end|>\n" + t) for q in questions for t in tails]
    completions = [encode(text) for text in ("<mem>a</mem><search>Herbert</search>", "<answer>Tacoma</answer>")]
    completions = [completions[i % 2][: 3 + i] for i in range(len(prompts))]
    masks = [[1] * len(c) for c in completions]
    masks[4] = [0] * len(completions[4])  # a dropped group's row
    prompts.append([tokenizer.pad_token_id])  # a placeholder row
    completions.append([tokenizer.pad_token_id])
    masks.append([0])
    width, k = max(map(len, prompts)), max(map(len, completions))
    ids = torch.full((len(prompts), width + k), tokenizer.pad_token_id)
    attention = torch.zeros_like(ids)
    for i, (p, c, m) in enumerate(zip(prompts, completions, masks)):
        ids[i, width - len(p) : width], attention[i, width - len(p) : width] = torch.tensor(p), 1
        ids[i, width : width + len(c)], attention[i, width : width + len(c)] = torch.tensor(c), torch.tensor(m)
    return ids, attention, k


def logps_and_grads(model, compute, weights=None):
    """``compute(model)``'s log-probs and entropies, and the gradient of a weighted sum of both over every parameter."""
    model.zero_grad()
    logps, entropies, _ = compute(model)
    weights = torch.linspace(-1.0, 2.0, logps.numel()).view_as(logps)
    ((logps + 0.1 * entropies) * weights).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return logps.detach(), entropies.detach(), grads


def test_trained_mask_keeps_the_scored_completion_tokens():
    attention = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    assert trained_mask(attention, 2).tolist() == [[True, False], [False, False], [True, True]]


def test_prefix_groups_by_hand():
    # [1, 2, 3, ...] rows share 2 tokens once [1, 2, 7] joins (3 rows x 2 >= 2 rows x 3); [9, 9] shares nothing
    assert prefix_groups([[1, 2, 3, 4], [1, 2, 3, 5, 6], [9, 9], [1, 2, 7]]) == ([0, 0, 1, 0], [2, 1])
    # a prefix leaves every row one prompt token: [1, 2] caps the cut at 1
    assert prefix_groups([[1, 2, 3], [1, 2]]) == ([0, 0], [1])
    # joining would lower what the group saves (3 x 1 < 2 x 3): [1, 5] opens its own group
    assert prefix_groups([[1, 2, 3, 4], [1, 2, 3, 5], [1, 5]]) == ([0, 0, 1], [3, 1])


def test_shared_prefix_inputs_by_hand():
    # prompts [5 6 7 8] and [5 6 7 9 4] share 3 tokens; completions [1 2] and [3 (masked: attention 0)]
    ids = torch.tensor([[0, 5, 6, 7, 8, 1, 2], [5, 6, 7, 9, 4, 3, 0]])
    attention = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]])
    shared = shared_prefix_inputs(ids, attention, 2)
    assert shared.prefix_ids.tolist() == [[5, 6, 7]]
    assert shared.group_of_row.tolist() == [0, 0]
    # tails right-aligned: row 0 = [pad, 8, 1, 2], row 1 = [9, 4, 3, pad]
    assert shared.tail_ids.tolist() == [[7, 8, 1, 2], [9, 4, 3, 0]]
    assert shared.tail_positions.tolist() == [[2, 3, 4, 5], [3, 4, 5, 6]]
    # keys: 3 cached prefix tokens, then the 4 tail columns (own real tokens, causal; masked tokens never)
    c, t = [1, 1, 1], {0: [0, 0, 0, 0], 1: [0, 1, 0, 0], 2: [0, 1, 1, 0], 3: [0, 1, 1, 1]}
    assert shared.allowed.int().tolist()[0] == [c + t[0], c + t[1], c + t[2], c + t[3]]
    u = {0: [1, 0, 0, 0], 1: [1, 1, 0, 0], 2: [1, 1, 0, 0], 3: [1, 1, 0, 0]}
    assert shared.allowed.int().tolist()[1] == [c + u[0], c + u[1], c + u[2], c + u[3]]
    assert shared.tokens == 3 + 8 < ids.numel()
    assert shared_prefix_inputs(torch.tensor([[5, 1], [6, 2]]), torch.ones(2, 2, dtype=torch.long), 1) is None
    # two groups: [5 6 7 8] and [5 6 7 3] share 3 tokens; [9 4] shares none (its own prefix: [9], 1 token)
    ids = torch.tensor([[5, 6, 7, 8, 1], [5, 6, 7, 3, 1], [0, 0, 9, 4, 1]])
    shared = shared_prefix_inputs(ids, (ids != 0).long(), 1)
    assert shared.prefix_ids.tolist() == [[5, 6, 7], [9, 0, 0]] and shared.group_of_row.tolist() == [0, 0, 1]
    assert shared.tail_ids.tolist() == [[8, 1], [3, 1], [4, 1]] and shared.tail_positions.tolist() == [
        [3, 4],
        [3, 4],
        [1, 2],
    ]
    assert shared.allowed[:2, :, :3].all() and shared.allowed[2, :, :3].int().tolist() == [[1, 0, 0]] * 2


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_loss_forwards_give_trls_logps_entropies_and_gradients(any_tokenizer, attention):
    """TRL's own method (every position through the head, on the CPU) against the trained-token head (`padded`)
    and the shared-prefix forward, on the same batch; the shared prefix forwards fewer tokens."""
    model = tiny_model(any_tokenizer, attention)
    ids, mask, k = loss_batch(any_tokenizer)
    full = logps_and_grads(
        model,
        lambda m: GRPOTrainer._get_per_token_logps_and_entropies(Host(), m, ids, mask, k, compute_entropy=True),
    )
    assert (full[0][[0, 1, 2, 3, 5]] != 0).any(dim=1).all() and (full[0][[4, 6]] == 0).all()  # dropped, placeholder
    padded = logps_and_grads(
        model, lambda m: Host()._get_per_token_logps_and_entropies(m, ids, mask, k, batch_size=4, compute_entropy=True)
    )
    for got, want in zip(padded, full):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    host = Host("shared_prefix")
    shared = logps_and_grads(
        model, lambda m: host._get_per_token_logps_and_entropies(m, ids, mask, k, compute_entropy=True)
    )
    for got, want in zip(shared, full):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)
    assert shared_prefix_inputs(ids, mask, k).tokens < 0.8 * ids.numel()


def test_the_trainer_step_loss_is_the_full_heads(tiny_model_dir, tmp_path, monkeypatch):
    """One scripted MemPO batch (4 episodes, 7 rounds) through `_compute_loss`, the trainer's loss: TRL's
    every-position head, the trained-token head and the shared-prefix forward give one loss and one gradient."""
    model, tokenizer = load_tiny(tiny_model_dir)
    args = cpu_config(tmp_path, loss_type="grpo", max_turns=3)
    dataset = Dataset.from_list([{"question": q, "golden_answers": g} for q, g in GOLDS.items()])
    trainer = MemPOTrainer(model, EchoRetriever(), args=args, train_dataset=dataset, processing_class=tokenizer)
    play_script(trainer, tokenizer, monkeypatch)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what `Trainer.train` sets before its first step
    batch = trainer._generate_and_score_completions(
        [{"question": q, "golden_answers": GOLDS[q]} for q in SCRIPT for _ in range(2)]
    )
    assert batch["completion_ids"].size(0) == 2 + 1 + 1 + 3  # one row per round

    def loss_and_grads():
        trainer.model.zero_grad()
        loss = trainer._compute_loss(trainer.model, batch)
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])

    with monkeypatch.context() as patch:
        stock = GRPOTrainer._get_per_token_logps_and_entropies.__get__(trainer)
        patch.setattr(trainer, "_get_per_token_logps_and_entropies", stock)
        full_loss, full_grads = loss_and_grads()
    loss, grads = loss_and_grads()
    torch.testing.assert_close(loss, full_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads, full_grads, rtol=1e-6, atol=1e-7)
    trainer.args.loss_forward = "shared_prefix"
    loss, grads = loss_and_grads()
    assert full_loss.abs() > 1e-4
    torch.testing.assert_close(loss, full_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads, full_grads, rtol=1e-4, atol=2e-5)


def test_shared_prefix_loss_refuses_what_it_cannot_run(tiny_model_dir, tmp_path):
    model, tokenizer = load_tiny(tiny_model_dir)
    args = cpu_config(tmp_path, loss_forward="shared_prefix", activation_checkpointing=True)
    dataset = Dataset.from_list([{"question": "Where is Alpha?", "golden_answers": ["Paris"]}])
    with pytest.raises(ValueError, match="loss_forward='shared_prefix' does not support activation_checkpointing"):
        MemPOTrainer(model, EchoRetriever(), args=args, train_dataset=dataset, processing_class=tokenizer)
    with pytest.raises(ValueError, match="loss_forward must be one of"):
        cpu_config(tmp_path, loss_forward="packed")
