"""A generation backend behind an OpenAI-compatible chat-completions endpoint: `OpenAIChatGenerator`.

The endpoint takes messages, not token ids: `mempo_trl.rollout.RolloutEngine` hands a backend that says
``takes_messages`` the context messages of each prompt as well (built by the same context builder as training), and
the answer's text is tokenised back with the agent's tokenizer for the token accounting and the turn cut.

What comes back differs from a local backend in one way the turn parser cares about: the server strips the stop
string it stopped on (``</search>``), so the closing tag is appended again (`close_action`). vLLM's server says which
stop string matched (``stop_reason``); an endpoint that does not (OpenAI's) is taken to have stopped on the tag of the
action left open.

Each attempt must deliver its whole answer (connecting, sending, the headers and the body together) within ``timeout``
seconds and at most ``max_response_bytes``; one request takes at most ``total_timeout`` seconds over all its attempts
and the waits between them. Timeouts, HTTP 429 and 5xx and dropped or refused connections are retried with capped
exponential backoff (or after the server's ``Retry-After``) while fewer than ``max_retries`` retries were made and the
wait fits in ``total_timeout``; then `EndpointError` names the URL (and a ``Retry-After`` beyond the budget). Other
4xx answers, redirects (never followed: the error names the target), oversized or malformed answers and answers
without text (``content: null``: a tool-call or reasoning reply) are not retried. The API key comes from the
environment only (`API_KEY_ENVS`) and is never shown: it and any credential a server echoes are masked in every
message (`mempo_trl.http_limits.mask_secrets`). With ``cache_path``, every answered request is appended to a JSONL
file keyed by its body, and a request found there is not sent again (`mempo-trl distill` resumes without paying
twice); a failed one is never cached.
"""

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from mempo_trl.data import append_lines
from mempo_trl.http_limits import (
    ResponseTooLarge,
    attempt_deadline,
    deadline_transport,
    mask_secrets,
    read_capped,
    retry_after_seconds,
)
from mempo_trl.turns import ACTION_STOPS


logger = logging.getLogger(__name__)

API_KEY_ENVS = ("MEMPO_OPENAI_API_KEY", "OPENAI_API_KEY")
"""Environment variables read for the endpoint's API key, first set one wins."""

MAX_RESPONSE_BYTES = 16 * 2**20
"""The largest answer read (bytes): a chat completion of a few thousand tokens is tens of KB."""


class EndpointError(RuntimeError):
    """An endpoint that failed for good (retries spent, a rejected request, a malformed answer); names the URL."""


class _Retryable(Exception):
    """One failed attempt worth retrying; ``retry_after``: the seconds the server asked to wait, or None."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


def api_key_from_env() -> str | None:
    """The first of `API_KEY_ENVS` that is set and not empty."""
    return next((os.environ[name] for name in API_KEY_ENVS if os.environ.get(name)), None)


def close_action(text: str, stops: Sequence[str], stop_reason: str | None = None) -> str:
    """``text`` with the closing tag the server stripped appended again: ``stop_reason`` when it is one of ``stops``,
    else the stop whose opening tag is the last one left open in ``text`` (none: ``text`` unchanged).

    Example:
        >>> close_action("<mem> m </mem>\\n<think> t </think>\\n<search> who ", ["</search>", "</answer>"])
        '<mem> m </mem>\\n<think> t </think>\\n<search> who </search>'
        >>> close_action("<answer> Ulm", ["</search>", "</answer>"], stop_reason="</answer>")
        '<answer> Ulm</answer>'
        >>> close_action("<answer> Ulm </answer>", ["</search>", "</answer>"])
        '<answer> Ulm </answer>'
    """
    if stop_reason in stops:
        return text + stop_reason
    open_at = {stop: text.rfind("<" + stop[2:]) for stop in stops}
    left_open = [(at, stop) for stop, at in open_at.items() if at >= 0 and stop not in text[at:]]
    return text + max(left_open)[1] if left_open else text


def request_key(body: dict) -> str:
    """The sha256 of a request body's canonical JSON: the key of its answer in the cache.

    Example:
        >>> request_key({"b": 1, "a": [2]}) == request_key({"a": [2], "b": 1})
        True
    """
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


class OpenAIChatGenerator:
    """`GenerateFn` over an OpenAI-compatible ``POST {base_url}/chat/completions`` (vLLM's server, any hosted API).

    Args:
        base_url: the API's base URL, e.g. ``http://127.0.0.1:8000/v1``.
        model: the served model's name (``"model"`` of the request).
        tokenizer: the tokenizer whose ids the rollout accounts in (the answer's text is tokenised with it).
        max_new_tokens, temperature, top_p, seed: the request's ``max_tokens``, sampling and ``seed``.
        stops: the action stops, sent as ``stop`` and appended again when stripped (`close_action`).
        timeout: seconds one attempt may take, from connecting to the answer's last byte; total_timeout: seconds one
            request may take over all its attempts and the waits between them.
        max_response_bytes: the largest answer read; a larger one ends in `EndpointError` (the rest is not read).
        max_retries: retries of a failed attempt (see the module docstring); backoff, max_backoff: the waits.
        max_concurrency: requests in flight at once (a round's prompts are sent in parallel).
        tool_role: the role of the messages that hold a search result (``"tool"``, as training renders them; ``"user"``
            for an API that wants a ``tool_call_id`` with every tool message).
        cache_path: a JSONL file of answered requests, read at start and appended to (None: no cache).
        api_key: sent as a bearer token; default: the environment (`API_KEY_ENVS`).

    Example:
        >>> generate = OpenAIChatGenerator("http://127.0.0.1:8000/v1", "teacher", tokenizer)  # doctest: +SKIP
        >>> ids, _ = generate([prompt_ids], messages=[[{"role": "user", "content": "hi"}]])  # doctest: +SKIP
    """

    takes_messages = True

    def __init__(
        self,
        base_url: str,
        model: str,
        tokenizer,
        max_new_tokens: int = 512,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = 0,
        stops: Sequence[str] = ACTION_STOPS,
        timeout: float = 120.0,
        total_timeout: float = 900.0,
        max_retries: int = 5,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        backoff: float = 1.0,
        max_backoff: float = 30.0,
        max_concurrency: int = 8,
        tool_role: str = "tool",
        cache_path: str | Path | None = None,
        api_key: str | None = None,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"openai_base_url must start with http:// or https://, got {base_url!r}")
        if "@" in base_url.split("//", 1)[1].split("/", 1)[0]:
            raise ValueError("openai_base_url holds a user name or password; set $MEMPO_OPENAI_API_KEY instead")
        if not model:
            raise ValueError("an OpenAI-compatible endpoint needs the served model's name: pass --openai_model NAME")
        if timeout <= 0 or total_timeout <= 0 or max_retries < 0 or max_concurrency < 1 or max_response_bytes < 1:
            raise ValueError(
                "the endpoint needs timeout > 0, total_timeout > 0, max_retries >= 0, max_concurrency >= 1 and "
                f"max_response_bytes >= 1, got {timeout=}, {total_timeout=}, {max_retries=}, {max_concurrency=}, "
                f"{max_response_bytes=}"
            )
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.sampling = {"max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
        if seed is not None:
            self.sampling["seed"] = seed
        self.timeout, self.total_timeout = timeout, total_timeout
        self.max_retries, self.backoff, self.max_backoff = max_retries, backoff, max_backoff
        self.max_response_bytes = max_response_bytes
        self.max_concurrency = max_concurrency
        self.tool_role = tool_role
        self.eos_token_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.max_prompt_length = None  # the served model's context is not known here: max_context_tokens bounds it
        self.on_batch = None  # progress bars (`mempo_trl.evaluation`): called with the number of answered requests
        self.requests_sent = 0
        self._key = api_key if api_key is not None else api_key_from_env()
        headers = {"authorization": f"Bearer {self._key}"} if self._key else {}
        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        self._client = httpx.Client(
            timeout=timeout, headers=headers, follow_redirects=False, transport=deadline_transport(limits)
        )
        self._lock = threading.Lock()
        self.cache_path = Path(cache_path) if cache_path is not None else None
        self._cache: dict[str, dict] = {}
        if self.cache_path is not None and self.cache_path.is_file():
            for line in self.cache_path.read_text(encoding="utf-8").splitlines():
                if line.strip():  # a line cut by a kill is the last one: it is ignored (its request is sent again)
                    try:
                        entry = json.loads(line)
                    except ValueError:
                        continue
                    self._cache[entry["key"]] = entry["answer"]

    def __call__(
        self, prompts: list[list[int]], messages: list[list[dict]] | None = None
    ) -> tuple[list[list[int]], None]:
        """One turn per context: ``messages[i]`` is the context of ``prompts[i]``; returns token ids (no log-probs)."""
        if messages is None or len(messages) != len(prompts):
            raise TypeError("OpenAIChatGenerator needs the context messages of every prompt (messages=...)")
        with ThreadPoolExecutor(self.max_concurrency) as pool:
            texts = list(pool.map(self.complete, messages))
        completions = []
        for text, finished in texts:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            completions.append(list(ids) + (self.eos_token_ids[:1] if finished else []))
        if self.on_batch is not None:
            self.on_batch(len(prompts))
        return completions, None

    def complete(self, messages: list[dict]) -> tuple[str, bool]:
        """The turn written after ``messages``: its text (closing tag appended again) and whether it ended by itself
        (a stop or end of message) rather than at ``max_tokens``. Answered from the cache when it holds the request."""
        body = {
            "model": self.model,
            "messages": [{**m, "role": self.tool_role} if m["role"] == "tool" else dict(m) for m in messages],
            "stop": list(self.stops),
            **self.sampling,
        }
        key = request_key(body)
        answer = self._cache.get(key)
        if answer is None:
            answer = self._request(body)
            if self.cache_path is not None:
                with self._lock:
                    self._cache[key] = answer
                    append_lines(self.cache_path, [{"key": key, "answer": answer}])
        finished = answer["finish_reason"] != "length"
        stop_reason = answer.get("stop_reason", "")
        if answer["finish_reason"] != "stop" or stop_reason is None:  # vLLM's None: the model's own end of message
            return answer["text"], finished
        return close_action(answer["text"], self.stops, stop_reason or None), finished

    def _request(self, body: dict) -> dict:
        """``{"text", "finish_reason"[, "stop_reason"]}`` of one request, under the retry policy; every message it
        raises or logs has the API key and any echoed credential masked."""
        start, attempt = time.monotonic(), 0
        while True:
            attempt += 1
            try:
                return self._attempt(body, start + self.total_timeout)
            except _Retryable as e:
                problem, retry_after = self._mask(str(e)), e.retry_after
            except EndpointError as e:
                raise EndpointError(self._mask(str(e))) from None
            spent = time.monotonic() - start
            left = self.total_timeout - spent
            if retry_after is not None and retry_after >= left:
                raise EndpointError(
                    f"POST {self.url} failed after {attempt} attempt(s) over {spent:.1f}s: the endpoint {problem}. It "
                    f"asked to be retried after {retry_after:g}s, beyond what is left of --openai_total_timeout "
                    f"({self.total_timeout:g}s, {max(left, 0):.0f}s left): rerun the same command once the server "
                    "takes requests again (it resumes), or raise --openai_total_timeout to wait that long."
                )
            delay = (
                retry_after if retry_after is not None else min(self.backoff * 2 ** (attempt - 1), self.max_backoff)
            )
            if attempt > self.max_retries or delay >= left:
                raise EndpointError(
                    f"POST {self.url} failed after {attempt} attempt(s) over {spent:.1f}s: the endpoint {problem}. "
                    "Check the server (its log, its load, the model name), or raise --openai_timeout / "
                    "--openai_max_retries / --openai_total_timeout; a rerun of the same command resumes."
                )
            logger.warning(
                "POST %s attempt %d/%d failed, retrying in %gs: %s",
                self.url,
                attempt,
                self.max_retries + 1,
                delay,
                problem,
            )
            time.sleep(delay)

    def _mask(self, text: str) -> str:
        return mask_secrets(text, [self._key])

    def _attempt(self, body: dict, request_deadline: float) -> dict:
        """One POST, within ``timeout`` and before ``request_deadline`` (monotonic): the answer, `_Retryable` for an
        outage, `EndpointError` for anything else."""
        with self._lock:
            self.requests_sent += 1
        seconds = min(self.timeout, request_deadline - time.monotonic())
        within = (
            f"{self.timeout:g}s (--openai_timeout)"
            if seconds >= self.timeout
            else f"the {self.total_timeout:g}s of --openai_total_timeout"
        )
        try:
            with attempt_deadline(seconds), self._client.stream("POST", self.url, json=body) as response:
                content = read_capped(response, self.max_response_bytes)
        except httpx.TimeoutException:
            raise _Retryable(f"did not send its whole answer within {within}") from None
        except httpx.ConnectError as e:
            raise _Retryable(f"refused the connection ({e}); is the server running?") from None
        except httpx.TransportError as e:
            raise _Retryable(f"dropped the connection ({type(e).__name__}: {e})") from None
        except ResponseTooLarge as e:
            raise EndpointError(
                f"POST {self.url} {e}, over the client's cap of {self.max_response_bytes} bytes: a chat completion of "
                f"max_tokens={self.sampling['max_tokens']} tokens is far smaller. Is this an OpenAI-compatible API "
                "(the URL ends in /v1)? Check the server."
            ) from None
        status = response.status_code
        text = self._mask(content.decode("utf-8", "replace"))[:300]
        if status == 429 or status >= 500:
            busy = "is rate-limiting this client" if status == 429 else "is failing or overloaded"
            raise _Retryable(
                f"answered HTTP {status} ({busy}): {text!r}", retry_after_seconds(response.headers.get("retry-after"))
            )
        if 300 <= status < 400:
            raise EndpointError(
                f"POST {self.url} answered HTTP {status}, a redirect to "
                f"{response.headers.get('location', '(no Location)')!r}; redirects are not followed. Point "
                "--openai_base_url at the server itself."
            )
        if status >= 400:
            hint = (
                "the API key ($MEMPO_OPENAI_API_KEY or $OPENAI_API_KEY)"
                if status in (401, 403)
                else (
                    "--openai_model and the request's settings (--openai_tool_role user for an API that wants a "
                    "tool_call_id with tool messages)"
                )
            )
            raise EndpointError(f"POST {self.url} answered HTTP {status}: {text!r}. Check {hint}.")
        return self._answer(content, text)

    def _answer(self, content: bytes, text: str) -> dict:
        """The answer of a 200's body (``text``: its excerpt, for messages); `EndpointError` for one that is not a chat
        completion, or that holds no text."""
        try:
            choice = json.loads(content)["choices"][0]
            message = choice["message"]
            finish_reason = choice["finish_reason"]
            if not isinstance(message, dict) or not isinstance(finish_reason, str):
                raise TypeError
            reply = message.get("content")
            if not isinstance(reply, str | None):
                raise TypeError
        except (ValueError, KeyError, IndexError, TypeError, RecursionError):
            raise EndpointError(
                f"POST {self.url} answered 200 with no chat completion in it: {text!r}. Is this an OpenAI-compatible "
                "API (the URL ends in /v1)?"
            ) from None
        if reply is None:
            held = [name for name in ("tool_calls", "reasoning_content", "reasoning") if message.get(name)]
            raise EndpointError(
                f"POST {self.url} answered 200 with content: null: the endpoint sent no text: tool-call or reasoning "
                f"reply ({', '.join(held) or 'no other field'} set); nothing was cached. Serve the model without tool "
                "calling or a reasoning parser (vLLM: drop --enable-auto-tool-choice / --reasoning-parser), then "
                "rerun the same command."
            )
        answer = {"text": reply, "finish_reason": finish_reason}
        if "stop_reason" in choice:
            stop_reason = choice["stop_reason"]
            answer["stop_reason"] = stop_reason if isinstance(stop_reason, str) else None
        return answer

    def close(self) -> None:
        self._client.close()
