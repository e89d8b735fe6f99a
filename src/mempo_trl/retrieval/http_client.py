"""Client for a retrieval server speaking Search-R1's `POST /retrieve` API (ours, Search-R1's, verl's, SkyRL's).

Request: `{"queries": [...], "topk": k, "return_scores": true}`. Response: `{"result": [[{"document": {"id",
"contents"}, "score": s}, ...], ...]}`, one list per query; servers asked without scores return the documents
directly. Connection errors, timeouts and 5xx are retried with exponential backoff; every failure ends in a
`RetrievalError` that names the URL, what went wrong and how to fix it. An answer is never silently empty.
"""

import logging
import time
from typing import Any

import httpx

from mempo_trl.retrieval.base import Passage, RetrievalError, check_search_args
from mempo_trl.retrieval.corpus import parse_contents


logger = logging.getLogger(__name__)

START_HINT = "Start one with `mempo-trl serve-retriever --corpus CORPUS.jsonl --port PORT`, or fix the URL."


class HttpRetriever:
    """`Retriever` backed by a remote `/retrieve` endpoint; thread-safe, with a pool of keep-alive connections.

    `url` is the server's base URL or its `/retrieve` endpoint. Each call makes up to `1 + max_retries`
    attempts, sleeping `backoff * 2**i` seconds before retry `i + 1`; 4xx answers are not retried.

    Example:
        >>> retriever = HttpRetriever("http://127.0.0.1:8000")
        >>> retriever.search(["who wrote hamlet"], topk=3)[0][0].title
        'Hamlet'
    """

    name = "http"

    def __init__(
        self,
        url: str,
        timeout: float = 30.0,
        max_retries: int = 3,
        backoff: float = 0.5,
        pool_size: int = 16,
    ):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"retriever URL must start with http:// or https://, got {url!r}")
        base = url.rstrip("/")
        self.base_url = base.removesuffix("/retrieve")
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        limits = httpx.Limits(max_connections=pool_size, max_keepalive_connections=pool_size)
        self._client = httpx.Client(timeout=timeout, limits=limits)

    def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
        """Ask the server for up to `topk` passages per query.

        Example:
            >>> [[p.id for p in hits] for hits in retriever.search(["hamlet", "paris"], topk=2)]
            [['1', '3'], ['2']]
        """
        check_search_args(queries, topk)
        if not queries:
            return []
        url = f"{self.base_url}/retrieve"
        body = self._request("POST", url, {"queries": queries, "topk": topk, "return_scores": True})
        result = body.get("result") if isinstance(body, dict) else None
        if not isinstance(result, list):
            raise RetrievalError(
                f"{url} answered without a 'result' list (got {_excerpt(body)}). Is this a retrieval server "
                "speaking Search-R1's /retrieve API?"
            )
        if len(result) != len(queries):
            raise RetrievalError(
                f"{url} returned {len(result)} result lists for {len(queries)} queries; the server must answer "
                "each query in order. Check the server's version and log."
            )
        return [_parse_hits(hits, url, i) for i, hits in enumerate(result)]

    def health(self) -> dict[str, Any]:
        """The server's `GET /health` answer, e.g. `{"status": "ok", "num_passages": 3, "retriever": "bm25"}`.

        Example:
            >>> retriever.health()["status"]
            'ok'
        """
        body = self._request("GET", f"{self.base_url}/health")
        if not isinstance(body, dict):
            raise RetrievalError(f"{self.base_url}/health answered {_excerpt(body)}, not a JSON object.")
        return body

    def wait_ready(self, timeout: float = 60.0, interval: float = 0.2) -> dict[str, Any]:
        """Poll `GET /health` until the server answers (for a server still loading its index), then return it.

        Example:
            >>> HttpRetriever("http://127.0.0.1:8000").wait_ready(timeout=120)["num_passages"]
            21015324
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._request("GET", f"{self.base_url}/health", retries=0)
            except RetrievalError as e:
                if time.monotonic() >= deadline:
                    raise RetrievalError(f"Retrieval server not ready after {timeout:g}s: {e}") from e
            time.sleep(interval)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "HttpRetriever":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, url: str, payload: dict | None = None, retries: int | None = None) -> Any:
        retries = self.max_retries if retries is None else retries
        attempts = retries + 1
        for attempt in range(1, attempts + 1):
            try:
                response = self._client.request(method, url, json=payload)
            except httpx.TimeoutException:
                problem = (
                    f"did not answer within {self.timeout:g}s. Raise `timeout`, send smaller batches, or check "
                    "the server's load."
                )
            except httpx.ConnectError as e:
                problem = f"refused the connection ({e}). Is the server running? {START_HINT}"
            except httpx.TransportError as e:
                problem = f"dropped the connection ({type(e).__name__}: {e}). Check the server's log."
            else:
                if response.status_code < 400:
                    try:
                        return response.json()
                    except ValueError:
                        raise RetrievalError(
                            f"{method} {url} answered with malformed JSON: {response.text[:300]!r}. Is this a "
                            "retrieval server speaking Search-R1's /retrieve API?"
                        ) from None
                problem = f"answered HTTP {response.status_code}: {response.text[:300]!r}."
                if response.status_code < 500:
                    raise RetrievalError(
                        f"{method} {url} {problem} The request was rejected; check the queries and topk against the "
                        "server's limits (see its /docs)."
                    )
                problem += " Check the server's log."
            if attempt < attempts:
                delay = self.backoff * 2 ** (attempt - 1)
                logger.warning(
                    "%s %s attempt %d/%d failed, retrying in %gs: %s", method, url, attempt, attempts, delay, problem
                )
                time.sleep(delay)
        raise RetrievalError(f"{method} {url} failed after {attempts} attempt(s): the server {problem}")


def _parse_hits(hits: Any, url: str, query_index: int) -> list[Passage]:
    if not isinstance(hits, list):
        raise RetrievalError(f"{url}: result {query_index} is {_excerpt(hits)}, not a list of documents.")
    passages = []
    for hit in hits:
        scored = isinstance(hit, dict) and "document" in hit
        document, score = (hit["document"], hit.get("score", 0.0)) if scored else (hit, 0.0)
        if not isinstance(document, dict) or not isinstance(document.get("contents"), str):
            raise RetrievalError(
                f"{url}: result {query_index} holds {_excerpt(hit)}; expected {{'document': {{'id': ..., "
                "'contents': '\"Title\"\\ntext'}, 'score': ...}. Is this a Search-R1 style retrieval server?"
            )
        try:
            score = float(score)
        except (TypeError, ValueError):
            raise RetrievalError(f"{url}: result {query_index} has a non-numeric score {score!r}.") from None
        title, text = parse_contents(document["contents"])
        passages.append(Passage(id=str(document.get("id", "")), title=title, text=text, score=score))
    return passages


def _excerpt(value: Any) -> str:
    return repr(value)[:200]
