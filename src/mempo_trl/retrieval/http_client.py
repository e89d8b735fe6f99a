"""Client for a retrieval server speaking Search-R1's `POST /retrieve` API (ours, Search-R1's, verl's, SkyRL's).

Request: `{"queries": [...], "topk": k, "return_scores": true}`. Response: `{"result": [[{"document": {"id",
"contents"}, "score": s}, ...], ...]}`, one list per query; servers asked without scores return the documents
directly. Every attempt has an overall deadline (connecting, sending, headers and body together) and a response
size cap. Connection errors, timeouts, 5xx and 429 are retried with capped exponential backoff (or after the
server's `Retry-After`, when it sends one), each logged, until `max_retries` or the `retry_budget` runs out; that
ends in a `RetrieverOutage`. Every other failure (4xx, redirects, which are never followed, oversized, malformed or
too deeply nested answers) is a `RetrievalError`. Both name the URL, what went wrong and how to fix it. An answer is
never silently empty.
"""

import json
import logging
import os
import time
import urllib.parse
from typing import Any

import httpx

from mempo_trl.http_limits import attempt_deadline, deadline_transport, retry_after_seconds
from mempo_trl.retrieval.base import Passage, RetrievalError, RetrieverOutage, check_search_args
from mempo_trl.retrieval.corpus import parse_contents


logger = logging.getLogger(__name__)

START_HINT = "Start one with `mempo-trl serve-retriever --corpus CORPUS.jsonl --port PORT`, or fix the URL."
API_KEY_ENV = "MEMPO_RETRIEVER_API_KEY"


def check_retriever_url(url: str) -> None:
    """Raise `ValueError` unless `url` is an http(s) URL without a user name or password: the server takes its API key
    as a bearer token (`$MEMPO_RETRIEVER_API_KEY`), and a `user:password@` would be sent as Basic auth and end up in
    error lines. The message never shows the password.

    Example:
        >>> check_retriever_url("http://alice:hunter2@127.0.0.1:8000")
        Traceback (most recent call last):
        ValueError: retriever URL 'http://***@127.0.0.1:8000' holds a user name or password. Remove them: the server takes its API key as a bearer token, set $MEMPO_RETRIEVER_API_KEY instead.
    """
    parts = urllib.parse.urlsplit(url)
    if "@" in parts.netloc:
        shown = urllib.parse.urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))
        raise ValueError(
            f"retriever URL {shown!r} holds a user name or password. Remove them: the server takes its API key as a "
            f"bearer token, set ${API_KEY_ENV} instead."
        )
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"retriever URL must start with http:// or https://, got {url!r}")


class _Retryable(Exception):
    """One failed attempt worth retrying; the message completes "the server ...". `retry_after`: the seconds the
    server asked the client to wait (`Retry-After`), or None."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


TIMEOUT = 30.0
"""Seconds one request may take, end to end."""
MAX_RETRIES = 3
"""Retries after a failed request; `None` retries until `RETRY_BUDGET` runs out (training)."""
RETRY_BUDGET = 600.0
"""Seconds an unreachable server is retried before `RetrieverOutage`."""


class HttpRetriever:
    """`Retriever` backed by a remote `/retrieve` endpoint; thread-safe, with a pool of keep-alive connections.

    `url` is the server's base URL or its `/retrieve` endpoint. Each attempt must deliver its whole answer within
    `timeout` seconds (checked as the body arrives, so a server trickling bytes cannot hang the caller) and at most
    `max_response_bytes`. A failed attempt (refused, dropped, timed out, HTTP 5xx or 429) is retried after
    `min(backoff * 2**i, max_backoff)` seconds, or after the server's `Retry-After`, while fewer than `max_retries`
    retries were made (`None`: no count limit) and less than `retry_budget` seconds passed since the first failure
    (a `Retry-After` beyond the budget ends it at once); then `RetrieverOutage` is raised. Other 4xx answers,
    redirects (never followed: the error names the target), oversized, malformed and too deeply nested answers are
    not retried. `api_key` (default: `$MEMPO_RETRIEVER_API_KEY`)
    is sent as a bearer token.

    Example:
        >>> retriever = HttpRetriever("http://127.0.0.1:8000")
        >>> retriever.search(["who wrote hamlet"], topk=3)[0][0].title
        'Hamlet'
        >>> HttpRetriever("http://10.0.0.5:8000", max_retries=None)  # training: ride out restarts
    """

    name = "http"

    def __init__(
        self,
        url: str,
        timeout: float = TIMEOUT,
        max_retries: int | None = MAX_RETRIES,
        backoff: float = 0.5,
        pool_size: int = 16,
        retry_budget: float = RETRY_BUDGET,
        max_backoff: float = 30.0,
        max_response_bytes: int = 256 * 2**20,
        api_key: str | None = None,
    ):
        check_retriever_url(url)
        if timeout <= 0 or retry_budget < 0 or max_response_bytes < 1 or (max_retries is not None and max_retries < 0):
            raise ValueError(
                f"HttpRetriever needs timeout > 0, retry_budget >= 0, max_response_bytes >= 1 and max_retries >= 0 "
                f"(or None), got {timeout=}, {retry_budget=}, {max_response_bytes=}, {max_retries=}."
            )
        base = url.rstrip("/")
        self.base_url = base.removesuffix("/retrieve")
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.retry_budget = retry_budget
        self.max_backoff = max_backoff
        self.max_response_bytes = max_response_bytes
        api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        headers = {"authorization": f"Bearer {api_key}"} if api_key else None
        limits = httpx.Limits(max_connections=pool_size, max_keepalive_connections=pool_size)
        self._client = httpx.Client(
            timeout=timeout, headers=headers, follow_redirects=False, transport=deadline_transport(limits)
        )

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

        One attempt, no retries: a start-up check that fails fast (`wait_ready` waits for a server still loading).

        Example:
            >>> retriever.health()["status"]
            'ok'
        """
        body = self._request("GET", f"{self.base_url}/health", retry=False)
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
                return self._request("GET", f"{self.base_url}/health", retry=False)
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

    def _request(self, method: str, url: str, payload: dict | None = None, retry: bool = True) -> Any:
        """One call under the retry policy (a single attempt when `retry` is False)."""
        retries = self.max_retries if retry else 0
        attempt, first_failure = 0, None
        while True:
            attempt += 1
            try:
                body = self._attempt(method, url, payload)
            except _Retryable as e:
                problem, retry_after = str(e), e.retry_after
            else:
                if first_failure is not None:
                    logger.warning(
                        "%s %s answered again after %.1fs of outage (%d attempts).",
                        method,
                        url,
                        time.monotonic() - first_failure,
                        attempt,
                    )
                return body
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            left = self.retry_budget - (now - first_failure)
            if (retries is not None and attempt > retries) or left <= 0 or (retry_after or 0) > left:
                beyond = (
                    f" It asked to be retried after {retry_after:g}s, beyond the retry budget." if retry_after else ""
                )
                raise RetrieverOutage(
                    f"{method} {url} failed after {attempt} attempt(s) over {now - first_failure:.1f}s: the server "
                    f"{problem}{beyond}"
                )
            delay = min(self.backoff * 2 ** (attempt - 1), self.max_backoff, left)
            delay = delay if retry_after is None else retry_after
            limit = "" if retries is None else f"/{retries + 1}"
            logger.warning(
                "%s %s attempt %d%s failed, retrying in %gs (%.0fs of retry budget left): %s",
                method,
                url,
                attempt,
                limit,
                delay,
                left,
                problem,
            )
            time.sleep(delay)

    def _attempt(self, method: str, url: str, payload: dict | None) -> Any:
        """One request: the parsed JSON answer, `_Retryable` for an outage, `RetrievalError` for anything else."""
        deadline = time.monotonic() + self.timeout
        try:
            with attempt_deadline(self.timeout), self._client.stream(method, url, json=payload) as response:
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > self.max_response_bytes:
                    raise self._too_large(method, url, f"announced {int(declared)} bytes")
                chunks, size = [], 0
                for chunk in response.iter_bytes():
                    size += len(chunk)
                    if size > self.max_response_bytes:
                        raise self._too_large(method, url, f"sent more than {self.max_response_bytes} bytes")
                    chunks.append(chunk)
                    if time.monotonic() > deadline:
                        raise _Retryable(
                            f"was still sending its answer after {self.timeout:g}s ({size} bytes so far). Check "
                            "the server's load and network, or raise `timeout`."
                        )
                status, content = response.status_code, b"".join(chunks)
                headers = response.headers
        except httpx.TimeoutException:
            raise _Retryable(
                f"did not send its whole answer within {self.timeout:g}s. Raise `timeout`, send smaller batches, or "
                "check the server's load."
            ) from None
        except httpx.ConnectError as e:
            raise _Retryable(f"refused the connection ({e}). Is the server running? {START_HINT}") from None
        except httpx.TransportError as e:
            raise _Retryable(f"dropped the connection ({type(e).__name__}: {e}). Check the server's log.") from None
        text = content[:300].decode("utf-8", "replace")
        if status >= 500 or status == 429:
            retry_after = retry_after_seconds(headers.get("retry-after"))
            busy = "is rate-limiting this client" if status == 429 else "is failing or overloaded"
            raise _Retryable(f"answered HTTP {status} ({busy}): {text!r}. Check the server's log.", retry_after)
        if 300 <= status < 400:
            raise RetrievalError(
                f"{method} {url} answered HTTP {status}, a redirect to {headers.get('location', '(no Location)')!r}; "
                "redirects are not followed. Point the retriever URL at the server itself."
            )
        if status >= 400:
            hint = (
                "the API key (--api_key / $MEMPO_RETRIEVER_API_KEY)"
                if status in (401, 403)
                else "the queries and topk"
            )
            raise RetrievalError(
                f"{method} {url} answered HTTP {status}: {text!r}. The request was rejected; check {hint} against "
                "the server's limits (see its /docs)."
            )
        try:
            return json.loads(content)
        except ValueError:
            raise RetrievalError(
                f"{method} {url} answered with malformed JSON: {text!r}. Is this a retrieval server speaking "
                "Search-R1's /retrieve API?"
            ) from None
        except RecursionError:
            raise RetrievalError(
                f"{method} {url} answered with JSON nested too deeply to read ({text[:60]!r}...). Is this a retrieval "
                "server speaking Search-R1's /retrieve API?"
            ) from None

    def _too_large(self, method: str, url: str, what: str) -> RetrievalError:
        return RetrievalError(
            f"{method} {url} {what}, over the client's cap of max_response_bytes={self.max_response_bytes}. Send "
            "fewer queries per request or a smaller topk, or raise max_response_bytes."
        )


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
    try:
        return repr(value)[:200]
    except RecursionError:
        return f"a {type(value).__name__} nested too deeply to show"
