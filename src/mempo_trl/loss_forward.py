"""The loss forward's inputs: the LM head on the trained positions only, and the shared-prefix forward.

`GRPOMirror._get_per_token_logps_and_entropies` (TRL's method of that name) runs the model on a batch of
``[prompt | completion]`` rows (prompts left-padded, completions right-padded, the completions the last
``logits_to_keep`` columns) and returns the per-token log-probs of the completions. These pure functions give it:

- `trained_mask` and `hidden_at`: the hidden states that predict a trained completion token, and only those, go to
  the LM head (TRL 1.16 does this only on Triton devices; elsewhere its fused head projects every position);
- `prefix_groups` and `shared_prefix_inputs`: the rows that share a prompt prefix (a question's rounds share the
  system prompt, instruction and question) forward it once, into a KV cache kept in the autograd graph, and then
  only their own tails over it (``loss_forward="shared_prefix"``).
"""

import os
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch


def trained_mask(attention_mask: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """(B, K) bool, K = ``logits_to_keep``: the completion tokens the loss scores (attention mask 1 in the last K
    columns), as TRL's labels keep them.

    Example:
        >>> trained_mask(torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 0, 0]]), 2).tolist()
        [[True, False], [False, False]]
    """
    return attention_mask[:, -logits_to_keep:].bool()


@contextmanager
def hidden_at(backbone: torch.nn.Module, mask: torch.Tensor):
    """While open, ``backbone``'s output ``last_hidden_state`` (B, T, H) becomes (1, P, H): for each True of
    ``mask`` (B, K) at column j, the hidden state at T - K - 1 + j, which predicts that completion token.

    A forward hook: the model's own forward (and every wrapper around it: DDP, DeepSpeed, PEFT) still runs; TRL's
    fused LM head, called with ``shift_labels`` (1, P), then projects only those P positions. Positions are counted
    from the end of the hidden states, so virtual tokens a prompt-learning adapter prepends do not shift them.
    """
    rows, columns = mask.nonzero(as_tuple=True)

    def narrow(_module, _args, output):
        hidden = output.last_hidden_state
        output.last_hidden_state = hidden[rows, columns + hidden.size(1) - mask.size(1) - 1].unsqueeze(0)
        return output

    handle = backbone.register_forward_hook(narrow)
    try:
        yield
    finally:
        handle.remove()


def prefix_groups(prompts: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Rows that share a prompt prefix: ``(group of each row, prefix length of each group)``.

    Rows are taken in the order of their prompts' tokens (rows that share a prefix are neighbours); a row joins the
    open group when the prefix it shares with the group's first prompt, ``c'``, keeps the tokens the group saves
    from falling (``n * c' >= (n - 1) * c`` for a group of n rows with prefix c) and is not empty, else it opens a
    group. A prefix leaves at least one prompt token to every row (its last prompt token predicts the first
    completion token in the second pass).

    Example:
        >>> prefix_groups([[1, 2, 3, 4], [1, 2, 3, 5, 6], [9, 9], [1, 2, 7]])
        ([0, 0, 1, 0], [2, 1])
    """
    groups, cuts = [0] * len(prompts), []
    first, size = None, 0
    for i in sorted(range(len(prompts)), key=lambda i: list(prompts[i])):
        own = len(prompts[i]) - 1
        if first is not None:
            shared = min(cuts[-1], own, len(os.path.commonprefix([list(prompts[first]), list(prompts[i])])))
            if shared > 0 and (size + 1) * shared >= size * cuts[-1]:
                cuts[-1], size, groups[i] = shared, size + 1, len(cuts) - 1
                continue
        first, size = i, 1
        cuts.append(own)
        groups[i] = len(cuts) - 1
    return groups, cuts


@dataclass(frozen=True)
class SharedPrefixInputs:
    """The two forwards of `shared_prefix_inputs`.

    ``prefix_ids`` (G, C): each group's prefix, right-padded (plain causal attention, into a KV cache);
    ``group_of_row`` (B,): the cache row each tail reads; ``tail_ids`` / ``tail_positions`` (B, W): each row's tokens
    after its prefix, right-aligned so that the completions stay the last K columns, with their positions in the
    whole sequence; ``allowed`` (B, W, C + W) bool: which cached prefix tokens and which tail tokens each tail
    token attends to.
    """

    prefix_ids: torch.Tensor
    group_of_row: torch.Tensor
    tail_ids: torch.Tensor
    tail_positions: torch.Tensor
    allowed: torch.Tensor

    @property
    def tokens(self) -> int:
        """Positions the two forwards take (padding included)."""
        return self.prefix_ids.numel() + self.tail_ids.numel()


def shared_prefix_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int):
    """`SharedPrefixInputs` of a loss batch (``input_ids`` / ``attention_mask`` (B, T), prompts left-padded in the
    first T - K columns, completions in the last K = ``logits_to_keep``), grouped by `prefix_groups`; None when no
    row shares a prefix with another.

    A tail token attends to what it attends to in the padded batch: the real tokens before it (its group's cached
    prefix, then its own tail's tokens whose attention mask is 1). A padding query attends to its group's prefix (or
    to nothing; every score finite), so no softmax row is empty. Positions count from each row's first real token.
    """
    device, (rows, width) = input_ids.device, input_ids.shape
    prompt_width = width - logits_to_keep
    lengths = attention_mask[:, :prompt_width].sum(dim=1).tolist()
    ids = input_ids.tolist()
    prompts = [ids[i][prompt_width - n : prompt_width] for i, n in enumerate(lengths)]
    groups, cuts = prefix_groups(prompts)
    if len(cuts) == rows:
        return None
    prefix_len = max(cuts)
    prefix_ids = torch.zeros((len(cuts), prefix_len), dtype=torch.long)
    first_row = {g: i for i, g in reversed(list(enumerate(groups)))}
    for g, cut in enumerate(cuts):
        prefix_ids[g, :cut] = torch.tensor(prompts[first_row[g]][:cut], dtype=torch.long)
    # Tail of row i: original columns from start_i = (its first real column) + its cut
    starts = torch.tensor([prompt_width - n + cuts[g] for n, g in zip(lengths, groups)], device=device)
    offset = width - int((width - starts).max())  # first original column of the tails' window
    tail_ids = input_ids[:, offset:]
    columns = torch.arange(offset, width, device=device)
    first_real = torch.tensor([prompt_width - n for n in lengths], device=device)
    tail_positions = (columns.unsqueeze(0) - first_real.unsqueeze(1)).clamp(min=0)
    keys = attention_mask[:, offset:].bool() & (columns.unsqueeze(0) >= starts.unsqueeze(1))  # (B, W)
    causal = torch.ones((width - offset, width - offset), dtype=torch.bool, device=device).tril()
    cut_of_row = torch.tensor([cuts[g] for g in groups], device=device)
    cached = torch.arange(prefix_len, device=device).view(1, 1, -1) < cut_of_row.view(-1, 1, 1)
    allowed = torch.cat([cached.expand(-1, width - offset, -1), causal.unsqueeze(0) & keys.unsqueeze(1)], dim=2)
    return SharedPrefixInputs(
        prefix_ids.to(device), torch.tensor(groups, device=device), tail_ids, tail_positions, allowed
    )
