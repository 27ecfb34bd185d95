"""A TCP proxy in front of the test S3 server that answers chosen requests ``503 SlowDown``, as
a throttling S3 does, and forwards the rest byte for byte (one request at a time per
connection, which is how the AWS SDK talks to it)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections import Counter
from collections.abc import Iterator

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
    length, chunked = 0, False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
        chunked |= name.strip().lower() == b"transfer-encoding" and b"chunked" in value.lower()
    if head_only_body:
        length = 0  # the answer to a HEAD has no body, whatever its Content-Length says
    elif chunked:  # an upload's part with its checksum in a trailer (aws-chunked)
        return _read_chunked(sock, head + b"\r\n\r\n", rest)
    while len(rest) < length:
        got = sock.recv(65536)
        if not got:
            raise ConnectionError("closed")
        rest += got
    return head + b"\r\n\r\n" + rest[:length], rest[length:]


def _read_chunked(sock: socket.socket, head: bytes, rest: bytes) -> tuple[bytes, bytes]:
    """A chunked body after ``head``: chunks up to the zero-size one, then trailers to a blank line."""
    def more() -> None:
        nonlocal rest
        got = sock.recv(65536)
        if not got:
            raise ConnectionError("closed")
        rest += got

    pos = 0
    while True:
        while b"\r\n" not in rest[pos:]:
            more()
        end = rest.index(b"\r\n", pos)
        size = int(rest[pos:end].split(b";")[0], 16)
        pos = end + 2
        if size == 0:
            break
        while len(rest) < pos + size + 2:
            more()
        pos += size + 2
    while b"\r\n\r\n" not in b"\r\n" + rest[pos:]:  # trailers, then the blank line
        more()
    end = (b"\r\n" + rest[pos:]).index(b"\r\n\r\n") + pos + 2
    return head + rest[:end], rest[end:]


class BusyProxy:
    """``busy[method] = n``: the next n requests of that HTTP method get a 503 SlowDown.
    ``requests`` counts every request it received by HTTP method, ``lines`` keeps their request
    lines (``"GET /bucket/key?... HTTP/1.1"``): what a client really sent, for tests that count."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.busy: Counter[str] = Counter()
        self.answered_busy: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self.lines: list[str] = []
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
                with self._lock:
                    self.requests[method] += 1
                    self.lines.append(request.split(b"\r\n", 1)[0].decode(errors="replace"))
                if self._take_busy(method):
                    client.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                                   b"Content-Length: %d\r\n\r\n%s" % (len(_SLOW_DOWN), _SLOW_DOWN))
                    continue
                upstream.sendall(request)
                answer, answer_rest = _read_message(upstream, answer_rest, head_only_body=method == "HEAD")
                while answer.startswith(b"HTTP/1.1 1"):  # "100 Continue" (a PUT's Expect): the answer follows
                    client.sendall(answer)
                    answer, answer_rest = _read_message(upstream, answer_rest,
                                                        head_only_body=method == "HEAD")
                client.sendall(answer)
        except (ConnectionError, OSError):
            pass
        finally:
            client.close()
            upstream.close()

    def reset_counts(self) -> None:
        with self._lock:
            self.requests.clear()
            self.lines.clear()

    def close(self) -> None:
        self._listener.close()


@contextlib.contextmanager
def proxied_s3_root(monkeypatch, name: str) -> Iterator[tuple[BusyProxy, str]]:
    """A fresh ``s3://`` root (see ``servers.s3_root``: skips without an S3 server) whose
    requests from this process go through a :class:`BusyProxy`."""
    from tests.support.servers import s3_root

    root = s3_root(name)
    proxy = BusyProxy(int(os.environ["BCP_S3_ENDPOINT"].rsplit(":", 1)[1]))
    monkeypatch.setenv("BCP_S3_ENDPOINT", f"http://127.0.0.1:{proxy.port}")
    try:
        yield proxy, root
    finally:
        proxy.close()
