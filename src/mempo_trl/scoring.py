"""Teacher-forced scoring of the gold answer under the full-history and memory contexts
(docs/algorithm.md, "Memory reward: P_full and P_mem").

For every round t >= 2 whose output holds a well-formed ``<mem>`` block, the rollout
(`mempo_trl.rollout.memory_scoring_items`) builds two sequences that end with the same gold-answer continuation ``<answer> GOLD </answer>``:

- ``full``: the full-history context of round t (all earlier rounds and their results) + the answer;
- ``mem``: ``system + user(question)`` + round t's ``<mem>`` block + the answer.

`answer_token_logps` scores a list of such items with one batched no-grad forward per chunk (contexts left-padded,
answers right-padded, positions counted from the first real token, logits untempered) and returns the per-token
log-probs of the answer and the mask of the GOLD tokens, ready for `mempo_trl.memory.answer_probability`;
`shared_prefix_answer_logps` gives the same values forwarding the contexts' shared prefixes once. Scoring forwards
run in eval mode (no dropout, so P_mem - P_full is not noise; the training flags are restored).
"""

import inspect
import os
from collections.abc import Sequence
from contextlib import contextmanager

import torch
from transformers import DynamicCache

from mempo_trl.context import ScoringItem
from mempo_trl.padding import pad_ids


SHARED_PREFIX_ATTENTION = ("sdpa", "eager")
"""Attention implementations that take the 4D masks of `shared_prefix_answer_logps`."""


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
    num_chunks: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Untempered log p(answer token | context) for each item.

    Args:
        model: a causal LM (the policy, a PEFT model or a reference model); run in eval mode here.
        items: N scoring items.
        pad_token_id: id used for padding (masked out).
        batch_size: items per forward.
        num_chunks: run exactly this many forwards (one per chunk of ``batch_size`` items; >= the number
            needed), the extra ones on a one-token placeholder, so that every process of a ZeRO-3 run issues the
            same number of forwards.

    Returns:
        ``logps`` (N, K) float32 and ``gold_mask`` (N, K) bool, K the longest answer; padded slots are 0 / False.
    """
    device = next(model.parameters()).device
    # Chunks of similar context lengths waste less padding; the original order is restored at the end.
    order = sorted(range(len(items)), key=lambda i: len(items[i].context_ids))
    chunks = [[items[i] for i in order[j : j + batch_size]] for j in range(0, len(order), batch_size)]
    if num_chunks is not None:
        if num_chunks < len(chunks):
            raise ValueError(f"num_chunks={num_chunks} is less than the {len(chunks)} chunks needed.")
        chunks += [None] * (num_chunks - len(chunks))
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


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    return len(os.path.commonprefix([list(a), list(b)]))


def pack_shared_prefix(
    items: Sequence[ScoringItem], group_keys: Sequence, max_block_tokens: int = 512
) -> list[tuple[list[int], list[int]]]:
    """Group items into rows ``(prefix_ids, item indices)`` for `shared_prefix_answer_logps`.

    Items of one key share a row whose prefix is the longest context among them; each item adds only its block:
    the tokens of its context after its longest common prefix with the row's prefix, and its answer. A row takes
    blocks of up to ``max(len(prefix), max_block_tokens)`` tokens in all (the block part of the attention is
    quadratic in it); an item that shares no token with the prefix, or does not fit, starts a row of its own.
    """
    rows: list[tuple[list[int], list[int]]] = []
    used: list[int] = []
    open_row: dict = {}
    for i in sorted(range(len(items)), key=lambda i: -len(items[i].context_ids)):
        ctx, k = items[i].context_ids, len(items[i].answer_ids)
        r = open_row.get(group_keys[i])
        if r is not None:
            prefix = rows[r][0]
            cut = _common_prefix_length(ctx, prefix)
            if cut > 0 and used[r] + len(ctx) - cut + k <= max(len(prefix), max_block_tokens):
                rows[r][1].append(i)
                used[r] += len(ctx) - cut + k
                continue
        open_row[group_keys[i]] = len(rows)
        rows.append((list(ctx), [i]))
        used.append(k)
    return rows


def cache_kwarg(model) -> str:
    """The keyword of the model's forward that takes a KV cache: ``cache`` (transformers >= 5.24) or
    ``past_key_values``, looked up on the innermost model (under PEFT and DeepSpeed wrappers)."""
    while True:
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        else:
            break
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def shared_prefix_answer_logps(
    model,
    items: Sequence[ScoringItem],
    group_keys: Sequence,
    pad_token_id: int,
    batch_size: int = 8,
    num_chunks: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as `answer_token_logps`, with the contexts that share a prefix forwarded once.

    The full-history contexts of the rounds of one trajectory are prefixes of each other (and the memory contexts of
    one question share the system and user messages), so scoring each separately is quadratic in the number of
    rounds. `pack_shared_prefix` puts the items of one key in one row: the longest context as the row's prefix and
    one block per item. Each chunk of ``batch_size`` rows takes two forwards:

    1. the prefixes, right-padded, plain causal attention (the fast kernel: padding only follows real tokens),
       into a KV cache;
    2. the blocks, one row per prefix, over that cache. Item i with cut c (its common prefix with the row's prefix)
       feeds ``prefix[c - 1]``, the rest of its context and its answer but the last token, at positions from
       c - 1; a 4D mask lets it see the first c - 1 prefix tokens and itself (causally), so the logits at its last
       K positions are those of a separate forward over ``context + answer`` up to float rounding (tested).

    Tokens: ``sum(len(prefix)) + sum(block)`` instead of ``sum(len(context) + K)``; the masked attention is only
    (block tokens) x (prefix + block tokens) per row. Needs an attention implementation that takes 4D masks
    (``sdpa`` or ``eager``, not flash-attention). The LM head sees only the ``sum(K)`` positions that predict an
    answer token (`_lm_head_inputs`); the mask is built on the model's device in its dtype.
    With ``num_chunks`` (>= the number needed), placeholder chunks keep every process in step (2 forwards each).

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
    if num_chunks is not None:
        if num_chunks < len(chunks):
            raise ValueError(f"num_chunks={num_chunks} is less than the {len(chunks)} chunks needed.")
        chunks += [None] * (num_chunks - len(chunks))
    cache_key = cache_kwarg(model)
    for chunk in chunks:
        batch = chunk or [([pad_token_id], [])]
        # One block per item: (row, its tokens, its first position, prefix tokens it sees, item).
        blocks, row_tokens = [], [0] * len(batch)
        for r, (prefix, idx) in enumerate(batch):
            for i in idx:
                item = items[i]
                cut = _common_prefix_length(item.context_ids, prefix)
                tokens = [prefix[cut - 1], *item.context_ids[cut:], *item.answer_ids[:-1]]
                blocks.append((r, tokens, cut - 1, item, i))
                row_tokens[r] += len(tokens)
        prefix_len = max(len(prefix) for prefix, _ in batch)
        block_len = max(1, *row_tokens)
        prefix_ids = torch.full((len(batch), prefix_len), pad_token_id, dtype=torch.long)
        for r, (prefix, _) in enumerate(batch):
            prefix_ids[r, : len(prefix)] = torch.tensor(prefix)
        input_ids = torch.full((len(batch), block_len), pad_token_id, dtype=torch.long)
        position_ids = torch.zeros((len(batch), block_len), dtype=torch.long)
        block_of = torch.full((len(batch), block_len), -1, dtype=torch.long)  # padding: -1
        visible = torch.ones((len(batch), block_len), dtype=torch.long)  # prefix tokens a query sees (padding: 1)
        # One entry per scored answer token: (row, position predicting it, its id, item, slot, gold).
        row_of, pos_of, token_of, item_of, slot_of, gold_of = [], [], [], [], [], []
        filled = [0] * len(batch)
        for j, (r, tokens, first, item, i) in enumerate(blocks):
            start, n, k = filled[r], len(tokens), len(item.answer_ids)
            input_ids[r, start : start + n] = torch.tensor(tokens)
            position_ids[r, start : start + n] = torch.arange(first, first + n)
            block_of[r, start : start + n] = j
            visible[r, start : start + n] = first
            row_of += [r] * k
            pos_of += range(start + n - k, start + n)
            token_of += item.answer_ids
            item_of += [i] * k
            slot_of += range(k)
            gold_of += item.answer_mask
            filled[r] += n
        block_of, visible = block_of.to(device), visible.to(device)
        query = torch.arange(block_len, device=device)
        # A block token sees the prefix tokens before its cut and the earlier tokens of its own block; a padding
        # query sees prefix token 0 and earlier padding, which keeps every row of the softmax non-empty.
        allowed = torch.cat(
            [
                torch.arange(prefix_len, device=device).view(1, 1, -1) < visible.unsqueeze(2),
                (block_of.unsqueeze(2) == block_of.unsqueeze(1)) & (query.view(1, 1, -1) <= query.view(1, -1, 1)),
            ],
            dim=2,
        )
        bias = torch.zeros((), dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
        del allowed
        cache = DynamicCache()
        rows_t = torch.tensor(row_of or [0], device=device)
        positions = torch.tensor(pos_of or [0], device=device)
        with eval_mode(model):
            model(input_ids=prefix_ids.to(device), use_cache=True, logits_to_keep=1, **{cache_key: cache})
            with _lm_head_inputs(model, rows_t, positions):
                logits = model(
                    input_ids=input_ids.to(device),
                    attention_mask=bias.unsqueeze(1),
                    position_ids=position_ids.to(device),
                    use_cache=True,
                    **{cache_key: cache},
                ).logits  # (P, V): one row per scored answer token
        del cache
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
