"""A misbehaving retrieval server for reliability tests: `python bad_server.py MODE PORT_FILE`, on 127.0.0.1 only.

MODE `trickle`: answer 200 and then one body byte every 0.1 s (at most 600 bytes); `huge`: stream an 8 MiB
chunked answer with no Content-Length; `huge_declared`: announce a 1 GiB Content-Length; `trickle_headers`: send
one header byte every 0.1 s (for a minute); `redirect`: a 307 to another URL with a valid-looking JSON body; `nested`:
a 200 whose JSON is nested 100,000 lists deep; `ratelimit`: a 429 with `Retry-After: 1` to the first request, then a
valid answer (one empty result list); `ratelimit_long`: always a 429 with `Retry-After: 3600`. The chosen port is
written to PORT_FILE once listening. Each connection is served once, then closed; the process runs until killed.
"""

import itertools
import socket
import sys
import threading
import time
from pathlib import Path


REQUESTS = itertools.count()
VALID = b'{"result": [[]]}'


def answer(status: str, body: bytes, *headers: str) -> bytes:
    head = [f"HTTP/1.1 {status}", "content-type: application/json", f"content-length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def serve_one(conn: socket.socket, mode: str) -> None:
    with conn:
        conn.settimeout(10)
        request = b""
        while b"\r\n\r\n" not in request and len(request) < 65536:
            data = conn.recv(4096)
            if not data:
                return
            request += data
        # Read the whole body before answering: closing a socket with unread bytes makes the kernel reset the
        # connection, and the client would then see a dropped connection instead of this mode's answer.
        head, _, body = request.partition(b"\r\n\r\n")
        length = next(
            (
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            0,
        )
        while len(body) < length:
            data = conn.recv(4096)
            if not data:
                return
            body += data
        try:
            if mode == "trickle":
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 600\r\n\r\n")
                for _ in range(600):
                    conn.sendall(b" ")
                    time.sleep(0.1)
            elif mode == "huge":
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                chunk = b"x" * 65536
                for _ in range(128):
                    conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                conn.sendall(b"0\r\n\r\n")
            elif mode == "trickle_headers":
                conn.sendall(b"HTTP/1.1 200 OK\r\n")
                for _ in range(600):
                    conn.sendall(b"x")
                    time.sleep(0.1)
            elif mode == "redirect":
                conn.sendall(answer("307 Temporary Redirect", VALID, "location: http://elsewhere.invalid/retrieve"))
            elif mode == "nested":
                conn.sendall(answer("200 OK", b'{"result": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"))
            elif mode == "ratelimit":
                first = next(REQUESTS) == 0
                conn.sendall(
                    answer("429 Too Many Requests", b'{"error": "slow down"}', "retry-after: 1")
                    if first
                    else answer("200 OK", VALID)
                )
            elif mode == "ratelimit_long":
                conn.sendall(answer("429 Too Many Requests", b'{"error": "slow down"}', "retry-after: 3600"))
            elif mode == "huge_declared":
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1073741824\r\n\r\n"
                )
                conn.sendall(b"{" * 65536)
        except OSError:  # the client gave up and closed the connection
            pass


def main() -> None:
    mode, port_file = sys.argv[1], Path(sys.argv[2])
    listener = socket.create_server(("127.0.0.1", 0))
    port_file.write_text(str(listener.getsockname()[1]))
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve_one, args=(conn, mode), daemon=True).start()


if __name__ == "__main__":
    main()
