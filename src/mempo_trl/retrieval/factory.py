"""`load_retriever`: one string in a config or on the command line picks and builds a retriever."""

from pathlib import Path
from typing import Any

from mempo_trl.retrieval.base import Retriever
from mempo_trl.retrieval.bm25 import META_FILE, BM25Retriever
from mempo_trl.retrieval.dense import DenseRetriever
from mempo_trl.retrieval.http_client import HttpRetriever


def load_retriever(spec: str, **kwargs: Any) -> Retriever:
    """Build the retriever that `spec` names; `kwargs` go to its constructor.

    - `http://host:port` or `https://...` (optionally ending in `/retrieve`): `HttpRetriever(spec, **kwargs)`
    - `corpus.jsonl` or `bm25:<corpus>`: `BM25Retriever.from_corpus(corpus, **kwargs)`
    - a directory written by `BM25Retriever.save`: `BM25Retriever.load(directory)`
    - `dense:<model_dir>:<corpus>`: `DenseRetriever.from_corpus(corpus, model_dir, **kwargs)` (the corpus path
      is what follows the last colon)

    Example:
        >>> load_retriever("http://127.0.0.1:8000", timeout=10).base_url
        'http://127.0.0.1:8000'
        >>> load_retriever("dense:models/e5-base-v2:data/wiki-18.jsonl", batch_size=256).name
        'dense'
    """
    if spec.startswith(("http://", "https://")):
        return HttpRetriever(spec, **kwargs)
    if spec.startswith("dense:"):
        model, colon, corpus = spec.removeprefix("dense:").rpartition(":")
        if not colon or not model or not corpus:
            raise ValueError(f"dense retriever spec must look like dense:<model_dir>:<corpus.jsonl>, got {spec!r}")
        return DenseRetriever.from_corpus(corpus, model, **kwargs)
    if spec.startswith("bm25:"):
        return BM25Retriever.from_corpus(spec.removeprefix("bm25:"), **kwargs)
    if (Path(spec) / META_FILE).is_file():
        return BM25Retriever.load(spec, **kwargs)
    if spec.endswith(".jsonl"):
        return BM25Retriever.from_corpus(spec, **kwargs)
    raise ValueError(
        f"cannot tell which retriever {spec!r} names. Use http(s)://host:port, a corpus .jsonl file (BM25), "
        "bm25:<corpus>, a directory saved by BM25Retriever.save, or dense:<model_dir>:<corpus>."
    )
