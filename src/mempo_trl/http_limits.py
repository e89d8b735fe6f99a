"""Bounds of one HTTP attempt, shared by the retrieval client and the OpenAI-compatible endpoint client.

httpx's timeouts bound each socket operation, not their sum: a server trickling one byte per second, each within the
read timeout, holds a request for ever. Under `attempt_deadline`, a client built on `deadline_transport` bounds the
whole attempt instead (connecting, sending, the headers and the body together); `read_capped` reads an answer's body
up to a size cap, so an endless answer cannot fill the memory. `retry_after_seconds` reads a `Retry-After` header, and
`mask_secrets` hides an API key (and any bearer token) in text about to be shown.
"""

import contextlib
import email.utils
import math
import re
import threading
import time
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx


_deadline = threading.local()


class ResponseTooLarge(Exception):
    """An answer larger than the cap; the message says what the server announced or sent."""


@contextlib.contextmanager
def attempt_deadline(seconds: float):
    """Within, every socket operation of this thread on a `deadline_transport` waits at most until ``seconds`` from
    now; past it, httpx raises a `httpx.TimeoutException`."""
    _deadline.value = time.monotonic() + seconds
    try:
        yield
    finally:
        _deadline.value = None


class _DeadlineStream(httpcore.NetworkStream):
    """A socket stream whose every read and write waits at most until the calling thread's attempt deadline."""

    def __init__(self, stream: httpcore.NetworkStream):
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _until_deadline(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _until_deadline(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None) -> "_DeadlineStream":
        timeout = _until_deadline(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _DeadlineBackend(httpcore.SyncBackend):
    """httpcore's socket backend with `_DeadlineStream` connections."""

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        timeout = _until_deadline(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(super().connect_tcp(host, port, timeout, local_address, socket_options))


def _until_deadline(timeout: float | None, error: type[Exception]) -> float | None:
    """``timeout`` shortened to the time left before this thread's attempt deadline; ``error`` once it has passed."""
    deadline = getattr(_deadline, "value", None)
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise error("the attempt's deadline passed")
    return left if timeout is None else min(timeout, left)


def deadline_transport(limits: httpx.Limits) -> httpx.HTTPTransport:
    """httpx's transport whose connections keep `attempt_deadline`. httpx takes no network backend, so this replaces
    the connection pool it builds (`HTTPTransport._pool`) by the same pool over `_DeadlineBackend`."""
    transport = httpx.HTTPTransport(limits=limits)
    transport._pool = httpcore.ConnectionPool(
        ssl_context=httpx.create_ssl_context(),
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        network_backend=_DeadlineBackend(),
    )
    return transport


def read_capped(response: httpx.Response, max_bytes: int) -> bytes:
    """The body of a streamed ``response``, read only while it stays within ``max_bytes``; `ResponseTooLarge` as soon
    as it announces or sends more (the rest is never read)."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ResponseTooLarge(f"announced {int(declared)} bytes")
    chunks, size = [], 0
    for chunk in response.iter_bytes():
        size += len(chunk)
        if size > max_bytes:
            raise ResponseTooLarge(f"sent more than {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a `Retry-After` header (delay in seconds or an HTTP date); None if absent or unreadable.

    Example:
        >>> retry_after_seconds("3"), retry_after_seconds("soon")
        (3.0, None)
        >>> retry_after_seconds("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0)
        10.0
    """
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    seconds = when.timestamp() - (time.time() if now is None else now)
    return max(seconds, 0.0) if math.isfinite(seconds) else None


_CREDENTIALS = (
    (re.compile(r"(?i)(authorization[\"']?\s*[:=]\s*[\"']?)[^\"'\r\n,;}]+"), r"\1***"),
    (re.compile(r"(?i)\b(bearer|basic)(\s+)[^\s\"',;]+"), r"\1\2***"),
)
"""A header that names a credential, and the credentials of HTTP's usual schemes: their values are masked."""


def mask_secrets(text: str, secrets: Iterable[str | None] = ()) -> str:
    """``text`` with each of ``secrets``, an ``Authorization`` header's value and a bearer or basic credential
    replaced by ``***``.

    Example:
        >>> mask_secrets('{"you_sent": "Bearer sk-abc123", "key": "sk-abc123"}', ["sk-abc123"])
        '{"you_sent": "Bearer ***", "key": "***"}'
        >>> mask_secrets("Authorization: Bearer abc\\nbearer xyz")
        'Authorization: ***\\nbearer ***'
    """
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    for pattern, replacement in _CREDENTIALS:
        text = pattern.sub(replacement, text)
    return text
