"""Teacher-forced scoring of the gold answer under the full-history and memory contexts
(docs/algorithm.md, "Memory reward: P_full and P_mem").

For every round t >= 2 whose output holds a well-formed ``<mem>`` block, `memory_scoring_items` builds two
sequences that end with the same gold-answer continuation ``<answer> GOLD </answer>``:

- ``full``: the full-history context of round t (all earlier rounds and their results) + the answer;
- ``mem``: ``system + user(question)`` + round t's ``<mem>`` block + the answer.

`answer_token_logps` scores a list of such items with one batched no-grad forward per chunk (contexts left-padded,
answers right-padded, positions counted from the first real token, logits untempered) and returns the per-token
log-probs of the answer and the mask of the GOLD tokens, ready for `mempo_trl.memory.answer_probability`.
Scoring forwards run in eval mode (no dropout, so P_mem - P_full is not noise; the training flags are restored) and
without a KV cache.
"""

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mempo_trl.context import render_prompt, round_messages
from mempo_trl.padding import pad_ids
from mempo_trl.protocol import render_gold_answer
from mempo_trl.rollout import Episode


SHARED_PREFIX_ATTENTION = ("sdpa", "eager")
"""Attention implementations that take the 4D masks of `shared_prefix_answer_logps`."""


@dataclass(frozen=True)
class ScoringItem:
    """A context and the answer continuation to score after it; ``answer_mask`` marks the GOLD tokens."""

    context_ids: list[int]
    answer_ids: list[int]
    answer_mask: list[int]


@dataclass(frozen=True)
class MemoryScoringPair:
    """The two scoring items of one round: ``round_index`` is 0-based (so always >= 1 here)."""

    round_index: int
    full: ScoringItem
    mem: ScoringItem


def gold_answer_tokens(tokenizer, golden_answers: Sequence[str], sub_answers=None) -> tuple[list[int], list[int]]:
    """Token ids of ``<answer> GOLD </answer>`` and the 0/1 mask of the tokens that overlap GOLD.

    Example:
        >>> ids, mask = gold_answer_tokens(tokenizer, ["Paris"])  # doctest: +SKIP
    """
    text, (start, end) = render_gold_answer(golden_answers, sub_answers)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(s < end and e > start) for s, e in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


def memory_scoring_items(episode: Episode, tokenizer) -> list[MemoryScoringPair]:
    """The (full, mem) scoring pair of every round t >= 2 of ``episode`` that wrote a well-formed ``<mem>``."""
    row = episode.row
    answer_ids, answer_mask = gold_answer_tokens(tokenizer, row["golden_answers"], row.get("sub_answers") or None)
    base_ids = render_prompt(tokenizer, episode.base_messages)
    history = episode.history()
    pairs = []
    for t, record in enumerate(episode.rounds):
        if t == 0 or record.turn.mem_span is None or len(history) < t:
            continue
        full_ids = render_prompt(tokenizer, round_messages(episode.base_messages, history[:t], "full_history"))
        start, end = record.turn.mem_span
        mem_ids = base_ids + tokenizer(record.text[start:end], add_special_tokens=False)["input_ids"]
        pairs.append(
            MemoryScoringPair(
                round_index=t,
                full=ScoringItem(full_ids, answer_ids, answer_mask),
                mem=ScoringItem(mem_ids, answer_ids, answer_mask),
            )
        )
    return pairs


def _pad_batch(items: Sequence[ScoringItem], pad_token_id: int) -> tuple[torch.Tensor, ...]:
    """Contexts left-padded, answers right-padded after them: (N, C + K) ids and mask, (N, K) answer ids and mask."""
    context_ids, context_mask = pad_ids([it.context_ids for it in items], pad_token_id, side="left")
    answer_ids, answer_attention = pad_ids([it.answer_ids for it in items], pad_token_id, side="right")
    gold, _ = pad_ids([it.answer_mask for it in items], 0, side="right")
    input_ids = torch.cat([context_ids, answer_ids], dim=1)
    attention = torch.cat([context_mask, answer_attention], dim=1)
    return input_ids, attention, answer_ids, gold.bool()


@contextmanager
def eval_mode(model):
    """Run ``model`` in eval mode (no dropout) and restore each module's ``training`` flag afterwards."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training


@torch.no_grad()
def answer_token_logps(
    model,
    items: Sequence[ScoringItem],
    pad_token_id: int,
    batch_size: int = 8,
    num_forwards: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Untempered log p(answer token | context) for each item.

    Args:
        model: a causal LM (the policy, a PEFT model or a reference model); run in eval mode here.
        items: N scoring items.
        pad_token_id: id used for padding (masked out).
        batch_size: items per forward.
        num_forwards: run exactly this many forwards (>= the number needed), the extra ones on a one-token
            placeholder, so that every process of a ZeRO-3 run issues the same number of forwards.

    Returns:
        ``logps`` (N, K) float32 and ``gold_mask`` (N, K) bool, K the longest answer; padded slots are 0 / False.
    """
    device = next(model.parameters()).device
    # Chunks of similar context lengths waste less padding; the original order is restored at the end.
    order = sorted(range(len(items)), key=lambda i: len(items[i].context_ids))
    chunks = [[items[i] for i in order[j : j + batch_size]] for j in range(0, len(order), batch_size)]
    if num_forwards is not None:
        if num_forwards < len(chunks):
            raise ValueError(f"num_forwards={num_forwards} is less than the {len(chunks)} forwards needed.")
        chunks += [None] * (num_forwards - len(chunks))
    all_logps, all_masks = [], []
    for chunk in chunks:
        batch = chunk or [ScoringItem([pad_token_id], [pad_token_id], [0])]
        input_ids, attention, answer_ids, answer_mask = _pad_batch(batch, pad_token_id)
        k = answer_ids.size(1)
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
        with eval_mode(model):
            logits = model(
                input_ids=input_ids.to(device),
                attention_mask=attention.to(device),
                position_ids=position_ids.to(device),
                logits_to_keep=k + 1,
                use_cache=False,
            ).logits[:, :-1]
        logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, answer_ids.to(device).unsqueeze(-1)).squeeze(-1)
        if chunk is not None:
            all_logps.append(logps.masked_fill(~answer_mask.to(device), 0.0))
            all_masks.append(answer_mask.to(device))
    if not all_logps:
        return torch.zeros((0, 0), device=device), torch.zeros((0, 0), dtype=torch.bool, device=device)
    width = max(x.size(1) for x in all_logps)
    logps = torch.cat([torch.nn.functional.pad(x, (0, width - x.size(1))) for x in all_logps])
    masks = torch.cat([torch.nn.functional.pad(x, (0, width - x.size(1))) for x in all_masks])
    restore = torch.empty(len(order), dtype=torch.long)
    restore[torch.tensor(order)] = torch.arange(len(order))
    return logps[restore.to(device)], masks[restore.to(device)]


def pack_shared_prefix(items: Sequence[ScoringItem], group_keys: Sequence) -> list[tuple[list[int], list[int]]]:
    """Group items into rows ``(prefix_ids, item indices)``: in a row every item's context is a prefix of the first
    (longest) one. Items of different keys, or whose context is not such a prefix, get rows of their own."""
    rows: list[tuple[list[int], list[int]]] = []
    by_key: dict = {}
    for i in sorted(range(len(items)), key=lambda i: -len(items[i].context_ids)):
        ctx = items[i].context_ids
        row = by_key.get(group_keys[i])
        if row is not None and rows[row][0][: len(ctx)] == ctx:
            rows[row][1].append(i)
        else:
            by_key.setdefault(group_keys[i], len(rows))
            rows.append((ctx, [i]))
    return rows


@torch.no_grad()
def shared_prefix_answer_logps(
    model,
    items: Sequence[ScoringItem],
    group_keys: Sequence,
    pad_token_id: int,
    batch_size: int = 8,
    num_forwards: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as `answer_token_logps`, with the contexts that share a prefix scored in one sequence.

    The full-history contexts of the rounds of one trajectory are prefixes of each other, so naive scoring is
    quadratic in the number of rounds. Here each trajectory (``group_keys`` equal) becomes ONE sequence: its longest
    context followed by one answer block per scored round; a 4D attention mask lets block j see only the first L_j
    context tokens and itself (causally), and its position ids continue at L_j. The log-probs are those of separate
    forwards up to float rounding (tested), for ``N + sum(K)`` tokens instead of ``sum(L_j + K)``.
    Needs an attention implementation that takes 4D masks (``sdpa`` or ``eager``, not flash-attention).

    Memory: the LM head sees only the ``sum(K)`` positions that predict an answer token, each row's own ones
    (`_lm_head_inputs`); the (rows, 1, T, T) mask is built on the model's device in its dtype.

    Returns:
        ``logps`` (N, K) float32 and ``gold_mask`` (N, K) bool, aligned with ``items``.
    """
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    rows = pack_shared_prefix(items, group_keys)
    width = max((len(it.answer_ids) for it in items), default=0)
    logps_out = torch.zeros((len(items), width), device=device)
    mask_out = torch.zeros((len(items), width), dtype=torch.bool, device=device)
    chunks = [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
    if num_forwards is not None:
        if num_forwards < len(chunks):
            raise ValueError(f"num_forwards={num_forwards} is less than the {len(chunks)} forwards needed.")
        chunks += [None] * (num_forwards - len(chunks))
    for chunk in chunks:
        batch = chunk or [([pad_token_id], [])]
        total = max(len(prefix) + sum(len(items[i].answer_ids) for i in idx) for prefix, idx in batch)
        input_ids = torch.full((len(batch), total), pad_token_id, dtype=torch.long)
        position_ids = torch.zeros((len(batch), total), dtype=torch.long)
        block = torch.full((len(batch), total), -1, dtype=torch.long)  # 0: shared context, j >= 1: answer block j
        visible = torch.zeros((len(batch), total), dtype=torch.long)  # context tokens an answer token also sees
        # One entry per scored answer token: (row, position predicting it, its id, item, slot, gold).
        row_of, pos_of, token_of, item_of, slot_of, gold_of = [], [], [], [], [], []
        for r, (prefix, idx) in enumerate(batch):
            n = len(prefix)
            input_ids[r, :n] = torch.tensor(prefix)
            position_ids[r, :n] = torch.arange(n)
            block[r, :n] = 0
            start = n
            for j, i in enumerate(idx, start=1):
                item, k = items[i], len(items[i].answer_ids)
                cut = len(item.context_ids)
                input_ids[r, start : start + k] = torch.tensor(item.answer_ids)
                position_ids[r, start : start + k] = torch.arange(cut, cut + k)
                block[r, start : start + k] = j
                visible[r, start : start + k] = cut
                row_of += [r] * k
                pos_of += [cut - 1, *range(start, start + k - 1)]
                token_of += item.answer_ids
                item_of += [i] * k
                slot_of += range(k)
                gold_of += item.answer_mask
                start += k
        block, visible = block.to(device), visible.to(device)
        key = torch.arange(total, device=device)
        # Query q sees key k when both are in the same block and k <= q (causal), or k is one of its context tokens;
        # padding (block -1) sees earlier padding only, which keeps every row of the softmax non-empty.
        allowed = (block.unsqueeze(2) == block.unsqueeze(1)) & (key.view(1, 1, -1) <= key.view(1, -1, 1))
        allowed |= key.view(1, 1, -1) < visible.unsqueeze(2)
        bias = torch.zeros((), dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
        del allowed
        rows_t = torch.tensor(row_of or [0], device=device)
        positions = torch.tensor(pos_of or [0], device=device)
        with eval_mode(model), _lm_head_inputs(model, rows_t, positions):
            logits = model(
                input_ids=input_ids.to(device),
                attention_mask=bias.unsqueeze(1),
                position_ids=position_ids.to(device),
                use_cache=False,
            ).logits  # (P, V): one row per scored answer token
        if not row_of:
            continue
        logps = torch.log_softmax(logits.float(), dim=-1)
        values = logps.gather(-1, torch.tensor(token_of, device=device).unsqueeze(-1)).squeeze(-1)
        gold = torch.tensor(gold_of, dtype=torch.bool, device=device)
        where = (torch.tensor(item_of, device=device), torch.tensor(slot_of, device=device))
        logps_out[where] = values.masked_fill(~gold, 0.0)
        mask_out[where] = gold
    return logps_out, mask_out


@contextmanager
def _lm_head_inputs(model, rows: torch.Tensor, positions: torch.Tensor):
    """While open, the model's LM head receives only ``hidden[rows, positions]`` ((P, H) instead of (B, T, H)).

    A forward pre-hook on ``model.get_output_embeddings()``: the model's own forward still runs (hooks of
    DeepSpeed/FSDP/PEFT, logit soft-capping or scaling after the head apply unchanged), and its ``logits`` come out
    as (P, V). Each row's own positions are gathered, not the union over rows, so the head costs ``P x V``.
    """
    handle = model.get_output_embeddings().register_forward_pre_hook(
        lambda _module, args: (args[0][rows, positions], *args[1:])
    )
    try:
        yield
    finally:
        handle.remove()
