"""The dashboard's one connection to the telemetry store, shared by every browser session.

An embedded chdb store can be open in one process only (and one store directory per
process), so the dashboard process holds a single client for the configured DSN and
serialises queries on it; sessions never open their own. While the dashboard holds an
embedded store, ``python -m telemetry.ingest`` cannot open it: stop the dashboard to ingest,
start it with ``--spool DIR`` so it ingests the spool itself, or use a ClickHouse server.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from telemetry.store import StoreError, connect, default_dsn, ensure_schema
from telemetry.store.client import normalize_dsn

log = logging.getLogger("dashboard")

DSN_ENV = "BCP_DASHBOARD_DSN"  # set by ``python -m dashboard --dsn``; else BCP_CLICKHOUSE_DSN
SPOOL_ENV = "BCP_DASHBOARD_SPOOL"  # a spool directory the dashboard ingests in the background

T = TypeVar("T")

_lock = threading.Lock()
_state: dict[str, Any] = {"dsn": None, "client": None, "ingester": None}


def configured_dsn() -> str:
    return normalize_dsn(os.environ.get(DSN_ENV, "").strip() or default_dsn())


def run_query(dsn: str, fn: Callable[..., T], /, **params: Any) -> T:
    """``fn(client, **params)`` on the shared client for ``dsn``; one query at a time.

    Raises StoreError subclasses (unreachable, locked, misconfigured) with what to do.
    """
    with _lock:
        client = _client(dsn)
        try:
            return fn(client, **params)
        except StoreError:
            raise
        except Exception as exc:
            if _is_connection_error(exc):
                _close()  # reconnect on the next query
            raise


def _client(dsn: str) -> Any:
    if _state["dsn"] != dsn:
        _close()
        client = connect(dsn)
        try:
            ensure_schema(client)  # an empty store reads as "no data yet", not as an error
        except Exception:
            client.close()
            raise
        _state.update(dsn=dsn, client=client)
    return _state["client"]


def _close() -> None:
    client = _state["client"]
    _state.update(dsn=None, client=None)
    if client is not None:
        try:
            client.close()
        except Exception:  # noqa: BLE001 - it is being dropped anyway
            pass


def close() -> None:
    """Drop the shared client (tests switch stores; chdb allows one store directory per process)."""
    with _lock:
        _close()


def _is_connection_error(exc: Exception) -> bool:
    text = f"{type(exc).__name__} {exc}"
    return any(word in text for word in ("Connection", "connect", "Timeout", "OperationalError"))


def start_spool_ingest(dsn: str, spool_dir: str, every_s: float = 5.0) -> None:
    """Ingest ``spool_dir`` into the store from a thread of this process (idempotent).

    Its read positions are kept per store (``.ingest-state-dashboard-<hash>.json`` in the
    spool), apart from the CLI ingester's: events both deliver are merged by event id.
    """
    with _lock:
        if _state["ingester"] is not None:
            return
        stop = threading.Event()
        thread = threading.Thread(target=_ingest_loop, args=(dsn, spool_dir, every_s, stop),
                                  name="bcp-dashboard-ingest", daemon=True)
        _state["ingester"] = (thread, stop)
        thread.start()


def stop_spool_ingest(timeout_s: float = 30.0) -> None:
    with _lock:
        ingester, _state["ingester"] = _state["ingester"], None
    if ingester is not None:
        thread, stop = ingester
        stop.set()
        thread.join(timeout_s)


def _shared_ingester(source: Any, dsn: str) -> Any:
    """The CLI ingester's insert (``telemetry.ingest.runner.Ingester.insert``: check the events
    against the columns, quarantine the source's rejects and the refused events with their
    reason, bisect a batch the store refuses), run on this process's shared client.

    Each store call goes through ``run_query`` (one query at a time with the pages); the
    store "refuses" a batch when it still answers ``SELECT 1``, else it is unreachable and
    the ingester retries with backoff, as the CLI does.
    """
    from telemetry.ingest.runner import Ingester

    class SharedClientIngester(Ingester):
        def _store(self) -> Any:
            # Actions get the shared client from run_query; this only marks "a store is open",
            # so a failure is classified by _answers() (refused data vs an unreachable store).
            self._client = dsn
            return None

        def _drop_client(self) -> None:
            self._client = None  # run_query drops the shared client on connection errors

        def _answers(self) -> bool:
            try:
                run_query(dsn, lambda client: client.command("SELECT 1"))
            except Exception:  # noqa: BLE001 - any failure means "not answering"
                return False
            return True

        def _attempt(self, action: Callable[[Any], Any], stop: threading.Event) -> tuple[bool, Any]:
            return super()._attempt(lambda _: run_query(dsn, action), stop)

    return SharedClientIngester(source, dsn, retry_for_s=120.0)


def _ingest_loop(dsn: str, spool_dir: str, every_s: float, stop: threading.Event) -> None:
    from telemetry.ingest.runner import Batch
    from telemetry.ingest.spool_source import SpoolSource

    key = hashlib.sha1(dsn.encode()).hexdigest()[:12]
    source = SpoolSource(spool_dir, state_file=Path(spool_dir) / f".ingest-state-dashboard-{key}.json")
    ingester = _shared_ingester(source, dsn)
    try:
        while not stop.is_set():
            batch: Batch = source.poll(5000, 0.2)
            if batch.position is None:
                stop.wait(every_s)
                continue
            try:
                # Stores what it can and quarantines the rest (with the reason), as
                # ``python -m telemetry.ingest`` does; False only when stopped first.
                if (batch.events or batch.rejects) and not ingester.insert(batch, stop):
                    source.rewind(batch.position)
                    break
                source.commit(batch.position)
            except Exception as exc:  # noqa: BLE001 - keep serving; the batch is read again
                log.warning("dashboard ingest: insert failed (%s); retrying in %.0f s", exc, every_s)
                source.rewind(batch.position)
                stop.wait(every_s)
    finally:
        source.close()
