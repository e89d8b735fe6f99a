"""A fake OpenAI-compatible chat-completions server on 127.0.0.1 (a thread of the test process), for the endpoint
backend's tests: it plays a scripted search agent and can be told to misbehave.

`FakeOpenAI(answers)` answers a context without a search result with a search for the question, and one with a
result with ``answers[question]``; like OpenAI's API it strips the stop string it stopped on (with
``stop_reason=True``, it also names it, as vLLM's server does). ``faults`` is a queue of misbehaviours for the next
requests (``"timeout"``: answer after ``delay`` seconds; ``"429"``, ``"500"`` with ``Retry-After: retry_after``;
``"malformed"``: a 200 that is not JSON; ``"drop"``: close the connection without an answer; ``"trickle"``: the
answer one byte every ``trickle_interval`` seconds; ``"huge"``: an endless 200 body (up to ``HUGE_BYTES``);
``"echo_auth"``: a 400 echoing the request's ``Authorization`` header; ``"null_content"``: a tool-call reply,
``content: null``; ``"redirect"``: a 307 to ``REDIRECT_TARGET``); ``fail_from`` makes every request from that number
on a 500. ``requests`` holds every request body received, ``answered`` the ones answered with a completion. A
misbehaving answer stops as soon as the client has gone.
"""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


SEARCH_TURN = "<mem> Nothing yet. </mem>\n<think> I must search. </think>\n<search> {question} </search>"
ANSWER_TURN = "<mem> {question} </mem>\n<think> I know the answer. </think>\n<answer> {answer} </answer>"
HUGE_BYTES = 64 * 2**20
"""How much of its endless answer ``"huge"`` sends at most."""
REDIRECT_TARGET = "http://127.0.0.1:1/v1/chat/completions"


class FakeOpenAI:
    def __init__(self, answers: dict[str, str], stop_reason: bool = False, delay: float = 3.0):
        self.answers = answers
        self.stop_reason = stop_reason
        self.delay = delay
        self.retry_after = "0"
        self.trickle_interval = 0.1
        self.faults: list[str] = []
        self.fail_from: int | None = None
        self.requests: list[dict] = []
        self.answered: list[dict] = []
        self.headers: list[dict] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def turn(self, body: dict) -> str:
        """The scripted turn for a request: a search without a result in the context, else the answer."""
        messages = body["messages"]
        question = next(q for q in self.answers if q in messages[1]["content"])
        if not any("<information>" in m["content"] for m in messages[2:]):
            return SEARCH_TURN.format(question=question)
        return ANSWER_TURN.format(question=question, answer=self.answers[question])

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, payload: bytes, **headers: str) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(payload)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                with fake.lock:
                    fake.requests.append(body)
                    fake.headers.append(dict(self.headers))
                    number = len(fake.requests)
                    fault = fake.faults.pop(0) if fake.faults else None
                if fake.fail_from is not None and number >= fake.fail_from:
                    fault = "500"
                if fault == "timeout":
                    time.sleep(fake.delay)
                elif fault in ("429", "500"):
                    return self._send(int(fault), b'{"error": "try later"}', **{"retry-after": fake.retry_after})
                elif fault == "malformed":
                    return self._send(200, b'{"choices": [')
                elif fault == "drop":
                    self.close_connection = True
                    return
                elif fault == "echo_auth":
                    echoed = {"error": "bad request", "you_sent": self.headers.get("authorization")}
                    return self._send(400, json.dumps(echoed).encode())
                elif fault == "redirect":
                    return self._send(307, b"", location=REDIRECT_TARGET)
                elif fault == "null_content":
                    call = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{}"}}
                    message = {"role": "assistant", "content": None, "tool_calls": [call]}
                    choice = {"index": 0, "message": message, "finish_reason": "tool_calls"}
                    return self._send(200, json.dumps({"object": "chat.completion", "choices": [choice]}).encode())
                elif fault in ("trickle", "huge"):
                    return self._misbehave(fault, body)
                with fake.lock:
                    fake.answered.append(body)
                self._send(200, self._completion(body))

            def _completion(self, body: dict) -> bytes:
                text = fake.turn(body)
                stop = next((s for s in body["stop"] if s in text), None)
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                if stop is not None:
                    choice["message"]["content"] = text[: text.index(stop)]
                if fake.stop_reason:
                    choice["stop_reason"] = stop
                return json.dumps({"object": "chat.completion", "choices": [choice]}).encode()

            def _misbehave(self, fault: str, body: dict) -> None:
                """A whole completion one byte at a time (``trickle``), or an endless body (``huge``); either ends
                when the client has gone."""
                self.close_connection = True
                self.send_response(200)
                self.send_header("content-type", "application/json")
                if fault == "trickle":
                    payload = self._completion(body)
                    self.send_header("content-length", str(len(payload)))
                    pieces, pause = (payload[i : i + 1] for i in range(len(payload))), fake.trickle_interval
                else:
                    pieces, pause = (b"a" * 2**16 for _ in range(HUGE_BYTES // 2**16)), 0.0
                self.end_headers()
                try:
                    self.wfile.write(b"" if fault == "trickle" else b'{"choices": [{"message": {"content": "')
                    for piece in pieces:
                        self.wfile.write(piece)
                        self.wfile.flush()
                        time.sleep(pause)
                except OSError:
                    pass

        return Handler
