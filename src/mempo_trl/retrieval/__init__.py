"""Search tool of the agent: `<search> query </search>` -> top-k passages.

Retrievers share one protocol, `search(queries, topk) -> list[list[Passage]]`: `BM25Retriever` (bm25s, in
process, cached on disk), `DenseRetriever` (sentence-transformers + faiss, `mempo_trl[dense]`) and
`HttpRetriever` (any server speaking Search-R1's `/retrieve` API, e.g. ours: `mempo-trl serve-retriever`).

Example:
    >>> from mempo_trl.retrieval import load_retriever
    >>> retriever = load_retriever("data/corpus.jsonl")  # or "http://127.0.0.1:8000"
    >>> [p.contents for p in retriever.search(["who wrote hamlet"], topk=3)[0]]
"""

from typing import Any

from mempo_trl.retrieval.base import Passage, RetrievalError, Retriever, RetrieverOutage
from mempo_trl.retrieval.bm25 import BM25Retriever
from mempo_trl.retrieval.corpus import CorpusError, load_corpus, parse_contents
from mempo_trl.retrieval.dense import DenseRetriever
from mempo_trl.retrieval.factory import load_retriever
from mempo_trl.retrieval.http_client import HttpRetriever
from mempo_trl.retrieval.settings import RetrieverArguments, build_retriever


__all__ = [
    "BM25Retriever",
    "CorpusError",
    "DenseRetriever",
    "HttpRetriever",
    "Passage",
    "RetrievalError",
    "Retriever",
    "RetrieverArguments",
    "RetrieverOutage",
    "build_retriever",
    "create_app",
    "load_corpus",
    "load_retriever",
    "parse_contents",
    "serve",
]


def __getattr__(name: str) -> Any:
    # The server needs the `mempo_trl[server]` extra (fastapi, uvicorn): import it only when asked for.
    if name in ("create_app", "serve"):
        from mempo_trl.retrieval import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
