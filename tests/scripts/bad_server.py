"""A misbehaving retrieval server for reliability tests: `python bad_server.py MODE PORT_FILE`, on 127.0.0.1 only.

MODE `trickle`: answer 200 and then one body byte every 0.1 s (at most 600 bytes); `huge`: stream an 8 MiB
chunked answer with no Content-Length; `huge_declared`: announce a 1 GiB Content-Length. The chosen port is
written to PORT_FILE once listening. Each connection is served once, then closed; the process runs until killed.
"""

import socket
import sys
import threading
import time
from pathlib import Path


def serve_one(conn: socket.socket, mode: str) -> None:
    with conn:
        conn.settimeout(10)
        request = b""
        while b"\r\n\r\n" not in request and len(request) < 65536:
            data = conn.recv(4096)
            if not data:
                return
            request += data
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
