"""The ingest loop: poll a batch, insert it, then commit its position.

What cannot be stored never blocks what can: sources hand over events already checked
against the column types plus the lines they rejected; if the store still refuses a batch
while it answers queries, the batch is bisected down to the refused events. Rejected and
refused records go to the quarantine table with the reason. Only an unreachable store is
retried, with backoff (tenacity), for at most ``retry_for_s``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import tenacity

from telemetry.ingest.records import Reject
from telemetry.store import StoreConfigError, StoreUnavailableError, connect, ensure_schema
from telemetry.store.writer import insert_clean, insert_quarantine, split_events

log = logging.getLogger("telemetry.ingest")

# Test hook: SIGKILL this process after that many inserts, before committing (crash tests).
KILL_AFTER_INSERTS_ENV = "BCP_INGEST_KILL_AFTER_INSERTS"


@dataclass
class Batch:
    events: list[dict[str, Any]]  # as decoded; checked against the columns at insert
    position: Any  # None when nothing was read
    rejects: list[Reject] = field(default_factory=list)


class Source(Protocol):
    assigned: bool
    name: str

    def poll(self, max_events: int, linger_s: float) -> Batch: ...

    def commit(self, position: Any) -> None: ...

    def rewind(self, position: Any) -> None: ...

    def close(self) -> None: ...


@dataclass
class IngestStats:
    batches: int = 0
    events: int = 0  # stored
    quarantined: int = 0
    insert_failures: int = 0  # attempts that found the store unreachable
    commit_failures: int = 0


class _Refused(Exception):
    """The store answers but refused this insert: the data is at fault, not the connection."""


class _Stopped(Exception):
    """``stop`` was set while waiting to retry."""


class Ingester:
    """Moves batches from ``source`` into the store at ``dsn``.

    ``on_idle(client)`` runs whenever a poll comes back empty (the alert schedule hooks in
    there, since in embedded mode this process is the only one that may open the store).
    """

    def __init__(self, source: Source, dsn: str, *, batch_events: int = 5000, linger_s: float = 1.0,
                 retry_s: tuple[float, float] = (0.5, 30.0), retry_for_s: float = 900.0,
                 on_idle: Callable[[Any], None] | None = None) -> None:
        self.source = source
        self.dsn = dsn
        self.batch_events = batch_events
        self.linger_s = linger_s
        self._retry_min, self._retry_max = retry_s
        self.retry_for_s = retry_for_s
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
        """Store ``batch`` (quarantining what the store refuses); False if ``stop`` was set first.

        Raises StoreConfigError for a bad configuration and StoreUnavailableError once the
        store stayed unreachable for ``retry_for_s``.
        """
        good, bad = split_events(batch.events)
        rejects = [*batch.rejects, *(Reject.of_event(event, reason) for event, reason in bad)]
        stored = self._insert_bisecting(good, rejects, stop)
        if stored is None:
            return False
        if rejects:
            try:
                done, _ = self._attempt(lambda c: insert_quarantine(c, self.source.name, rejects), stop)
            except _Refused as exc:
                # Cannot happen for well-formed quarantine rows; never let it wedge the stream.
                log.error("ingest: the store refused %d quarantine rows (%s); first: %s at %s",
                          len(rejects), exc, rejects[0].reason, rejects[0].position)
                done = True
            if not done:
                return False
            for reject in rejects[:20]:
                log.warning("ingest: quarantined %s: %s", reject.position, reject.reason)
        self.stats.events += stored
        self.stats.quarantined += len(rejects)
        return True

    def _insert_bisecting(self, events: list[dict[str, Any]], rejects: list[Reject],
                          stop: threading.Event) -> int | None:
        """Rows stored; the events the store refuses are added to ``rejects``. None if stopped."""
        if not events:
            return 0
        try:
            done, stored = self._attempt(lambda c: insert_clean(c, events), stop)
        except _Refused as exc:
            if len(events) == 1:
                rejects.append(Reject.of_event(events[0], f"the store refused it: {exc}"))
                return 0
            # Halves until the refused events are alone; good rows inserted twice merge on event_id.
            total = 0
            for half in (events[: len(events) // 2], events[len(events) // 2:]):
                part = self._insert_bisecting(half, rejects, stop)
                if part is None:
                    return None
                total += part
            return total
        return stored if done else None

    def _attempt(self, action: Callable[[Any], Any], stop: threading.Event) -> tuple[bool, Any]:
        """``action(client)`` until it succeeds: (True, result), or (False, None) if stopped.

        A failure while the store answers ``SELECT 1`` raises _Refused; an unreachable store
        is retried with backoff (``retry_s``: first wait, doubling to the longest) for at most
        ``retry_for_s``, then StoreUnavailableError. The loop is tenacity's, as in storage.
        """

        def once() -> Any:
            try:
                return action(self._store())
            except StoreConfigError:
                raise
            except Exception as exc:  # noqa: BLE001 - server down, store locked, network, bad data
                if self._client is not None and self._answers():
                    text = str(exc).strip().splitlines()
                    raise _Refused(f"{type(exc).__name__}: {text[0][:300] if text else ''}") from exc
                self.stats.insert_failures += 1
                self._drop_client()
                raise

        backoff = tenacity.wait_exponential(multiplier=self._retry_min, max=self._retry_max)

        def wait(state: tenacity.RetryCallState) -> float:
            return max(0.0, min(backoff(state), self.retry_for_s - (state.seconds_since_start or 0.0)))

        def warn(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            left = self.retry_for_s - (state.seconds_since_start or 0.0)
            log.warning("ingest: insert failed (%s); the store seems unreachable, retrying in %.1fs "
                        "(giving up in %.0fs); nothing is committed until it succeeds",
                        exc, state.upcoming_sleep, left)

        def sleep(seconds: float) -> None:
            if stop.wait(seconds):
                raise _Stopped

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_delay(self.retry_for_s),
            wait=wait,
            retry=tenacity.retry_if_exception(
                lambda e: isinstance(e, Exception) and not isinstance(e, (StoreConfigError, _Refused))),
            before_sleep=warn,
            sleep=sleep,
        )
        try:
            return True, retrying(once)
        except _Stopped:
            return False, None
        except tenacity.RetryError as gave_up:
            exc = gave_up.last_attempt.exception()
            raise StoreUnavailableError(
                f"the store stayed unreachable for {self.retry_for_s:.0f}s ({exc}); nothing was "
                "committed past the last stored batch, so a rerun resumes there") from exc

    def _answers(self) -> bool:
        try:
            self._client.command("SELECT 1")
        except Exception:  # noqa: BLE001 - any failure means "not answering"
            return False
        return True

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
                if (batch.events or batch.rejects) and not self.insert(batch, stop):
                    break
                self.stats.batches += 1
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
