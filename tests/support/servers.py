"""Servers the test session starts on 127.0.0.1: ``moto_server`` as the S3 endpoint.

Loaded from conftest as a pytest plugin. moto starts only when a collected test uses S3
(its id mentions ``s3``), before any rank process is spawned, and the endpoint and test
credentials go into ``os.environ`` so every rank inherits them. It is stopped at the end.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid

import pytest

S3_BUCKET = "bcp-test"
_STATE: dict[str, object] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _moto_binary() -> str:
    beside = os.path.join(os.path.dirname(sys.executable), "moto_server")
    found = beside if os.path.exists(beside) else shutil.which("moto_server")
    if not found:
        raise RuntimeError("moto_server is not installed: run ./scripts/env.sh (installs moto[server])")
    return found


def start_moto() -> str:
    """Start moto_server on a free port, create the test bucket, export the endpoint."""
    port = _free_port()
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"moto-{port}.log"), "wb")
    proc = subprocess.Popen([_moto_binary(), "-H", "127.0.0.1", "-p", str(port)], stdout=log,
                            stderr=subprocess.STDOUT)
    _STATE["moto"] = proc
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto_server did not start (log: {log.name})") from None
            time.sleep(0.1)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(BCP_S3_ENDPOINT=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_REGION="us-east-1")
    import pyarrow.fs as pafs

    pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", access_key="testing",
                      secret_key="testing", region="us-east-1",
                      allow_bucket_creation=True).create_dir(S3_BUCKET)
    return endpoint


def pytest_collection_finish(session: pytest.Session) -> None:
    if any("s3" in item.nodeid.lower() for item in session.items):
        start_moto()


def pytest_sessionfinish(session: pytest.Session) -> None:
    stop_moto()


def stop_moto() -> None:
    proc = _STATE.pop("moto", None)
    if isinstance(proc, subprocess.Popen):
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def s3_root(name: str) -> str:
    """A fresh ``s3://`` prefix in the test bucket (moto must be running)."""
    if "moto" not in _STATE:
        pytest.skip("moto_server was not started for this session")
    return f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:8]}/{name}"
