"""Helpers shared by the tests (fixtures live in conftest.py)."""

import socket
from pathlib import Path

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
