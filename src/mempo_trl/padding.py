"""Token id lists to padded batch tensors (TRL's `pad`), for generation, memory scoring and the kit's SFT."""

from collections.abc import Sequence

import torch
from trl.trainer.utils import pad


def pad_ids(sequences: Sequence[Sequence[int]], pad_id: int, side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, attention_mask)``, both (N, longest) long tensors, the sequences padded on `side`.

    Example:
        >>> ids, mask = pad_ids([[5, 6], [7]], pad_id=0)
        >>> ids.tolist(), mask.tolist()
        ([[5, 6], [0, 7]], [[1, 1], [0, 1]])
    """
    ids = pad([torch.tensor(list(s), dtype=torch.long) for s in sequences], padding_value=pad_id, padding_side=side)
    mask = pad([torch.ones(len(s), dtype=torch.long) for s in sequences], padding_value=0, padding_side=side)
    return ids, mask


def round_tensors(
    rows: Sequence,
    kept: Sequence[bool],
    placeholders: int,
    pad_id: int,
    pad_to_multiple_of: int | None = None,
    mask_truncated: bool = False,
) -> dict[str, torch.Tensor]:
    """The training batch of ``rows`` (anything with ``prompt_ids``, ``completion_ids`` and ``truncated``, e.g. the
    rollout's `TrainingRow`s) and ``placeholders`` placeholder rows (one pad token, completion fully masked):
    ``prompt_ids`` / ``prompt_mask`` (left padded) and ``completion_ids`` / ``completion_mask`` (right padded), each
    of shape (rows + placeholders, tokens), the widths multiples of ``pad_to_multiple_of`` when set (as in TRL), and
    ``real_rows`` (rows + placeholders,), bool: the rows that are ``kept`` (one flag per row). The completions of rows
    not kept, and with ``mask_truncated`` those of truncated rows, are fully masked.

    Example:
        >>> from types import SimpleNamespace as Row
        >>> rows = [Row(prompt_ids=[5, 6], completion_ids=[7], truncated=False)]
        >>> batch = round_tensors(rows, [True], placeholders=1, pad_id=0)
        >>> batch["prompt_ids"].tolist(), batch["completion_mask"].tolist(), batch["real_rows"].tolist()
        ([[5, 6], [0, 0]], [[1], [0]], [True, False])
    """
    prompts = [torch.tensor(r.prompt_ids) for r in rows] + [torch.tensor([pad_id])] * placeholders
    completions = [torch.tensor(r.completion_ids) for r in rows] + [torch.tensor([pad_id])] * placeholders
    masks = [torch.ones_like(c) for c in completions[: len(rows)]] + [torch.zeros(1, dtype=torch.long)] * placeholders
    completion_mask = pad(masks, padding_value=0, padding_side="right", pad_to_multiple_of=pad_to_multiple_of)
    if mask_truncated:
        truncated = torch.tensor([r.truncated for r in rows] + [False] * placeholders)
        completion_mask = completion_mask * (~truncated).unsqueeze(1).int()
    completion_mask = completion_mask * torch.tensor(list(kept) + [True] * placeholders).unsqueeze(1).int()
    prompt_mask = pad([torch.ones_like(p) for p in prompts], 0, "left", pad_to_multiple_of=pad_to_multiple_of)
    return {
        "prompt_ids": pad(prompts, pad_id, "left", pad_to_multiple_of=pad_to_multiple_of),
        "prompt_mask": prompt_mask,
        "completion_ids": pad(completions, pad_id, "right", pad_to_multiple_of=pad_to_multiple_of),
        "completion_mask": completion_mask,
        "real_rows": torch.tensor(list(kept) + [False] * placeholders),
    }
