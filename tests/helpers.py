"""Helpers shared by the tests (fixtures live in conftest.py)."""

import math
import socket
from pathlib import Path

import torch

from mempo_trl.retrieval import Passage


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (just released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_lines(path: Path, lines: list[str]) -> Path:
    """Write `lines` to `path`, one per line; return `path`."""
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


class EchoRetriever:
    """One passage per query, about the query; records the queries."""

    def __init__(self):
        self.queries = []

    def search(self, queries, topk):
        self.queries += queries
        return [[Passage(id=q, title=f"T {q}", text=f"About {q}.")] for q in queries]


def scripted_scorers(tokenizer, probability):
    """Stand-ins for `answer_token_logps` and `shared_prefix_answer_logps` (patch them into `mempo_trl.trainer`):
    every gold token of an item gets ``log probability(model, decoded context)``, so that P = that probability."""

    def answer_token_logps(model, items, pad_token_id, batch_size=8, num_chunks=None):
        width = max((len(it.answer_ids) for it in items), default=0)
        logps, mask = torch.zeros(len(items), width), torch.zeros(len(items), width, dtype=torch.bool)
        for i, it in enumerate(items):
            n = sum(it.answer_mask)
            logps[i, :n] = math.log(probability(model, tokenizer.decode(it.context_ids, skip_special_tokens=False)))
            mask[i, :n] = True
        return logps, mask

    def shared_prefix_answer_logps(model, items, group_keys, pad_token_id, batch_size=8, num_chunks=None):
        return answer_token_logps(model, items, pad_token_id, batch_size, num_chunks)

    return answer_token_logps, shared_prefix_answer_logps
