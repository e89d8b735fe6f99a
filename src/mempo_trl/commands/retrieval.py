"""`mempo-trl build-index` / `mempo-trl serve-retriever`: index a corpus ahead of time, or serve it over HTTP.

Both read the retriever settings every command shares (`mempo_trl.retrieval.settings.RetrieverArguments`) and the
index settings below (defaults: the retriever classes' own).

    mempo-trl build-index --corpus data/wiki-18.jsonl                  # BM25, cached under $MEMPO_CACHE/bm25
    mempo-trl serve-retriever --corpus data/wiki-18.jsonl --port 8000  # reuses that cache
    mempo-trl serve-retriever --corpus data/corpus.jsonl --retriever_type dense --retriever_model models/e5-base-v2
"""

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

from mempo_trl.commands import add_command, parse
from mempo_trl.outputs import OutputError, check_port, check_writable
from mempo_trl.retrieval import bm25, dense, settings
from mempo_trl.retrieval.settings import RetrieverArguments, build_retriever


LOG_LEVELS = ["debug", "info", "warning", "error"]


@dataclass
class IndexArguments:
    """How an in-process index is built (`build-index`, `serve-retriever`)."""

    bm25_stemmer: str = field(default=bm25.STEMMER, metadata={"help": "PyStemmer algorithm of BM25, or `none`."})
    bm25_k1: float = field(default=bm25.K1, metadata={"help": "BM25 k1."})
    bm25_b: float = field(default=bm25.B, metadata={"help": "BM25 b."})
    dense_query_prefix: str = field(
        default=dense.QUERY_PREFIX, metadata={"help": "E5 style; '' for MiniLM-style models."}
    )
    dense_passage_prefix: str = field(
        default=dense.PASSAGE_PREFIX, metadata={"help": "Prefix of every encoded passage."}
    )
    dense_batch_size: int = field(default=dense.BATCH_SIZE, metadata={"help": "Passages per encoder batch."})
    dense_device: str | None = field(default=None, metadata={"help": "cpu, cuda, ... (default: the encoder's)."})

    def kwargs(self, retriever_type: str) -> dict:
        """The keyword arguments of `BM25Retriever.from_corpus` or `DenseRetriever.from_corpus`."""
        if retriever_type == "dense":
            return {
                "query_prefix": self.dense_query_prefix,
                "passage_prefix": self.dense_passage_prefix,
                "batch_size": self.dense_batch_size,
                "device": self.dense_device,
            }
        stemmer = None if self.bm25_stemmer.lower() == "none" else self.bm25_stemmer
        return {"stemmer": stemmer, "k1": self.bm25_k1, "b": self.bm25_b}


@dataclass
class ServeArguments:
    """Where and with which limits `serve-retriever` listens."""

    host: str = field(default="127.0.0.1", metadata={"help": "Interface to bind (0.0.0.0 for other machines)."})
    port: int = field(default=8000, metadata={"help": "Port to listen on."})
    max_queries: int = field(default=settings.MAX_QUERIES, metadata={"help": "Most queries per request."})
    max_topk: int = field(default=settings.MAX_TOPK, metadata={"help": "Largest topk accepted."})
    max_body_bytes: int = field(default=settings.MAX_BODY_BYTES, metadata={"help": "Largest request body accepted."})
    max_response_bytes: int = field(default=settings.MAX_RESPONSE_BYTES, metadata={"help": "Largest answer sent."})
    request_timeout: float = field(
        default=settings.REQUEST_TIMEOUT,
        metadata={
            "help": "Seconds a connection has to send a whole request (after connecting or after its last "
            "answer), and to read an answer, before it is closed: idle, slow and non-reading clients cannot "
            "hold connections (or answers) open."
        },
    )
    api_key: str | None = field(
        default=None, metadata={"help": "Require 'Authorization: Bearer KEY' (default: $MEMPO_RETRIEVER_API_KEY)."}
    )
    allowed_hosts: list[str] | None = field(
        default=None,
        metadata={
            "help": "Host header names answered (any port; `*`: any). Default: localhost, 127.0.0.1 and [::1] "
            "when bound to loopback (a web page cannot read the server by DNS rebinding), else any."
        },
    )
    log_level: str = field(default="info", metadata={"help": "Server log level.", "choices": LOG_LEVELS})


def _parse_index(prog: str, argv: list[str] | None, *extra_types: type) -> tuple:
    retriever_args, index_args, *rest = parse(prog, [RetrieverArguments, IndexArguments, *extra_types], argv)
    if not retriever_args.corpus or retriever_args.retriever_url:
        raise ValueError(f"{prog} indexes a corpus: pass --corpus CORPUS.jsonl (and no --retriever_url).")
    return retriever_args, index_args, *rest


def _build_reporting(retriever_args: RetrieverArguments, index_args: IndexArguments, **extra):
    start = time.perf_counter()
    retriever = build_retriever(retriever_args, **index_args.kwargs(retriever_args.retriever_type), **extra)
    action = "loaded from cache" if retriever.cache_hit else "built"
    print(
        f"{retriever_args.retriever_type} index of {retriever.num_passages} passages {action} in "
        f"{time.perf_counter() - start:.2f}s; cache: {retriever.cache_path or 'not written'}",
        flush=True,
    )
    return retriever


def build_index(argv: list[str] | None = None) -> int:
    """`mempo-trl build-index`: index a corpus into the cache that `serve-retriever`, `train` and `eval` reuse; a
    read-only cache that already holds the index is accepted (nothing to build)."""
    from mempo_trl.retrieval.cache import cache_root

    retriever_args, index_args = _parse_index("mempo-trl build-index", argv)
    kind = retriever_args.retriever_type
    root = Path(retriever_args.retriever_cache_dir or cache_root() / kind).expanduser()
    try:
        cache = check_writable(root, what="index cache")
    except OutputError:
        if not root.is_dir():
            raise
        try:  # read-only: fine if the index is there already
            _build_reporting(retriever_args, index_args, cached_only=True)
        except LookupError:
            raise OutputError(
                f"index cache {root} cannot be written and does not hold this index. Choose another "
                "--retriever_cache_dir or fix its permissions."
            ) from None
        print(f"the index is already built in {root} (read-only); nothing to write.", flush=True)
        return 0
    if _build_reporting(retriever_args, index_args).cache_path is None:
        raise OutputError(f"the index was built but could not be written to the cache {cache} (see the warning).")
    return 0


def serve_retriever(argv: list[str] | None = None) -> int:
    """`mempo-trl serve-retriever`: serve a corpus over Search-R1's `POST /retrieve` API."""
    from mempo_trl.retrieval.server import check_limits, check_request_timeout, serve

    retriever_args, index_args, args = _parse_index("mempo-trl serve-retriever", argv, ServeArguments)
    check_limits(args.max_queries, args.max_topk, args.max_body_bytes, args.max_response_bytes)
    check_request_timeout(args.request_timeout)
    check_port(args.host, args.port)
    retriever = _build_reporting(retriever_args, index_args)
    print(f"serving on http://{args.host}:{args.port} (POST /retrieve, GET /health)", flush=True)
    serve(
        retriever,
        args.host,
        args.port,
        args.max_queries,
        args.max_topk,
        args.log_level,
        max_body_bytes=args.max_body_bytes,
        max_response_bytes=args.max_response_bytes,
        api_key=args.api_key,
        request_timeout=args.request_timeout,
        allowed_hosts=args.allowed_hosts,
    )
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    add_command(subparsers, "build-index", "build (and cache) a retrieval index ahead of time", build_index)
    add_command(subparsers, "serve-retriever", "serve a corpus over Search-R1's POST /retrieve API", serve_retriever)
