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
