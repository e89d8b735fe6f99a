"""`load_retriever`: one string (a URL or a corpus path) picks and builds a retriever, for Python callers.

The commands and recipes build theirs from typed settings instead (`mempo_trl.retrieval.settings`)."""

from pathlib import Path
from typing import Any

from mempo_trl.retrieval.base import Retriever
from mempo_trl.retrieval.bm25 import META_FILE, BM25Retriever
from mempo_trl.retrieval.http_client import HttpRetriever


def load_retriever(spec: str, **kwargs: Any) -> Retriever:
    """Build the retriever that `spec` names; `kwargs` go to its constructor.

    - `http://host:port` or `https://...` (optionally ending in `/retrieve`): `HttpRetriever(spec, **kwargs)`
    - `corpus.jsonl` or `bm25:<corpus>`: `BM25Retriever.from_corpus(corpus, **kwargs)`
    - a directory written by `BM25Retriever.save`: `BM25Retriever.load(directory)`

    Example:
        >>> load_retriever("http://127.0.0.1:8000", timeout=10).base_url
        'http://127.0.0.1:8000'
    """
    if spec.startswith(("http://", "https://")):
        return HttpRetriever(spec, **kwargs)
    if spec.startswith("bm25:"):
        return BM25Retriever.from_corpus(spec.removeprefix("bm25:"), **kwargs)
    if (Path(spec) / META_FILE).is_file():
        return BM25Retriever.load(spec, **kwargs)
    if spec.endswith(".jsonl"):
        return BM25Retriever.from_corpus(spec, **kwargs)
    raise ValueError(
        f"cannot tell which retriever {spec!r} names. Use http(s)://host:port, a corpus .jsonl file (BM25), "
        "bm25:<corpus> or a directory saved by BM25Retriever.save (dense: DenseRetriever.from_corpus)."
    )
