"""`mempo-trl build-index` and `mempo-trl serve-retriever`.

Examples:
    mempo-trl build-index --corpus data/wiki-18.jsonl                  # BM25, cached under $MEMPO_CACHE/bm25
    mempo-trl serve-retriever --corpus data/wiki-18.jsonl --port 8000  # reuses that cache
    mempo-trl serve-retriever --corpus data/corpus.jsonl --retriever dense --model models/e5-base-v2
"""

import argparse
import time
from typing import Any

from mempo_trl.outputs import OutputError, check_port, check_writable


def add_cli(subparsers: Any) -> None:
    """Register `build-index` and `serve-retriever` on the `mempo-trl` parser.

    Example:
        >>> parser = argparse.ArgumentParser(); add_cli(parser.add_subparsers())
        >>> parser.parse_args(["build-index", "--corpus", "c.jsonl"]).retriever
        'bm25'
    """
    build = subparsers.add_parser(
        "build-index",
        help="build (and cache) a retrieval index ahead of time",
        description="Index a corpus into the on-disk cache that serve-retriever and training reuse.",
    )
    _add_index_args(build)
    build.set_defaults(func=_build_index)

    serve = subparsers.add_parser(
        "serve-retriever",
        help="serve a corpus over Search-R1's POST /retrieve API",
        description="Serve BM25 or dense retrieval over HTTP (POST /retrieve, GET /health).",
    )
    _add_index_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 for other machines)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max_queries", "--max-queries", type=int, default=4096, help="most queries per request")
    serve.add_argument("--max_topk", "--max-topk", type=int, default=100, help="largest topk accepted")
    serve.add_argument("--max_body_bytes", type=int, default=4 * 2**20, help="largest request body accepted")
    serve.add_argument("--max_response_bytes", type=int, default=64 * 2**20, help="largest answer sent")
    serve.add_argument(
        "--api_key", default=None, help="require 'Authorization: Bearer KEY' (default: $MEMPO_RETRIEVER_API_KEY)"
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=_serve)


def _add_index_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", required=True, help='JSONL corpus, one {"id", "contents"} object per line')
    parser.add_argument("--retriever", choices=["bm25", "dense"], default="bm25")
    parser.add_argument("--cache-dir", default=None, help="index cache (default: $MEMPO_CACHE/<retriever>)")
    bm25 = parser.add_argument_group("bm25")
    bm25.add_argument("--stemmer", default="english", help="PyStemmer algorithm, or 'none'")
    bm25.add_argument("--k1", type=float, default=1.5)
    bm25.add_argument("--b", type=float, default=0.75)
    dense = parser.add_argument_group("dense")
    dense.add_argument("--model", help="local sentence-transformers model directory (required for dense)")
    dense.add_argument("--query-prefix", default="query: ", help="E5 style; pass '' for MiniLM-style models")
    dense.add_argument("--passage-prefix", default="passage: ")
    dense.add_argument("--batch-size", type=int, default=64)
    dense.add_argument("--device", default=None, help="cpu, cuda, ... (default: the encoder's choice)")


def _make_retriever(args: argparse.Namespace) -> Any:
    if args.retriever == "dense":
        from mempo_trl.retrieval.dense import DenseRetriever

        if not args.model:
            raise ValueError("--retriever dense needs --model <local sentence-transformers directory>")
        return DenseRetriever.from_corpus(
            args.corpus,
            args.model,
            query_prefix=args.query_prefix,
            passage_prefix=args.passage_prefix,
            batch_size=args.batch_size,
            cache_dir=args.cache_dir,
            device=args.device,
        )
    from mempo_trl.retrieval.bm25 import BM25Retriever

    stemmer = None if args.stemmer.lower() == "none" else args.stemmer
    return BM25Retriever.from_corpus(args.corpus, cache_dir=args.cache_dir, stemmer=stemmer, k1=args.k1, b=args.b)


def _load_reporting(args: argparse.Namespace) -> Any:
    start = time.perf_counter()
    retriever = _make_retriever(args)
    action = "loaded from cache" if retriever.cache_hit else "built"
    print(
        f"{args.retriever} index of {retriever.num_passages} passages {action} in "
        f"{time.perf_counter() - start:.2f}s; cache: {retriever.cache_path or 'not written'}",
        flush=True,
    )
    return retriever


def _build_index(args: argparse.Namespace) -> int:
    from mempo_trl.retrieval.cache import cache_root

    cache = check_writable(args.cache_dir or cache_root() / args.retriever, what="index cache")
    if _load_reporting(args).cache_path is None:
        raise OutputError(f"the index was built but could not be written to the cache {cache} (see the warning).")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from mempo_trl.retrieval.server import check_limits, serve

    check_limits(args.max_queries, args.max_topk, args.max_body_bytes, args.max_response_bytes)
    check_port(args.host, args.port)
    retriever = _load_reporting(args)
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
    )
    return 0
