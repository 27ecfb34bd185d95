from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Test telemetry goes to a throwaway spool, set before anything imports telemetry.
os.environ.setdefault("BCP_TELEMETRY_DIR", tempfile.mkdtemp(prefix="bcp-test-telemetry-"))

from tests.dist import WorldPool  # noqa: E402

# Real servers started on 127.0.0.1 by the session: moto_server for S3 (tests/servers.py),
# checkpoint roots on each backend (tests/roots.py), the Kafka broker and the ClickHouse
# stores of the telemetry pipeline (tests/telemetry_servers.py), and a store holding a real run
# for the dashboard (tests/dashboard_fixtures.py).
pytest_plugins = ["tests.servers", "tests.roots", "tests.telemetry_servers", "tests.dashboard_fixtures"]

_POOLS: dict[int, WorldPool] = {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the dashboard tests last, in their own order.

    They open the embedded ClickHouse (chdb) in this process (Streamlit's AppTest runs pages
    here), and a gloo pool started in this process after chdb was loaded fails its
    rendezvous (TCPStore connect timeouts). The pools they need are started first, by the
    session fixture, before any store is opened here.
    """
    dashboard = [item for item in items if item.nodeid.startswith("tests/test_dashboard_")]
    if dashboard:
        items[:] = [item for item in items if item not in dashboard] + dashboard


@pytest.fixture(scope="session")
def world() -> Iterator:
    """``world(n)`` returns a pool of n ranks in one gloo group, started once per session."""

    def get(n: int) -> WorldPool:
        pool = _POOLS.get(n)
        if pool is None or pool.broken:
            pool = _POOLS[n] = WorldPool(n)
        return pool

    yield get
    for pool in _POOLS.values():
        pool.close()


