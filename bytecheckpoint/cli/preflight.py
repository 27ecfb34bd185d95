"""What ``bcp`` checks before a command runs: the settings it reads, and that the HDFS name
node or S3 endpoint its URLs name answers at all.

A bad ``BCP_*`` value is one named error (exit 2) before anything is read, rather than an
"unreadable metadata" note per checkpoint. An unreachable server fails within
``BCP_CLI_CONNECT_TIMEOUT_S`` seconds naming the server: the storage clients retry a dead server
for minutes (hdfs-native about three, S3 over a minute), which protects a training job's saves
from a name node restart but leaves an operator staring at a silent terminal. The probe is the
command line's only; the library's clients and retries are unchanged.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from ..errors import InvalidSettingError, PermanentStorageError

CONNECT_ENV = "BCP_CLI_CONNECT_TIMEOUT_S"
DEFAULT_CONNECT_S = 5.0
HDFS_DEFAULT_PORT = 8020
_PAUSE_S = 0.25  # between connection attempts (a server restarting refuses for a moment)


def check_settings() -> None:
    """Read the settings every command depends on, so a bad value stops it here, by name."""
    from ..format.metadata_file import metadata_max_bytes
    from ..storage.config import settings

    metadata_max_bytes()
    settings()
    connect_timeout()


def connect_timeout() -> float:
    """``BCP_CLI_CONNECT_TIMEOUT_S``: seconds to reach a server; 0 skips the probe."""
    raw = os.environ.get(CONNECT_ENV, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_CONNECT_S
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        raise InvalidSettingError(f"{CONNECT_ENV} = {raw!r} is not a number of seconds >= 0: give how "
                                  f"long bcp tries to reach a storage server (default {DEFAULT_CONNECT_S:g}; "
                                  "0 skips the check), or unset it")
    return value


def _servers(url: str) -> list[tuple[str, str, int]]:
    """(what, host, port) of the server ``url`` talks to, where one is known and reachable by
    TCP; none for a local path, AWS's own S3 endpoint, or an HDFS nameservice (no port, no DNS
    name: the client resolves it from the Hadoop configuration)."""
    from ..storage.config import settings

    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme == "hdfs":
        parts = urlsplit(url if urlsplit(url).netloc else (settings().hdfs.url or ""))
        what, default_port = "HDFS name node", HDFS_DEFAULT_PORT
    elif scheme in ("s3", "s3a"):
        parts = urlsplit(settings().s3.endpoint or "")
        what, default_port = "S3 endpoint", 443 if parts.scheme == "https" else 80
    else:
        return []
    try:
        host, port = parts.hostname, parts.port
    except ValueError:  # a malformed port: the storage layer names it
        return []
    if not host:
        return []
    if port is None:
        try:  # no port: a DNS name on the default port, or a nameservice (not ours to probe)
            socket.getaddrinfo(host, default_port, type=socket.SOCK_STREAM)
        except OSError:
            return []
        port = default_port
    return [(what, host, port)]


def _reach(host: str, port: int, budget_s: float) -> str | None:
    """None once a TCP connection opens within ``budget_s``, else why the last attempt failed."""
    deadline = time.monotonic() + budget_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.05, left)):
                return None
        except OSError as exc:
            reason = exc.strerror or str(exc) or type(exc).__name__
        if deadline - time.monotonic() <= _PAUSE_S:
            return reason
        time.sleep(_PAUSE_S)


def _hdfs_answers(host: str, port: int) -> None:
    from hdfs_native import Client

    Client(f"hdfs://{host}:{port}").get_file_info("/")


def _http_answers(host: str, port: int, tls: bool, timeout: float) -> None:
    import http.client

    conn_type = http.client.HTTPSConnection if tls else http.client.HTTPConnection
    conn = conn_type(host, port, timeout=timeout)
    try:
        conn.request("HEAD", "/")
        conn.getresponse()  # any status, 403 included, is an answer
    finally:
        conn.close()


def _silent(call: Callable[[], None], budget_s: float) -> bool:
    """Whether ``call`` (a first request to the server) is still waiting after ``budget_s``: a
    server that accepts connections and never answers (a hung process, a black-holing
    firewall). It runs in a daemon thread, which exit leaves behind; an error it raises is an
    answer of sorts, for the command itself to report."""
    done = threading.Event()

    def run() -> None:
        with contextlib.suppress(BaseException):
            call()
        done.set()

    threading.Thread(target=run, name="bcp-probe", daemon=True).start()
    return not done.wait(budget_s)


def _answer_check(what: str, host: str, port: int, url: str, left: float) -> Callable[[], None]:
    if what.startswith("HDFS"):
        return lambda: _hdfs_answers(host, port)
    from ..storage.config import settings

    tls = urlsplit(settings().s3.endpoint or "").scheme == "https"
    return lambda: _http_answers(host, port, tls, left)


def probe(args: argparse.Namespace) -> None:
    """Refuse at once, naming the server, when a storage URL among the arguments points at an
    HDFS name node or S3 endpoint that does not accept a connection."""
    budget = connect_timeout()
    if budget == 0:
        return
    urls = [v for v in vars(args).values() if isinstance(v, str) and "://" in v]
    seen: set[tuple[str, int]] = set()
    for url in urls:
        for what, host, port in _servers(url):
            if (host, port) in seen:
                continue
            seen.add((host, port))
            start = time.monotonic()
            reason = _reach(host, port, budget)
            left = budget - (time.monotonic() - start)
            if reason is None and _silent(_answer_check(what, host, port, url, left), max(left, 0.5)):
                reason = "it accepts connections but does not answer"
            if reason is not None:
                raise PermanentStorageError(
                    f"cannot reach the {what} {host}:{port} for {url} within {budget:g}s ({reason}): "
                    "check the host and port (in the URL, BCP_HDFS_URL or BCP_S3_ENDPOINT), that the "
                    f"server runs and that this machine can reach it; {CONNECT_ENV} sets how long "
                    "bcp tries (0 skips this check)")
