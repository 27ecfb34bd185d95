"""The ingest loop: poll a batch, insert it, then commit its position; retry what fails."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from telemetry.store import StoreConfigError, connect, ensure_schema, insert_events

log = logging.getLogger("telemetry.ingest")

# Test hook: SIGKILL this process after that many inserts, before committing (crash tests).
KILL_AFTER_INSERTS_ENV = "BCP_INGEST_KILL_AFTER_INSERTS"


@dataclass
class Batch:
    events: list[dict[str, Any]]
    position: Any  # None when nothing was read


class Source(Protocol):
    assigned: bool

    def poll(self, max_events: int, linger_s: float) -> Batch: ...

    def commit(self, position: Any) -> None: ...

    def rewind(self, position: Any) -> None: ...

    def close(self) -> None: ...


@dataclass
class IngestStats:
    batches: int = 0
    events: int = 0
    insert_failures: int = 0
    commit_failures: int = 0


class Ingester:
    """Moves batches from ``source`` into the store at ``dsn``.

    ``on_idle(client)`` runs whenever a poll comes back empty (the alert schedule hooks in
    there, since in embedded mode this process is the only one that may open the store).
    """

    def __init__(self, source: Source, dsn: str, *, batch_events: int = 5000, linger_s: float = 1.0,
                 retry_s: tuple[float, float] = (0.5, 30.0),
                 on_idle: Callable[[Any], None] | None = None) -> None:
        self.source = source
        self.dsn = dsn
        self.batch_events = batch_events
        self.linger_s = linger_s
        self._retry_min, self._retry_max = retry_s
        self.on_idle = on_idle
        self.stats = IngestStats()
        self._client: Any = None
        self._kill_after = int(os.environ.get(KILL_AFTER_INSERTS_ENV, "0") or 0)

    def _store(self) -> Any:
        if self._client is None:
            client = connect(self.dsn)
            try:
                ensure_schema(client)
            except Exception:
                client.close()
                raise
            self._client = client
        return self._client

    def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - it is being discarded anyway
                pass

    def insert(self, batch: Batch, stop: threading.Event) -> bool:
        """Insert until it succeeds (True) or ``stop`` is set (False). Bad config raises."""
        delay = self._retry_min
        while True:
            try:
                insert_events(self._store(), batch.events)
                return True
            except StoreConfigError:
                raise
            except Exception as exc:  # noqa: BLE001 - server down, store locked, network
                self.stats.insert_failures += 1
                log.warning("ingest: insert of %d events failed (%s); retrying in %.1fs, nothing is "
                            "committed until it succeeds", len(batch.events), exc, delay)
                self._drop_client()
                if stop.wait(delay):
                    return False
                delay = min(delay * 2, self._retry_max)

    def run(self, *, once: bool = False, idle_s: float = 3.0, join_timeout_s: float = 60.0,
            stop: threading.Event | None = None) -> IngestStats:
        """Ingest until ``stop`` is set; with ``once``, until nothing arrives for ``idle_s``."""
        stop = stop or threading.Event()
        started = time.monotonic()
        last_data = None
        try:
            while not stop.is_set():
                batch = self.source.poll(self.batch_events, self.linger_s)
                now = time.monotonic()
                if batch.position is None:
                    if self.on_idle is not None and self._idle_store() is not None:
                        self.on_idle(self._client)
                    if once:
                        # The idle clock starts once partitions are assigned (group join is slow).
                        if self.source.assigned:
                            last_data = last_data or now
                            if now - last_data >= idle_s:
                                break
                        elif now - started > join_timeout_s:
                            raise TimeoutError(f"no partitions assigned within {join_timeout_s}s")
                    continue
                last_data = now
                if batch.events and not self.insert(batch, stop):
                    break
                self.stats.batches += 1
                self.stats.events += len(batch.events)
                if self._kill_after and self.stats.batches >= self._kill_after:
                    os.kill(os.getpid(), signal.SIGKILL)
                try:
                    self.source.commit(batch.position)
                except Exception as exc:  # noqa: BLE001 - rebalance, broker gone
                    self.stats.commit_failures += 1
                    log.warning("ingest: commit failed (%s); the batch will be read again and its "
                                "duplicates merged by event_id", exc)
                    self.source.rewind(batch.position)
        finally:
            try:
                if self.on_idle is not None and self._idle_store() is not None:
                    self.on_idle(self._client)
            except Exception as exc:  # noqa: BLE001 - do not mask the error that got us here
                log.warning("ingest: final idle task failed: %s", exc)
            self.source.close()
            self._drop_client()
        return self.stats

    def _idle_store(self) -> Any:
        try:
            return self._store()
        except StoreConfigError:
            raise
        except Exception:  # noqa: BLE001 - store down: alerts wait for the next idle poll
            return None
