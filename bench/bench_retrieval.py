"""Retrieval benchmark: BM25 index build and batch throughput in process, then the real server under load.

Builds a deterministic synthetic corpus (Zipf-distributed pseudo-words), indexes it with `BM25Retriever`, measures
batched search, starts `mempo-trl serve-retriever` on a free loopback port and drives it from concurrent client
threads sharing one `HttpRetriever`. Exits non-zero if any request failed.

Usage:
    python bench/bench_retrieval.py
    python bench/bench_retrieval.py --passages 100000 --threads 16 --requests 200 --server-batch 16
"""

import argparse
import itertools
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mempo_trl.retrieval import BM25Retriever, HttpRetriever, RetrievalError


SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "zu", "bre", "dan", "fel", "gor", "hul", "kin", "mor"]


def make_vocabulary(rng: random.Random, size: int) -> list[str]:
    words: set[str] = set()
    while len(words) < size:
        words.add("".join(rng.choices(SYLLABLES, k=rng.randint(2, 4))))
    return sorted(words)


def write_corpus(path: Path, passages: int, seed: int) -> list[list[str]]:
    """Write `passages` rows of 40-120 Zipf-sampled words; return each passage's words (to draw queries from)."""
    rng = random.Random(seed)
    vocabulary = make_vocabulary(rng, 30_000)
    cum_weights = list(itertools.accumulate(1.0 / rank for rank in range(1, len(vocabulary) + 1)))
    texts = []
    with path.open("w", encoding="utf-8") as f:
        for i in range(passages):
            words = rng.choices(vocabulary, cum_weights=cum_weights, k=rng.randint(40, 120))
            title = " ".join(w.capitalize() for w in rng.sample(vocabulary, 2))
            f.write(json.dumps({"id": str(i), "contents": f'"{title}"\n{" ".join(words)}.'}) + "\n")
            texts.append(words)
    return texts


def make_queries(texts: list[list[str]], count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.sample(words, 5)) for words in rng.choices(texts, k=count)]


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bench_in_process(corpus: Path, cache_dir: Path, queries: list[str], batch: int, topk: int) -> None:
    start = time.perf_counter()
    retriever = BM25Retriever.from_corpus(corpus, cache_dir=cache_dir)
    print(f"BM25 build (load + tokenize + index + cache write): {time.perf_counter() - start:.2f}s")
    start = time.perf_counter()
    assert BM25Retriever.from_corpus(corpus, cache_dir=cache_dir).cache_hit
    print(f"BM25 reload from cache (load corpus + index):        {time.perf_counter() - start:.2f}s")
    start = time.perf_counter()
    for i in range(0, len(queries), batch):
        retriever.search(queries[i : i + batch], topk)
    elapsed = time.perf_counter() - start
    print(
        f"BM25 batch search: {len(queries) / elapsed:,.0f} queries/s ({len(queries)} queries, batch {batch}, topk {topk})"
    )


def bench_server(
    corpus: Path, cache_dir: Path, queries: list[str], threads: int, requests: int, batch: int, topk: int
) -> int:
    port = free_port()
    command = [sys.executable, "-m", "mempo_trl", "serve-retriever", "--corpus", str(corpus), "--port", str(port)]
    command += ["--cache-dir", str(cache_dir), "--log-level", "warning"]
    start = time.perf_counter()
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = HttpRetriever(f"http://127.0.0.1:{port}", pool_size=threads, max_retries=0)
        client.wait_ready(timeout=120)
        print(f"server ready (index from cache) in {time.perf_counter() - start:.2f}s")

        def one_request(i: int) -> float | None:
            chunk = [queries[(i * batch + j) % len(queries)] for j in range(batch)]
            sent = time.perf_counter()
            try:
                results = client.search(chunk, topk)
            except RetrievalError:
                return None
            return time.perf_counter() - sent if len(results) == len(chunk) else None

        total = threads * requests
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            outcomes = list(pool.map(one_request, range(total)))
        elapsed = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(timeout=30)
    latencies = [1000 * t for t in outcomes if t is not None]
    errors = total - len(latencies)
    print(
        f"server load: {threads} threads x {requests} requests x {batch} queries (topk {topk}): "
        f"{total / elapsed:,.0f} requests/s = {total * batch / elapsed:,.0f} queries/s"
    )
    print(
        f"latency ms: p50 {percentile(latencies, 50):.1f}  p90 {percentile(latencies, 90):.1f}  "
        f"p99 {percentile(latencies, 99):.1f}  max {max(latencies):.1f}; errors: {errors}"
    )
    return errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passages", type=int, default=20_000)
    parser.add_argument("--queries", type=int, default=2048, help="queries for the in-process batch benchmark")
    parser.add_argument("--batch", type=int, default=256, help="in-process batch size")
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--requests", type=int, default=100, help="requests per client thread")
    parser.add_argument("--server-batch", dest="server_batch", type=int, default=8, help="queries per request")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_retrieval_") as tmp:
        corpus, cache_dir = Path(tmp) / "corpus.jsonl", Path(tmp) / "cache"
        texts = write_corpus(corpus, args.passages, args.seed)
        print(f"corpus: {args.passages:,} synthetic passages, {corpus.stat().st_size / 2**20:.1f} MiB")
        queries = make_queries(texts, args.queries, args.seed + 1)
        bench_in_process(corpus, cache_dir, queries, args.batch, args.topk)
        errors = bench_server(corpus, cache_dir, queries, args.threads, args.requests, args.server_batch, args.topk)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
