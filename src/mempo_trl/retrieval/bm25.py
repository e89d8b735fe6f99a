"""BM25 retrieval on bm25s, with an on-disk index cache keyed by the corpus content and the BM25 parameters."""

import dataclasses
import hashlib
import json
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import Stemmer

from mempo_trl.retrieval.base import Passage, check_search_args
from mempo_trl.retrieval.cache import CachedIndex, cache_root, load_or_build
from mempo_trl.retrieval.corpus import fingerprint, load_corpus


def _import_bm25s():
    """Import bm25s as if JAX were not installed, so that building or querying a retriever never starts JAX.

    When JAX is installed, bm25s imports ``jax.lax`` and calls ``jax.lax.top_k`` at import time: that starts JAX's GPU
    client, which by default preallocates 75% of every visible GPU's memory before training has begun. The retriever
    ranks scores with numpy and never uses bm25s's JAX top-k, so ``jax`` is hidden from bm25s while it is imported; a
    ``jax`` the caller imported is put back untouched. If bm25s was imported earlier with JAX available, it is too late:
    that is warned about, naming the fix.
    """
    if "bm25s" in sys.modules:
        module = sys.modules["bm25s"]
        if getattr(getattr(module, "selection", None), "JAX_IS_AVAILABLE", False):
            warnings.warn(
                "bm25s was imported before mempo_trl with JAX installed, and started JAX, which by default takes 75% "
                "of every visible GPU's memory: import mempo_trl before bm25s, or set "
                "XLA_PYTHON_CLIENT_PREALLOCATE=false in the environment.",
                stacklevel=3,
            )
        return module
    hidden = ("jax", "jax.lax")
    saved = {name: sys.modules[name] for name in hidden if name in sys.modules}
    sys.modules.update(dict.fromkeys(hidden))  # None: `import jax.lax` raises ImportError
    try:
        import bm25s
    finally:
        for name in hidden:
            if name in saved:
                sys.modules[name] = saved[name]
            else:
                del sys.modules[name]
    return bm25s


bm25s = _import_bm25s()

INDEX_FORMAT = 1
META_FILE = "mempo_bm25.json"
CORPUS_FILE = "corpus.jsonl"
STOPWORDS = "english"
STEMMER = "english"
"""PyStemmer algorithm of `from_corpus`; `None` indexes words as they are."""
K1, B = 1.5, 0.75
"""BM25 term-frequency saturation and length normalisation of `from_corpus`."""


class BM25Retriever(CachedIndex):
    """Okapi BM25 (Lucene variant) over title + text, with English stopwords removed and optional stemming.

    `search` is safe to call from several threads at once (each thread gets its own stemmer; scoring only
    reads the index). A query with no term in common with the corpus returns an empty list; so does a blank one.

    Example:
        >>> retriever = BM25Retriever.from_corpus("corpus.jsonl")  # builds, or reloads from the cache
        >>> retriever.cache_hit, retriever.cache_path
        (True, PosixPath('/root/.cache/mempo_trl/bm25/5d0c...'))
        >>> [p.title for p in retriever.search(["who wrote hamlet"], topk=3)[0]]
        ['Hamlet', 'William Shakespeare', 'Elsinore']
    """

    name = "bm25"

    def __init__(self, index: bm25s.BM25, passages: list[Passage], params: dict[str, Any]):
        if index.scores["num_docs"] != len(passages):
            raise ValueError(
                f"the index has {index.scores['num_docs']} documents but there are {len(passages)} passages"
            )
        self.index = index
        self.passages = passages
        self.params = params
        self._local = threading.local()

    @classmethod
    def from_corpus(
        cls,
        corpus: str | os.PathLike | Any,
        cache_dir: str | os.PathLike | None = None,
        stemmer: str | None = STEMMER,
        k1: float = K1,
        b: float = B,
        cached_only: bool = False,
    ) -> "BM25Retriever":
        """Load `corpus` (see `load_corpus`) and index it, reusing `<cache_dir>/<sha256>` when it exists.

        `cache_dir` defaults to `$MEMPO_CACHE/bm25` (`~/.cache/mempo_trl/bm25`). The key covers every passage
        and the parameters, so an edited corpus or new `k1`/`b`/`stemmer` builds a new entry. An entry is used only
        if its files match the content hashes recorded when it was written; otherwise it is rebuilt, with a warning.
        `cached_only`: read the entry, never build (`LookupError` when there is none).

        Example:
            >>> BM25Retriever.from_corpus("corpus.jsonl", cache_dir="/tmp/idx", stemmer=None, k1=1.2).cache_hit
            False
        """
        params = _params(stemmer, k1, b)
        passages = load_corpus(corpus)
        root = Path(cache_dir) if cache_dir is not None else cache_root() / "bm25"

        def load(entry: Path) -> "BM25Retriever | None":
            if not (entry / META_FILE).is_file():
                return None
            _verify_index(entry)
            return cls(bm25s.BM25.load(entry, show_progress=False), passages, params)

        return load_or_build(
            root / fingerprint(passages, params),
            load,
            lambda: cls(_build_index(passages, params), passages, params),
            lambda retriever, directory: retriever._save_index(directory),
            "BM25",
            cached_only,
        )

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "BM25Retriever":
        """Load an index written by `save`.

        Example:
            >>> BM25Retriever.load("my_index").num_passages
            21015324
        """
        directory = Path(directory)
        meta_path = directory / META_FILE
        if not meta_path.is_file():
            raise FileNotFoundError(
                f"{directory} is not a saved BM25 index (no {META_FILE}). Create one with BM25Retriever.save()."
            )
        params = json.loads(meta_path.read_text())
        if params.pop("sha256", None) is not None:
            _verify_index(directory)
        if params.get("format") != INDEX_FORMAT:
            raise ValueError(
                f"{directory} holds BM25 index format {params.get('format')!r}; this version reads format "
                f"{INDEX_FORMAT}. Rebuild it with BM25Retriever.from_corpus(...).save({str(directory)!r})."
            )
        return cls(bm25s.BM25.load(directory, show_progress=False), load_corpus(directory / CORPUS_FILE), params)

    def save(self, directory: str | os.PathLike) -> None:
        """Write the index and the passages to `directory`, loadable with `BM25Retriever.load`.

        Example:
            >>> retriever.save("my_index")
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with (directory / CORPUS_FILE).open("w", encoding="utf-8") as f:
            for passage in self.passages:
                f.write(json.dumps({"id": passage.id, "contents": passage.contents}, ensure_ascii=False) + "\n")
        self._save_index(directory)

    def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
        """Up to `topk` passages per query, best first, with their BM25 scores (only scores > 0).

        Example:
            >>> retriever.search(["capital of france", ""], topk=2)
            [[Passage(id='12', title='Paris', text='Paris is the capital of France.', score=3.1), ...], []]
        """
        check_search_args(queries, topk)
        tokens = bm25s.tokenize(
            queries, stopwords=STOPWORDS, stemmer=self._stemmer(), return_ids=False, show_progress=False
        )
        results: list[list[Passage]] = []
        for query_tokens in tokens:
            if not query_tokens:  # blank or stopwords only
                results.append([])
                continue
            scores = self.index.get_scores(query_tokens)
            # Top-k among the matching passages only: argpartition over all N, mostly zero, scores is ~4x slower.
            hits = np.flatnonzero(scores > 0)
            if len(hits) > topk:
                hits = hits[np.argpartition(-scores[hits], topk - 1)[:topk]]
            hits = hits[np.argsort(-scores[hits], kind="stable")]
            results.append(
                [dataclasses.replace(self.passages[doc], score=float(scores[doc])) for doc in hits.tolist()]
            )
        return results

    def _stemmer(self) -> Stemmer.Stemmer | None:
        # PyStemmer objects keep internal state and must not be shared between threads.
        if self.params["stemmer"] is None:
            return None
        if not hasattr(self._local, "stemmer"):
            self._local.stemmer = Stemmer.Stemmer(self.params["stemmer"])
        return self._local.stemmer

    def _save_index(self, directory: Path) -> None:
        self.index.save(directory, show_progress=False)
        hashes = {path.name: _sha256(path) for path in sorted(directory.iterdir()) if path.name != META_FILE}
        (directory / META_FILE).write_text(json.dumps({**self.params, "sha256": hashes}, indent=2))


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _verify_index(directory: Path) -> None:
    """Raise `ValueError` unless the index files are exactly those hashed in `META_FILE` when it was written."""
    hashes = json.loads((directory / META_FILE).read_text()).get("sha256")
    if not isinstance(hashes, dict) or not hashes:
        raise ValueError(f"{directory / META_FILE} records no content hashes (written by an older version)")
    present = {path.name for path in directory.iterdir() if path.name not in (META_FILE, CORPUS_FILE)}
    if present != set(hashes) - {CORPUS_FILE}:
        raise ValueError(f"the files in {directory} are not the ones indexed ({sorted(present ^ set(hashes))})")
    for name, expected in hashes.items():
        if _sha256(directory / name) != expected:
            raise ValueError(f"{directory / name} changed since the index was built (content hash mismatch)")


def _params(stemmer: str | None, k1: float, b: float) -> dict[str, Any]:
    if stemmer is not None and stemmer not in Stemmer.algorithms():
        raise ValueError(f"unknown stemmer {stemmer!r}; use None or one of {sorted(Stemmer.algorithms())}")
    return {
        "format": INDEX_FORMAT,
        "bm25s": bm25s.__version__,
        "method": "lucene",
        "stopwords": STOPWORDS,
        "stemmer": stemmer,
        "k1": float(k1),
        "b": float(b),
    }


def _build_index(passages: list[Passage], params: dict[str, Any]) -> bm25s.BM25:
    stemmer = Stemmer.Stemmer(params["stemmer"]) if params["stemmer"] else None
    texts = [f"{passage.title}\n{passage.text}" for passage in passages]
    tokens = bm25s.tokenize(texts, stopwords=STOPWORDS, stemmer=stemmer, show_progress=False)
    index = bm25s.BM25(k1=params["k1"], b=params["b"], method=params["method"])
    index.index(tokens, show_progress=False)
    return index
