"""Runs never lose work, part 3: data, context limits and the retrieval server and client.

Every case goes through the real CLI (`mempo_trl.cli.main`, in process) or a real server subprocess on 127.0.0.1
spoken to with raw sockets. Each wait is bounded; nothing asserts a speed.
"""

import json
import shlex
import shutil
import socket
import subprocess
import sys
import time

import pyarrow
import pyarrow.parquet
import pytest
from helpers import cpu_recipe, free_port, one_error_line, start_retriever, stop, worker_env, write_corpus

from mempo_trl.checkpoints import validate_checkpoint
from mempo_trl.cli import main


def write_rows(path, questions):
    """A QA .jsonl of ``questions`` (gold "Ulm" each); returns its path."""
    rows = [{"question": q, "golden_answers": ["Ulm"]} for q in questions]
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def train(tmp_path, model_dir, **fields) -> int:
    return main(["train", "--config", str(cpu_recipe(tmp_path, model_dir, **fields))])


# ------------------------------------------------------------------------------------------ data


@pytest.mark.parametrize(
    ("fields", "what"),
    [({"heldout_questions": 2}, "heldout_questions=2"), ({"eval_strategy": "steps"}, "eval_strategy=steps")],
)
def test_a_single_file_is_never_its_own_heldout_split(tmp_path, capsys, tiny_model_dir, demo_paths, fields, what):
    assert train(tmp_path, tiny_model_dir, dataset_name=str(demo_paths.train), **fields) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: {what} would evaluate on the training rows: dataset_test_split 'test' of "), line
    assert "--dataset_test_split path/test.jsonl" in line
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_dataset_streaming_is_refused_not_ignored(tmp_path, capsys, tiny_model_dir, demo_paths):
    """TRL's `dataset_streaming` is accepted by the parser; MemPO validates every row first, so it says no."""
    assert train(tmp_path, tiny_model_dir, dataset_name=str(demo_paths.train), dataset_streaming=True) == 2
    assert one_error_line(capsys).startswith("error: dataset_streaming is not supported: MemPO validates every row")


def test_an_empty_parquet_file_is_one_error_line(tmp_path, capsys, tiny_model_dir):
    empty = tmp_path / "empty.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"question": pyarrow.array([], pyarrow.string())}), empty)
    assert train(tmp_path, tiny_model_dir, dataset_name=str(empty)) == 2
    assert one_error_line(capsys) == f"error: {empty}: no rows. Give at least one question."


@pytest.mark.parametrize("question", ["\u200b\u200b", "\u3000", " \t "])
def test_a_question_without_visible_text_is_refused(tmp_path, capsys, tiny_model_dir, question):
    data = write_rows(tmp_path / "qa.jsonl", ["Where?", question])
    assert train(tmp_path, tiny_model_dir, dataset_name=str(data)) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: {data}, line 2: field 'question' must be a string with visible text"), line


# ------------------------------------------------------------------------------------------ context limits


@pytest.mark.parametrize(
    ("words", "fields", "limit"),
    [
        (5000, {}, "more than 4088 the generation backend takes (vllm_max_model_length or max_position_embeddings"),
        (400, {"max_context_tokens": 300}, "more than max_context_tokens=300: raise it"),
    ],
)
def test_a_question_too_long_for_the_context_is_refused_before_any_step(
    tmp_path, capsys, tiny_model_dir, words, fields, limit
):
    data = write_rows(tmp_path / "qa.jsonl", ["Where was Ada born?", "Where is " + "it " * words, "Who?"])
    assert train(tmp_path, tiny_model_dir, dataset_name=str(data), **fields) == 2
    line = one_error_line(capsys)
    assert line.startswith("error: train_dataset, row 2 (id '1'): the first context of question 'Where is it it"), line
    assert limit in line, line
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_an_error_mid_run_saves_a_checkpoint_first(tmp_path, capsys, tiny_model_dir, demo_paths):
    # A held-out file given as dataset_test_split is a real held-out source (accepted); the reward fails at step 2.
    fields = {"dataset_name": str(demo_paths.train), "dataset_test_split": str(demo_paths.test)}
    fields.update(heldout_questions=1, max_steps=3, reward_funcs=["helpers.reward_failing_after_step_1"])
    assert train(tmp_path, tiny_model_dir, **fields) == 2
    checkpoint = tmp_path / "out" / "checkpoint-1"
    assert one_error_line(capsys) == (
        f"error: training stopped: the reward service went away. Saved {checkpoint}; once that is fixed, rerun "
        f"with --resume_from_checkpoint {checkpoint}."
    )
    validate_checkpoint(checkpoint)


@pytest.mark.parametrize(
    ("words", "flags", "limit"),
    [
        (5000, [], "more than 4088 the generation backend takes"),
        (400, ["--max_context_tokens", "300"], "more than max_context_tokens=300: raise it"),
    ],
)
def test_eval_holds_contexts_to_the_same_limits_as_training(
    tmp_path, capsys, tiny_model_dir, demo_paths, words, flags, limit
):
    data = write_rows(tmp_path / "qa.jsonl", ["Where was Ada born?", "Where is " + "it " * words])
    argv = ["eval", "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(data), "--corpus"]
    argv += [str(demo_paths.corpus), "--output_dir", str(tmp_path / "ev"), "--max_completion_length", "8", *flags]
    assert main(argv) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: {data}, row 2 (id '1'): the first context of question 'Where is it it"), line
    assert limit in line, line
    assert not (tmp_path / "ev" / "results.json").exists()


# ------------------------------------------------------------------------------------------ retrieval server and client


def raw_request(port: int, head: str, body: bytes = b"", receive_buffer: int | None = None) -> socket.socket:
    """A connected socket that has sent ``head`` (request line and headers, without the blank line) and ``body``."""
    sock = socket.socket()
    if receive_buffer is not None:  # a small window: the answer stays in the server's buffers
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(60)
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"{head}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (or resets) the connection."""
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except ConnectionResetError:
        pass
    sock.close()
    return data


def status(port: int, host: str) -> int:
    answer = read_all(raw_request(port, f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close"))
    return int(answer.split(b" ", 2)[1])


def test_a_client_that_never_reads_its_answer_is_cut_off(tmp_path):
    corpus = tmp_path / "big.jsonl"
    filler = "common filler " * 8000  # 112 KB a passage: 40 of them make an answer of about 9 MB
    corpus.write_text(
        "".join(json.dumps({"id": str(i), "contents": f'"Doc {i}"\n{filler}'}) + "\n" for i in range(40))
    )
    port = free_port()
    server = start_retriever(tmp_path, port, "--corpus", str(corpus), "--request_timeout", "1")
    try:
        body = json.dumps({"queries": ["common filler"] * 2, "topk": 40}).encode()
        head = f"POST /retrieve HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json"
        clients = [raw_request(port, head, body, receive_buffer=4096) for _ in range(3)]
        firsts = [client.recv(1024) for client in clients]  # the answers have started; nothing more is read
        size = int(firsts[0].split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
        assert size > 8 * 2**20, firsts[0]
        time.sleep(4)  # well past --request_timeout 1 after the answers were written
        for client, first in zip(clients, firsts):
            assert len(first) + len(read_all(client)) < size  # dropped, not kept for the client
        assert status(port, f"127.0.0.1:{port}") == 200  # and the server serves on
    finally:
        stop(server)


def test_a_loopback_server_answers_only_loopback_host_names(tmp_path):
    port = free_port()
    server = start_retriever(tmp_path, port)
    try:
        assert [status(port, f"{host}:{port}") for host in ("localhost", "127.0.0.1", "[::1]")] == [200] * 3
        assert status(port, f"rebound.example:{port}") == 421
        answer = read_all(raw_request(port, "GET /health HTTP/1.1\r\nHost: rebound.example\r\nConnection: close"))
        assert b"restart the server with --allowed_hosts NAME" in answer
    finally:
        stop(server)
    server = start_retriever(tmp_path, port, "--allowed_hosts", "rebound.example")
    try:
        assert status(port, f"rebound.example:{port}") == 200
        assert status(port, f"other.example:{port}") == 421
    finally:
        stop(server)


def test_a_host_with_text_after_the_brackets_and_a_chunked_body_with_a_length_are_refused(tmp_path):
    """Issue 44, R-e and R-d: `[::1]evil.com` is no loopback name; Content-Length beside chunked gets the 411 that
    plain chunked gets (a proxy honouring the length would see another body)."""
    port = free_port()
    server = start_retriever(tmp_path, port)
    try:
        hosts = ("[::1]evil.com", "[::1].evil.com", f"[::1]evil.com:{port}", "localhost:x", "[::1]", f"[::1]:{port}")
        assert [status(port, host) for host in hosts] == [421] * 4 + [200] * 2
        body = b'{"queries": ["hamlet"]}'
        chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        head = "POST /retrieve HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nConnection: close"
        answer = read_all(raw_request(port, head + "\r\nTransfer-Encoding: chunked", chunked))  # and Content-Length
        assert answer.startswith(b"HTTP/1.1 411 ") and b"no chunked bodies" in answer, answer[:300]
        plain = read_all(raw_request(port, head, body))
        assert plain.startswith(b"HTTP/1.1 200 "), plain[:300]
    finally:
        stop(server)


@pytest.mark.parametrize("command", ["ask", "eval"])
def test_a_retriever_url_with_a_password_is_refused_without_echoing_it(tmp_path, capsys, tiny_model_dir, command):
    url = "http://alice:hunter2@127.0.0.1:9"
    argv = [command, *(["Where?"] if command == "ask" else [])]
    argv += ["--model_name_or_path", str(tiny_model_dir), "--retriever_url", url]
    argv += ["--dataset_name", "qa.jsonl", "--output_dir", str(tmp_path / "ev")] if command == "eval" else []
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "hunter2" not in err and "alice" not in err, err
    assert err == (
        "error: retriever URL 'http://***@127.0.0.1:9' holds a user name or password. Remove them: the server takes "
        "its API key as a bearer token, set $MEMPO_RETRIEVER_API_KEY instead.\n"
    )


def run_on_read_only(directory, argv: list[str]) -> subprocess.CompletedProcess:
    """`mempo-trl ARGV` in a subprocess that sees ``directory`` as a read-only file system (a bind mount in a user
    and mount namespace); skips the test where namespaces are not allowed."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")
    mount = f"mount --bind -o ro {shlex.quote(str(directory))} {shlex.quote(str(directory))}"
    if subprocess.run(["unshare", "-rm", "sh", "-c", mount], capture_output=True).returncode:
        pytest.skip("user and mount namespaces are not allowed here")
    command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "mempo_trl", *argv])
    return subprocess.run(["unshare", "-rm", "sh", "-c", f"{mount} && exec {command}"], capture_output=True, text=True)


def test_build_index_accepts_a_read_only_cache_that_holds_the_index(tmp_path, capsys):
    cache = tmp_path / "cache"
    argv = ["build-index", "--corpus", str(write_corpus(tmp_path)), "--retriever_cache_dir", str(cache)]
    assert main(argv) == 0
    done = run_on_read_only(cache, argv)
    assert done.returncode == 0, done.stderr
    assert "loaded from cache" in done.stdout, done.stdout
    assert f"the index is already built in {cache} (read-only); nothing to write." in done.stdout
    other = run_on_read_only(cache, [*argv, "--bm25_k1", "1.3"])  # another index: not there, and cannot be written
    assert (other.returncode, other.stderr) == (
        2,
        (
            f"error: index cache {cache} cannot be written and does not hold this index. Choose another "
            "--retriever_cache_dir or fix its permissions.\n"
        ),
    )


# ------------------------------------------------------------------------------------------ vLLM server


def test_an_unreachable_vllm_server_is_one_error_line_before_the_model_loads(tmp_path, capsys, tiny_model_dir):
    """`vllm_mode: server` with nothing at the server's address: one line naming the URL after
    `vllm_server_timeout` (TRL's own wait), before any model is loaded or the output directory is claimed."""
    port = free_port()
    start = time.monotonic()
    assert (
        train(
            tmp_path,
            tiny_model_dir,
            use_vllm=True,
            vllm_mode="server",
            vllm_server_host="127.0.0.1",
            vllm_server_port=port,
            vllm_server_timeout=2,
        )
        == 2
    )
    line = one_error_line(capsys)
    assert line.startswith(f"error: the vLLM server http://127.0.0.1:{port} did not answer /health within 2 s ("), line
    assert "trl vllm-serve" in line and "vllm_server_timeout" in line
    assert time.monotonic() - start < 60
    assert not (tmp_path / "out").exists()


def serve_vllm_health(port: int, status: int = 200, delay: float = 0.0):
    """After ``delay`` seconds, an HTTP server on 127.0.0.1:``port`` answering ``/health`` with ``status`` and, as
    vLLM's server does, ``/health/`` with a redirect there (307); returns it (end it with ``shutdown()``)."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            code = {"/health": status, "/health/": 307}.get(self.path, 404)
            self.send_response(code)
            if code == 307:
                self.send_header("Location", "/health")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    time.sleep(delay)
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_vllm_server_check_waits_for_a_server_that_comes_up_and_names_a_bad_answer():
    """A server that starts listening within the timeout passes (vLLM's real one redirects ``/health/``: the check
    asks ``/health``, as TRL's client does); one that answers 503 is named."""
    import threading

    from mempo_trl.loading import check_vllm_server

    port = free_port()
    servers = []
    late = threading.Thread(target=lambda: servers.append(serve_vllm_health(port, 200, delay=1.5)))
    late.start()
    check_vllm_server(f"http://127.0.0.1:{port}", timeout=20, interval=0.5)  # passes once the server is up
    late.join()
    servers[0].shutdown()
    busy = serve_vllm_health(free_port(), 503)
    url = f"http://127.0.0.1:{busy.server_address[1]}"
    with pytest.raises(ConnectionError, match=r"did not answer /health within 1 s \(HTTP 503\)"):
        check_vllm_server(url, timeout=1, interval=0.2)
    busy.shutdown()


def test_a_held_weight_sync_group_port_is_one_error_line_before_the_model_loads(
    tmp_path, capsys, tiny_model_dir, monkeypatch
):
    """The trainer's main process listens on `vllm_group_port` for the vLLM server's workers (TRL 1.16, vLLM >=
    0.28): a port another process holds (an earlier run's trainer) is one line naming host and port, before any model
    loads or the output directory is claimed, not a failed rendezvous after the model loaded."""
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    server = serve_vllm_health(free_port())
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    group_port = holder.getsockname()[1]
    try:
        settings = {"vllm_server_port": server.server_address[1], "vllm_group_port": group_port}
        code = train(
            tmp_path, tiny_model_dir, use_vllm=True, vllm_mode="server", vllm_server_host="127.0.0.1", **settings
        )
    finally:
        holder.close()
        server.shutdown()
    assert code == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: the weight-sync group port 127.0.0.1:{group_port} (vllm_group_port) is in use "), (
        line
    )
    assert "pick a free port with vllm_group_port" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_truncated_sampling_under_vllms_is_correction_is_said_once_per_run(tmp_path, tiny_model_dir):
    """`top_p < 1` with vLLM and TRL's importance-sampling correction (trl#6789) is announced with its reason and fix
    once per run, before anything else the run prints: by the launcher of a two-process `mempo-trl train`, not again
    by the processes it starts (which then stop, as vllm is not installed here)."""
    recipe = cpu_recipe(tmp_path, tiny_model_dir, use_vllm=True, vllm_mode="colocate", top_p=0.9)
    command = [sys.executable, "-m", "mempo_trl", "train", "--config", str(recipe)]
    command += ["--accelerate_config", "cpu_ddp", "--num_processes", "2"]
    run = subprocess.run(
        command,
        cwd=tmp_path,
        env=worker_env(PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    lines = run.stdout.splitlines()
    said = [i for i, line in enumerate(lines) if "trl#6789" in line]
    assert len(said) == 1, run.stdout[-5000:]
    assert "top_p=0.9 with vLLM: TRL's importance-sampling ratio" in lines[said[0]]
    assert "renormalised over the tokens the truncation keeps" in lines[said[0]]
    assert "set vllm_importance_sampling_correction: false" in lines[said[0]]
    launching = next(i for i, line in enumerate(lines) if line.startswith("mempo-trl: launching"))
    assert said[0] < launching, lines[:5]
    # A process that built its config (silently) ends there; the first to end may take the other down first.
    assert any("vLLM is not available" in line for line in lines)


def test_server_mode_on_a_trainer_without_cuda_is_one_error_line_before_the_model_loads(
    tmp_path, capsys, tiny_model_dir, monkeypatch
):
    """TRL's client syncs the weights over NCCL and refuses a non-CUDA device only after the model has loaded: with
    the server up and the group port free, a CPU trainer is told so (and what to use instead) before that."""
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    server = serve_vllm_health(free_port())
    try:
        settings = {"vllm_server_port": server.server_address[1], "vllm_group_port": free_port()}
        code = train(
            tmp_path, tiny_model_dir, use_vllm=True, vllm_mode="server", vllm_server_host="127.0.0.1", **settings
        )
    finally:
        server.shutdown()
    assert code == 2
    line = one_error_line(capsys)
    assert line.startswith(
        "error: vllm_mode: server syncs the weights into the vLLM server over NCCL, which needs a "
    ), line
    assert "use_cpu is set" in line and "vllm_mode: colocate" in line
    assert not (tmp_path / "out").exists()


def test_the_group_port_check_passes_a_free_port_and_refuses_an_address_the_server_cannot_reach(monkeypatch):
    """A free port on this machine passes; a trainer that would announce a loopback address to a server on another
    machine is told to set VLLM_HOST_IP (the server's workers would wait for the group until they time out)."""
    from mempo_trl.loading import check_vllm_group_port

    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    check_vllm_group_port("127.0.0.1", free_port())
    check_vllm_group_port("localhost", free_port())
    with pytest.raises(
        ConnectionError, match=r"^the vLLM server on 192\.0\.2\.10 would connect back to 127\.0\.0\.1:"
    ):
        check_vllm_group_port("192.0.2.10", 51216)
    monkeypatch.setenv("VLLM_HOST_IP", "192.0.2.20")
    check_vllm_group_port("192.0.2.10", free_port())  # an address the server can reach: only the port is checked
