"""Shared types of the retrieval package: `Passage`, the `Retriever` protocol, `RetrievalError`, `RetrieverOutage`."""

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Passage:
    """One retrieved passage.

    `contents` is the wiki-18 / Search-R1 rendering: the title in quotes on the first line, then the text.

    Example:
        >>> Passage(id="7", title="Ada Lovelace", text="Ada wrote the first program.").contents
        '"Ada Lovelace"\\nAda wrote the first program.'
    """

    id: str
    title: str
    text: str
    score: float = 0.0

    @property
    def contents(self) -> str:
        return f'"{self.title}"\n{self.text}'


@runtime_checkable
class Retriever(Protocol):
    """Anything that answers a batch of queries with up to `topk` passages each, best first, in query order.

    A query with no match (blank, or no term in common with the corpus for BM25) gets an empty list.

    Example:
        >>> class Echo:
        ...     def search(self, queries, topk):
        ...         return [[Passage(id="0", title=q, text="")] for q in queries]
        >>> isinstance(Echo(), Retriever)
        True
    """

    def search(self, queries: list[str], topk: int) -> list[list[Passage]]: ...


class RetrievalError(RuntimeError):
    """A retriever could not answer; the message says where, what failed and how to fix it."""


class RetrieverOutage(RetrievalError):
    """A remote retriever stayed unreachable (refused, timed out, 5xx) for the client's whole retry budget.

    Training saves a checkpoint and stops on it (resume once the server is back); other errors are bugs to fix.
    """


def check_search_args(queries: list[str], topk: int) -> None:
    """Raise `TypeError`/`ValueError` unless `queries` is a list of strings and `topk` an integer >= 1.

    Example:
        >>> check_search_args(["who wrote Hamlet"], 0)
        Traceback (most recent call last):
        ValueError: topk must be >= 1, got 0
    """
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise TypeError(f"queries must be a list of strings, got {queries!r:.200}")
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise TypeError(f"topk must be an integer, got {topk!r}")
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
