"""HttpRetriever against a real `mempo-trl serve-retriever` process and against fake servers that misbehave.

Everything listens on 127.0.0.1 only. Run: pytest tests/test_retrieval_http.py
"""

import json
import logging
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from helpers import free_port

from mempo_trl.retrieval import BM25Retriever, HttpRetriever, Passage, RetrievalError


CORPUS = [
    ("1", "Hamlet", "Hamlet is a tragedy written by William Shakespeare around 1600."),
    ("2", "Paris", "Paris is the capital and largest city of France."),
    ("3", "Elsinore", "Elsinore is the castle in Denmark where Hamlet is set."),
    ("4", "Marie Curie", "Marie Curie won two Nobel Prizes, in physics and in chemistry."),
    ("5", "Lyon", "Lyon is a large city in France, known for its cuisine."),
]
QUERIES = ["hamlet", "capital of France", "Nobel chemistry", "", "zebra", "city castle Denmark"]


@dataclass
class LiveServer:
    url: str
    corpus: Path
    cache_dir: Path
    process: subprocess.Popen


def start_server(directory: Path) -> LiveServer:
    corpus = directory / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "contents": f'"{t}"\n{x}'}) + "\n" for i, t, x in CORPUS))
    port, cache_dir, log = free_port(), directory / "cache", directory / "server.log"
    command = [sys.executable, "-m", "mempo_trl", "serve-retriever", "--corpus", str(corpus), "--port", str(port)]
    command += ["--retriever_cache_dir", str(cache_dir), "--max_topk", "20", "--log_level", "warning"]
    with log.open("w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        with HttpRetriever(url) as client:
            client.wait_ready(timeout=60)
    except RetrievalError:
        process.kill()
        pytest.fail(f"the retrieval server did not come up; its log:\n{log.read_text()}")
    return LiveServer(url, corpus, cache_dir, process)


def stop(server: LiveServer) -> None:
    server.process.terminate()
    server.process.wait(timeout=10)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("live"))
    yield server
    stop(server)


def test_live_results_equal_in_process_bm25(live):
    direct = BM25Retriever.from_corpus(live.corpus, cache_dir=live.cache_dir)
    assert direct.cache_hit  # the server process built and cached this index
    with HttpRetriever(live.url) as client:
        remote = client.search(QUERIES, topk=3)
        assert remote == direct.search(QUERIES, topk=3)
        assert [p.id for p in remote[0]] == ["1", "3"] and remote[3] == [] and remote[4] == []
        assert client.search([], topk=3) == []


def test_live_health_and_retrieve_suffix(live):
    with HttpRetriever(f"{live.url}/retrieve/") as client:
        assert client.base_url == live.url
        assert client.health() == {
            "status": "ok",
            "num_passages": 5,
            "retriever": "bm25",
            "max_queries": 4096,
            "max_topk": 20,
            "max_body_bytes": 4 * 2**20,
            "max_response_bytes": 64 * 2**20,
        }
        (hit,) = client.search(["Paris"], topk=1)[0]
        assert (hit.id, hit.title, hit.text) == ("2", "Paris", CORPUS[1][2]) and hit.score > 0


def test_live_concurrent_clients(live):
    direct = BM25Retriever.from_corpus(live.corpus, cache_dir=live.cache_dir)
    batches = [[QUERIES[(i + j) % len(QUERIES)] for j in range(3)] for i in range(48)]
    with HttpRetriever(live.url, pool_size=8) as client, ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda batch: client.search(batch, topk=2), batches))
    assert answers == [direct.search(batch, topk=2) for batch in batches]


def test_live_rejects_bad_requests_with_message(live):
    response = httpx.post(f"{live.url}/retrieve", json={"queries": ["hamlet"], "topk": 50})
    assert response.status_code == 422 and response.json() == {"error": "topk must be between 1 and 20, got 50."}
    response = httpx.post(f"{live.url}/retrieve", json={"queries": [1]})
    assert response.status_code == 422 and "queries.0: Input should be a valid string" in response.json()["error"]
    with HttpRetriever(live.url, backoff=0) as client, pytest.raises(RetrievalError) as info:
        client.search(["hamlet"], topk=50)
    assert "HTTP 422" in str(info.value) and "topk must be between 1 and 20" in str(info.value)


def test_server_killed_mid_run_retries_then_names_the_url(tmp_path, caplog):
    server = start_server(tmp_path)
    client = HttpRetriever(server.url, max_retries=2, backoff=0.01)
    assert [p.id for p in client.search(["hamlet"], topk=1)[0]] == ["1"]
    server.process.kill()
    server.process.wait(timeout=10)
    caplog.clear()
    with (
        caplog.at_level(logging.WARNING, logger="mempo_trl.retrieval.http_client"),
        pytest.raises(RetrievalError) as info,
    ):
        client.search(["hamlet"], topk=1)
    message = str(info.value)
    assert f"POST {server.url}/retrieve failed after 3 attempt(s)" in message
    assert "refused the connection" in message and "mempo-trl serve-retriever" in message
    assert [record.args[2:5] for record in caplog.records] == [(1, "/3", 0.01), (2, "/3", 0.02)]  # exponential backoff


# ---------------------------------------------------------------- fake servers


class FakeServer:
    """Loopback HTTP server whose answers come from `respond(request_number) -> (status, body, delay_s)`."""

    def __init__(self, respond):
        self.requests: list[bytes] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                fake.requests.append(self.rfile.read(int(self.headers.get("content-length", 0))))
                status, body, delay = respond(len(fake.requests))
                time.sleep(delay)
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda request, address: None  # a client that timed out closed the socket
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_server():
    servers = []

    def start(respond):
        servers.append(FakeServer(respond))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def scored(*docs):
    return [{"document": {"id": pid, "contents": contents}, "score": score} for pid, contents, score in docs]


def test_5xx_is_retried_then_reported_with_body(fake_server):
    server = fake_server(lambda n: (503, b'{"detail": "index still loading"}', 0))
    with HttpRetriever(server.url, max_retries=2, backoff=0) as client, pytest.raises(RetrievalError) as info:
        client.search(["q"], topk=1)
    assert len(server.requests) == 3
    assert f"POST {server.url}/retrieve failed after 3 attempt(s)" in str(info.value)
    assert "HTTP 503" in str(info.value) and "index still loading" in str(info.value)


def test_transient_5xx_recovers(fake_server):
    ok = json.dumps({"result": [scored(("7", '"T"\nbody', 2.5))]}).encode()
    server = fake_server(lambda n: (500, b"oops", 0) if n == 1 else (200, ok, 0))
    with HttpRetriever(server.url, max_retries=1, backoff=0) as client:
        assert client.search(["q"], topk=1) == [[Passage("7", "T", "body", 2.5)]]
    assert len(server.requests) == 2
    assert json.loads(server.requests[0]) == {"queries": ["q"], "topk": 1, "return_scores": True}


def test_4xx_is_not_retried(fake_server):
    server = fake_server(lambda n: (404, b'{"detail": "Not Found"}', 0))
    with HttpRetriever(server.url, max_retries=3, backoff=0) as client, pytest.raises(RetrievalError) as info:
        client.search(["q"], topk=1)
    assert len(server.requests) == 1 and "HTTP 404" in str(info.value) and server.url in str(info.value)


def test_timeout(fake_server):
    server = fake_server(lambda n: (200, b'{"result": [[]]}', 1.0))
    with HttpRetriever(server.url, timeout=0.1, max_retries=0) as client, pytest.raises(RetrievalError) as info:
        client.search(["q"], topk=1)
    assert "did not send its whole answer within 0.1s" in str(info.value) and "after 1 attempt(s)" in str(info.value)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"<html>502 Bad Gateway</html>", "malformed JSON: '<html>502 Bad Gateway</html>'"),
        (b'{"results": []}', "answered without a 'result' list"),
        (json.dumps({"result": [scored(("1", "x", 1.0))]}).encode(), "returned 1 result lists for 2 queries"),
        (b'{"result": [[], {"id": "1"}]}', "result 1 is {'id': '1'}, not a list of documents"),
        (b'{"result": [[{"document": {"id": "1"}, "score": 1}], []]}', "result 0 holds"),
        (json.dumps({"result": [[], scored(("1", "x", "high"))]}).encode(), "non-numeric score 'high'"),
    ],
)
def test_malformed_answers_raise_clear_errors(fake_server, body, message):
    server = fake_server(lambda n: (200, body, 0))
    with HttpRetriever(server.url, max_retries=3, backoff=0) as client, pytest.raises(RetrievalError) as info:
        client.search(["q1", "q2"], topk=1)
    assert message in str(info.value) and server.url in str(info.value)
    assert len(server.requests) == 1


def test_documents_without_scores_or_ids(fake_server):
    body = {"result": [[{"id": "9", "contents": '"Ulm"\nA city.'}], [{"contents": "no title"}]]}
    server = fake_server(lambda n: (200, json.dumps(body).encode(), 0))
    with HttpRetriever(server.url) as client:
        assert client.search(["a", "b"], topk=1) == [[Passage("9", "Ulm", "A city.")], [Passage("", "", "no title")]]


def test_wait_ready_gives_up_with_the_cause():
    with HttpRetriever(f"http://127.0.0.1:{free_port()}") as client, pytest.raises(RetrievalError) as info:
        client.wait_ready(timeout=0.3, interval=0.05)
    assert "not ready after 0.3s" in str(info.value) and "refused the connection" in str(info.value)


def test_url_must_be_http():
    with pytest.raises(ValueError, match="must start with http"):
        HttpRetriever("127.0.0.1:8000")
