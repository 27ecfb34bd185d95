from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Test telemetry goes to a throwaway spool, set before anything imports telemetry, and
# removed when the session's process exits (each run left up to 112 MB behind).
if "BCP_TELEMETRY_DIR" not in os.environ:
    os.environ["BCP_TELEMETRY_DIR"] = tempfile.mkdtemp(prefix="bcp-test-telemetry-")
    atexit.register(shutil.rmtree, os.environ["BCP_TELEMETRY_DIR"], ignore_errors=True)

from tests.support.dist import WorldPool  # noqa: E402

# Real servers started on 127.0.0.1 by the session: moto_server for S3 (tests/support/servers.py),
# checkpoint roots on each backend (tests/support/roots.py), the Kafka broker and the ClickHouse
# stores of the telemetry pipeline (tests/support/telemetry_servers.py), and a store holding a real run
# for the dashboard (tests/support/dashboard_fixtures.py).
pytest_plugins = [
    "tests.support.servers", "tests.support.roots", "tests.support.telemetry_servers",
    "tests.support.dashboard_fixtures",
]

_POOLS: dict[int, WorldPool] = {}


# The folder a test lives in is its tier, and its marker: `pytest -m unit` is the fast tier
# (no processes, no servers), `-m "not integration and not e2e"` skips the real servers.
TIERS = ("unit", "distributed", "integration", "e2e", "fuzz")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its folder's tier; run the dashboard tests last, in their own order.

    They open the embedded ClickHouse (chdb) in this process (Streamlit's AppTest runs pages
    here), and a gloo pool started in this process after chdb was loaded fails its
    rendezvous (TCPStore connect timeouts). The pools they need are started first, by the
    session fixture, before any store is opened here.
    """
    for item in items:
        parts = item.nodeid.split("/")
        if len(parts) > 2 and parts[0] == "tests" and parts[1] in TIERS:
            item.add_marker(parts[1])
    dashboard = [item for item in items if item.nodeid.startswith("tests/integration/test_dashboard_")]
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


