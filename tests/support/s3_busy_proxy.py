"""A TCP proxy in front of the test S3 server that answers chosen requests ``503 SlowDown``, as
a throttling S3 does, and forwards the rest byte for byte (one request at a time per
connection, which is how the AWS SDK talks to it)."""

from __future__ import annotations

import socket
import threading
from collections import Counter

_SLOW_DOWN = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"


def _read_message(sock: socket.socket, buffered: bytes, *,
                  head_only_body: bool = False) -> tuple[bytes, bytes]:
    """One HTTP message (head and its Content-Length body) from ``sock``; returns it and what
    was read past it."""
    data = buffered
    while b"\r\n\r\n" not in data:
        got = sock.recv(65536)
        if not got:
            raise ConnectionError("closed")
        data += got
    head, _, rest = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if head_only_body:
        length = 0  # the answer to a HEAD has no body, whatever its Content-Length says
    while len(rest) < length:
        got = sock.recv(65536)
        if not got:
            raise ConnectionError("closed")
        rest += got
    return head + b"\r\n\r\n" + rest[:length], rest[length:]


class BusyProxy:
    """``busy[method] = n``: the next n requests of that HTTP method get a 503 SlowDown."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.busy: Counter[str] = Counter()
        self.answered_busy: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _take_busy(self, method: str) -> bool:
        with self._lock:
            if self.busy[method] > 0:
                self.busy[method] -= 1
                self.answered_busy[method] += 1
                return True
            return False

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        pending, answer_rest = b"", b""
        try:
            while True:
                request, pending = _read_message(client, pending)
                method = request.split(b" ", 1)[0].decode()
                if self._take_busy(method):
                    client.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                                   b"Content-Length: %d\r\n\r\n%s" % (len(_SLOW_DOWN), _SLOW_DOWN))
                    continue
                upstream.sendall(request)
                answer, answer_rest = _read_message(upstream, answer_rest, head_only_body=method == "HEAD")
                client.sendall(answer)
        except (ConnectionError, OSError):
            pass
        finally:
            client.close()
            upstream.close()

    def close(self) -> None:
        self._listener.close()
