"""FastAPI server for any `Retriever`, speaking Search-R1's `POST /retrieve` API plus `GET /health`.

`POST /retrieve {"queries": [...], "topk": 3, "return_scores": true}` answers `{"result": [[{"document": {"id",
"contents"}, "score"}, ...], ...]}` (documents alone when `return_scores` is false), so Search-R1, verl and SkyRL
clients work unchanged. Searches run in FastAPI's thread pool, so one slow batch does not block `/health`.

Limits (checked at start-up, enforced per request): queries per request, topk, request body bytes (a body without
Content-Length, or chunked, is refused) and response bytes. A connection must send each whole request within `request_timeout`
seconds (default 10) of connecting or of its previous answer, or it is closed, so idle and slow (slow-loris) clients
cannot hold connections, and must read each answer within `request_timeout` seconds of its writing, or it is cut
off and the answer dropped, so clients that never read cannot pile answers up in memory; uvicorn also closes
keep-alive connections idle for 5 s after an answer. With an API key (`api_key`, or `$MEMPO_RETRIEVER_API_KEY`),
`/retrieve` needs `Authorization: Bearer <key>`; binding a non-loopback address without one logs a warning. Bound to
loopback, the server answers only `Host: localhost`, `127.0.0.1` or `[::1]` (any port) unless `--allowed_hosts`
says otherwise (HTTP 421), so a web page cannot read it through DNS rebinding.
"""

import hmac
import ipaddress
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

from mempo_trl.retrieval.base import Retriever
from mempo_trl.retrieval.http_client import API_KEY_ENV
from mempo_trl.retrieval.settings import (
    MAX_BODY_BYTES,
    MAX_QUERIES,
    MAX_RESPONSE_BYTES,
    MAX_TOPK,
    REQUEST_TIMEOUT,
)


try:
    import h11
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from pydantic import BaseModel, StrictBool, StrictInt, StrictStr
    from uvicorn.protocols.http.h11_impl import H11Protocol
except ImportError as e:
    raise ImportError(f"The retrieval server needs fastapi and uvicorn: pip install 'mempo_trl[server]' ({e}).") from e


logger = logging.getLogger(__name__)

EXAMPLE_REQUEST = '{"queries": ["who wrote hamlet"], "topk": 3, "return_scores": true}'


class RetrieveRequest(BaseModel):
    queries: list[StrictStr]
    topk: StrictInt = 3
    return_scores: StrictBool = False


def check_limits(max_queries: int, max_topk: int, max_body_bytes: int, max_response_bytes: int) -> None:
    """Raise `ValueError` naming the flag unless every limit is a positive integer (a server of 0 refuses all).

    Example:
        >>> check_limits(4096, 0, 2**22, 2**26)
        Traceback (most recent call last):
        ValueError: --max_topk must be an integer >= 1, got 0.
    """
    limits = {
        "max_queries": max_queries,
        "max_topk": max_topk,
        "max_body_bytes": max_body_bytes,
        "max_response_bytes": max_response_bytes,
    }
    for name, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name} must be an integer >= 1, got {value!r}.")


def check_request_timeout(request_timeout: float) -> None:
    """Raise `ValueError` unless `request_timeout` is a positive finite number of seconds.

    Example:
        >>> check_request_timeout(0)
        Traceback (most recent call last):
        ValueError: --request_timeout must be a number of seconds > 0, got 0.
    """
    valid = isinstance(request_timeout, int | float) and not isinstance(request_timeout, bool)
    if not valid or not 0 < request_timeout < float("inf"):
        raise ValueError(f"--request_timeout must be a number of seconds > 0, got {request_timeout!r}.")


class RequestDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, plus: a connection that has not sent a whole request `request_timeout` seconds after
    connecting (or after its previous answer) is closed, and one that reads nothing of its answer for
    `request_timeout` seconds while the unsent part is over the transport's high-water mark (64 KiB), or has not
    read its whole answer `request_timeout` seconds after it was written, is cut off and the answer dropped.
    uvicorn itself only times out idle keep-alive connections after an answer, waits for a non-reading client
    forever (holding the answer) and closes only once the unsent answer is sent, so a client that sends nothing,
    trickles header bytes or never reads would hold a connection, and its answer, forever."""

    request_timeout = REQUEST_TIMEOUT
    _request_timer = None
    _read_timer = None  # runs while the client reads nothing and the unsent answer is over the high-water mark

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_request_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY) and self._request_timer is not None:
            self._request_timer.cancel()  # the request is complete (or the connection is ending)
            self._request_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_request_timer()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._cancel_read_timer()
        self._read_timer = self.loop.call_later(self.request_timeout, self.transport.abort)  # drops the unsent answer

    def resume_writing(self) -> None:
        self._cancel_read_timer()
        super().resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._request_timer is not None:
            self._request_timer.cancel()
        self._cancel_read_timer()
        super().connection_lost(exc)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _arm_request_timer(self) -> None:
        if self._request_timer is not None:
            self._request_timer.cancel()
        self._request_timer = self.loop.call_later(self.request_timeout, self._close_if_waiting)

    def _close_if_waiting(self) -> None:
        self._request_timer = None
        if self.transport.get_write_buffer_size():  # an answer not read in time: drop it (close() would wait)
            self.transport.abort()
        elif self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self.transport.close()


def create_app(
    retriever: Retriever,
    max_queries: int = MAX_QUERIES,
    max_topk: int = MAX_TOPK,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_response_bytes: int = MAX_RESPONSE_BYTES,
    api_key: str | None = None,
    allowed_hosts: Sequence[str] | None = None,
) -> FastAPI:
    """Wrap `retriever` in the `/retrieve` + `/health` API; bad requests get HTTP 4xx with an `error` message.

    `api_key` defaults to `$MEMPO_RETRIEVER_API_KEY`; `/health` stays open (for readiness probes). With
    `allowed_hosts` (names or addresses, any port; the loopback names are always answered), a request whose `Host`
    header names another host gets HTTP 421: a web page that rebinds its own domain to this address cannot read the
    server (`serve` defaults to the loopback names when bound to loopback, `allowed_host_names`). None: any `Host`.

    Example:
        >>> from fastapi.testclient import TestClient
        >>> client = TestClient(create_app(BM25Retriever.from_corpus("corpus.jsonl")))
        >>> client.post("/retrieve", json={"queries": [], "topk": 3}).json()["error"]
        'queries must not be empty; send 1 to 4096 queries per request.'
    """
    check_limits(max_queries, max_topk, max_body_bytes, max_response_bytes)
    api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    app = FastAPI(title="mempo_trl retriever", summary="Search-R1 compatible /retrieve API.")

    allowed = None if allowed_hosts is None else {_host_name(name) for name in (*LOOPBACK_NAMES, *allowed_hosts)}

    @app.middleware("http")
    async def guard(request: Request, call_next):
        host = request.headers.get("host", "")
        if allowed is not None and "*" not in allowed and _host_name(host) not in allowed:
            return JSONResponse(
                {
                    "error": f"Host {host!r} is not served here (this server answers {', '.join(sorted(allowed))}). "
                    "Connect by one of those names, or restart the server with --allowed_hosts NAME."
                },
                status_code=421,
            )
        if request.method == "POST":
            if api_key is not None:
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                    return JSONResponse(
                        {"error": f"missing or wrong API key: send 'Authorization: Bearer <key>' ({API_KEY_ENV})."},
                        status_code=401,
                    )
            length = request.headers.get("content-length", "")
            if not length.isdigit() or "transfer-encoding" in request.headers:  # with both, proxies may disagree
                return JSONResponse({"error": "send a Content-Length header (no chunked bodies)."}, status_code=411)
            if int(length) > max_body_bytes:
                return JSONResponse(
                    {
                        "error": f"request body of {length} bytes is over this server's limit of {max_body_bytes} "
                        "(--max_body_bytes); split the batch."
                    },
                    status_code=413,
                )
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def readable_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(_describe(error) for error in exc.errors())
        return _invalid(f"invalid request body: {problems}. Expected JSON like {EXAMPLE_REQUEST}.")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "num_passages": getattr(retriever, "num_passages", None),
            "retriever": getattr(retriever, "name", type(retriever).__name__),
            "max_queries": max_queries,
            "max_topk": max_topk,
            "max_body_bytes": max_body_bytes,
            "max_response_bytes": max_response_bytes,
        }

    @app.post("/retrieve")
    def retrieve(request: RetrieveRequest) -> JSONResponse:
        if not request.queries:
            return _invalid(f"queries must not be empty; send 1 to {max_queries} queries per request.")
        if len(request.queries) > max_queries:
            return _invalid(
                f"too many queries ({len(request.queries)}); this server accepts at most {max_queries} per "
                "request. Split the batch or restart the server with a larger --max_queries."
            )
        if not 1 <= request.topk <= max_topk:
            return _invalid(f"topk must be between 1 and {max_topk}, got {request.topk}.")
        try:
            hits = retriever.search(request.queries, request.topk)
        except Exception as e:
            logger.exception("search failed for %d queries", len(request.queries))
            return JSONResponse({"error": f"the retriever failed: {type(e).__name__}: {e}"}, status_code=500)
        if request.return_scores:
            result = [
                [{"document": {"id": p.id, "contents": p.contents}, "score": p.score} for p in passages]
                for passages in hits
            ]
        else:
            result = [[{"id": p.id, "contents": p.contents} for p in passages] for passages in hits]
        body = json.dumps({"result": result}, ensure_ascii=False).encode()
        if len(body) > max_response_bytes:
            return _invalid(
                f"the answer would be {len(body)} bytes, over this server's limit of {max_response_bytes} "
                "(--max_response_bytes); send fewer queries or a smaller topk."
            )
        return Response(body, media_type="application/json")

    return app


def serve(
    retriever: Retriever,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_queries: int = MAX_QUERIES,
    max_topk: int = MAX_TOPK,
    log_level: str = "info",
    max_body_bytes: int = MAX_BODY_BYTES,
    max_response_bytes: int = MAX_RESPONSE_BYTES,
    api_key: str | None = None,
    request_timeout: float = REQUEST_TIMEOUT,
    allowed_hosts: Sequence[str] | None = None,
) -> None:
    """Serve `retriever` with uvicorn until interrupted (access log off: it costs latency under load); connections
    that do not send a whole request, or read their answer, within `request_timeout` seconds are closed
    (`RequestDeadlineProtocol`). Requests must name one of `allowed_hosts` in `Host` (default:
    `allowed_host_names(host)`).

    Example:
        >>> serve(BM25Retriever.from_corpus("corpus.jsonl"), port=8000)  # then HttpRetriever("http://127.0.0.1:8000")
    """
    allowed_hosts = allowed_host_names(host) if allowed_hosts is None else allowed_hosts
    app = create_app(retriever, max_queries, max_topk, max_body_bytes, max_response_bytes, api_key, allowed_hosts)
    if not _is_loopback(host) and not (api_key or os.environ.get(API_KEY_ENV)):
        logger.warning(
            "Serving on %s without an API key: anyone who can reach this address can query the server. Set "
            "--api_key or $%s (clients send it as a bearer token), or bind 127.0.0.1.",
            host,
            API_KEY_ENV,
        )
    check_request_timeout(request_timeout)
    protocol = type("RequestDeadlineProtocol", (RequestDeadlineProtocol,), {"request_timeout": request_timeout})
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False, http=protocol)


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
"""The `Host` names a server bound to loopback answers by default."""


def allowed_host_names(host: str) -> tuple[str, ...] | None:
    """The `Host` names a server bound to `host` answers by default: the loopback names when it is bound to
    loopback (a browser page cannot rebind its own domain onto it), else any (None).

    Example:
        >>> allowed_host_names("127.0.0.1"), allowed_host_names("0.0.0.0")
        (('localhost', '127.0.0.1', '::1'), None)
    """
    return LOOPBACK_NAMES if _is_loopback(host) else None


def _host_name(value: str) -> str:
    """The name in a `Host` header or an `--allowed_hosts` entry, without the port or IPv6 brackets, lower case;
    anything else after the name (not a port) leaves the value whole, so it matches no allowed name.

    Example:
        >>> [_host_name(h) for h in ("LocalHost:8000", "[::1]:8000", "127.0.0.1", "::1", "[::1]evil.com")]
        ['localhost', '::1', '127.0.0.1', '::1', '[::1]evil.com']
    """
    value = value.strip().lower()
    if value.startswith("["):  # only a port may follow the brackets: `[::1]evil.com` is no loopback name
        name, _, port = value[1:].partition("]")
        return name if port in ("", ":") or port[:1] == ":" and port[1:].isdigit() else value
    name, colon, port = value.partition(":")
    return name if colon and value.count(":") == 1 and (port == "" or port.isdigit()) else value


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _invalid(message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=422)


def _describe(error: dict[str, Any]) -> str:
    if error["type"] == "json_invalid":
        return (
            f"the body is not valid JSON ({error['ctx'].get('error', 'decode error')} at character {error['loc'][-1]})"
        )
    location = ".".join(str(part) for part in error["loc"] if part != "body") or "body"
    return f"{location}: {error['msg']}"
