"""Kafka sink: many events per message, with a local spool for whatever cannot be sent now.

Runs only on the emitter's writer thread, so a slow or dead broker costs training nothing
but queue space. A batch that the broker does not acknowledge within ``send_timeout_s``
goes to ``{spool_dir}/kafka-pending/`` and is re-sent (oldest first) once the broker
answers again. Re-sending may deliver an event twice; the store deduplicates on event_id.
Nothing is lost while the pending spool is under ``spool_limit_bytes``; past that, batches
are dropped and counted (``telemetry.stats()["sink_dropped"]``) and a warning is logged.

Message format: the value is UTF-8 JSON lines, one event per line, lz4-compressed by the
producer; the key is ``host-pid`` of the sender.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

from telemetry.sinks.base import Sink
from telemetry.sinks.spool import DEFAULT_MAX_BYTES, SpoolSink, _safe_component

log = logging.getLogger("telemetry.kafka")

DEFAULT_TOPIC = "bcp-telemetry"
DEFAULT_SPOOL_LIMIT = 1024 * 1024 * 1024
# Well under kafka-python's default max_request_size (1 MiB) after framing.
MESSAGE_MAX_BYTES = 512 * 1024
PENDING_DIR = "kafka-pending"
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str)
# Pending files are "events-{host}-{pid}-{seq}.jsonl" (written by SpoolSink), renamed to
# "claimed-{host}-{pid}-events-..." when another process adopts them.
_CLAIMED = re.compile(r"^claimed-(?P<host>.+?)-(?P<pid>\d+)-(?P<original>events-.*)$")
_WRITTEN = re.compile(r"^events-(?P<host>.+)-(?P<pid>\d+)-\d+\.jsonl$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def encode_messages(events: list[dict[str, Any]]) -> list[tuple[bytes, int]]:
    """Pack events into JSON-lines message values of at most MESSAGE_MAX_BYTES: (value, count)."""
    out: list[tuple[bytes, int]] = []
    lines: list[bytes] = []
    size = 0
    for event in events:
        line = _ENCODER.encode(event).encode("utf-8")
        if lines and size + len(line) + 1 > MESSAGE_MAX_BYTES:
            out.append((b"\n".join(lines), len(lines)))
            lines, size = [], 0
        lines.append(line)
        size += len(line) + 1
    if lines:
        out.append((b"\n".join(lines), len(lines)))
    return out


def decode_message(value: bytes) -> list[dict[str, Any]]:
    """Events in one message value; lines that are not JSON objects are skipped."""
    events = []
    for line in value.split(b"\n"):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


class KafkaSink(Sink):
    """Sends event batches to ``topic`` on the brokers in ``bootstrap`` (``host:port[,...]``)."""

    def __init__(
        self,
        bootstrap: str,
        topic: str = DEFAULT_TOPIC,
        spool_dir: str | os.PathLike[str] = ".",
        *,
        spool_limit_bytes: int = DEFAULT_SPOOL_LIMIT,
        spool_file_bytes: int = DEFAULT_MAX_BYTES,
        send_timeout_s: float = 5.0,
        retry_backoff_s: tuple[float, float] = (1.0, 30.0),
        producer_config: dict[str, Any] | None = None,
    ) -> None:
        if not bootstrap or not bootstrap.strip():
            raise ValueError("KafkaSink needs bootstrap servers, e.g. '127.0.0.1:9092'")
        self.bootstrap = bootstrap
        self.topic = topic
        self.pending_dir = Path(spool_dir) / PENDING_DIR
        self.spool_limit_bytes = spool_limit_bytes
        self.send_timeout_s = send_timeout_s
        self._backoff_min, self._backoff_max = retry_backoff_s
        self._producer_config = dict(producer_config or {})
        self._spool = SpoolSink(self.pending_dir, spool_file_bytes)
        self._host = _safe_component(socket.gethostname())
        self._key = f"{self._host}-{os.getpid()}".encode()
        self._producer: Any = None
        self._next_try = 0.0
        self._backoff = self._backoff_min
        self._warned_down = False
        self._warned_drop = False
        self._pid = os.getpid()
        self._counters = {"sent": 0, "spooled": 0, "resent": 0, "dropped": 0, "send_failures": 0}
        self._pending_bytes = self._scan_pending()

    # -- Sink interface ------------------------------------------------------------

    def emit(self, batch: list[dict[str, Any]]) -> None:
        if not batch:
            return
        self._check_fork()
        producer = self._connected_producer()
        if producer is not None and self._pending_bytes:
            self._replay(producer)
            producer = self._producer
        if producer is not None:
            failed = self._send(producer, batch)
            self._counters["sent"] += len(batch) - len(failed)
            if not failed:
                return
            batch = failed
        self._to_spool(batch)

    def poll(self) -> None:
        self._check_fork()
        if self._pending_bytes:
            producer = self._connected_producer()
            if producer is not None:
                self._replay(producer)

    def flush(self) -> None:
        self.poll()

    def close(self) -> None:
        self.poll()
        producer, self._producer = self._producer, None
        if producer is not None:
            with contextlib.suppress(Exception):
                producer.close(timeout=self.send_timeout_s)
        self._spool.close()
        if self._pending_bytes:
            log.warning("telemetry: %d bytes of events are still spooled in %s for Kafka at %s; "
                        "the next process using this spool directory re-sends them",
                        self._pending_bytes, self.pending_dir, self.bootstrap)

    def stats(self) -> dict[str, int]:
        return {**self._counters, "pending_bytes": self._pending_bytes}

    # -- producer ------------------------------------------------------------------

    def _connected_producer(self) -> Any:
        if self._producer is not None:
            return self._producer
        now = time.monotonic()
        if now < self._next_try:
            return None
        try:
            from kafka import KafkaProducer

            config = {
                "bootstrap_servers": self.bootstrap,
                "compression_type": "lz4",
                "acks": "all",
                "linger_ms": 0,
                "max_block_ms": int(self.send_timeout_s * 1000),
                "request_timeout_ms": int(self.send_timeout_s * 1000),
                "bootstrap_timeout_ms": int(self.send_timeout_s * 1000),
                "reconnect_backoff_max_ms": 1000,
                "retries": 3,
                **self._producer_config,
            }
            self._producer = KafkaProducer(**config)
        except Exception as exc:  # noqa: BLE001 - unreachable, bad config, missing module...
            self._mark_down(exc)
            return None
        if self._warned_down:
            log.warning("telemetry: Kafka at %s is reachable again; re-sending spooled events",
                        self.bootstrap)
        self._warned_down = False
        self._backoff = self._backoff_min
        return self._producer

    def _mark_down(self, exc: BaseException) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            with contextlib.suppress(Exception):
                # timeout=0 discards unsent records: they are in the spool now.
                producer.close(timeout=0)
        self._next_try = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self._backoff_max)
        if not self._warned_down:
            self._warned_down = True
            log.warning("telemetry: cannot send to Kafka at %s (%s: %s); events are spooled in %s "
                        "and re-sent when the broker is back. Check BCP_TELEMETRY_KAFKA and that "
                        "the broker is running.", self.bootstrap, type(exc).__name__, exc,
                        self.pending_dir)

    def _send(self, producer: Any, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Send ``events``; return those not acknowledged (all of them if the broker is down)."""
        messages = encode_messages(events)
        futures = []
        failed: list[dict[str, Any]] = []
        start = 0
        try:
            for value, count in messages:
                futures.append((producer.send(self.topic, value=value, key=self._key), start, count))
                start += count
            producer.flush(timeout=self.send_timeout_s)
        except Exception as exc:  # noqa: BLE001 - KafkaTimeoutError, connection errors
            self._counters["send_failures"] += 1
            self._mark_down(exc)
            sent_upto = futures[-1][1] + futures[-1][2] if futures else 0
            failed.extend(events[sent_upto:])
        error: BaseException | None = None
        for future, first, count in futures:
            if not (future.is_done and future.succeeded()):
                failed.extend(events[first:first + count])
                error = error or (future.exception if future.is_done else TimeoutError("no ack"))
        if error is not None and self._producer is not None:
            self._counters["send_failures"] += 1
            self._mark_down(error)
        return failed

    # -- pending spool -------------------------------------------------------------

    def _to_spool(self, events: list[dict[str, Any]]) -> None:
        size = sum(len(_ENCODER.encode(e)) + 1 for e in events)
        if self._pending_bytes + size > self.spool_limit_bytes:
            self._counters["dropped"] += len(events)
            if not self._warned_drop:
                self._warned_drop = True
                log.warning("telemetry: Kafka spool %s is full (%d bytes, limit %d); dropping events "
                            "(counted in telemetry.stats()['sink_dropped']). Raise "
                            "BCP_TELEMETRY_SPOOL_LIMIT_BYTES or bring the broker back.",
                            self.pending_dir, self._pending_bytes, self.spool_limit_bytes)
            return
        self._spool.emit(events)
        self._pending_bytes += size
        self._counters["spooled"] += len(events)

    def _owner(self, name: str) -> tuple[str, int, str] | None:
        """(host, pid, original name) of a pending file, or None for a foreign file."""
        match = _CLAIMED.match(name) or _WRITTEN.match(name)
        if match is None:
            return None
        original = match.groupdict().get("original") or name
        return match["host"], int(match["pid"]), original

    def _replayable(self, name: str) -> bool:
        """Mine, or left by a dead process of this host (which nobody else will re-send)."""
        owner = self._owner(name)
        if owner is None or owner[0] != self._host:
            return False
        return owner[1] == os.getpid() or not _pid_alive(owner[1])

    def _pending_files(self) -> list[Path]:
        """Closed pending files to re-send. Files of dead processes are claimed first by an
        atomic rename, so two live senders never replay the same file."""
        if not self.pending_dir.is_dir():
            return []
        files = []
        for path in sorted(self.pending_dir.glob("*.jsonl")):
            owner = self._owner(path.name)
            if owner is None or not self._replayable(path.name):
                continue
            if owner[1] != os.getpid():
                claimed = path.with_name(f"claimed-{self._host}-{os.getpid()}-{owner[2]}")
                try:
                    path.rename(claimed)
                except OSError:
                    continue  # another process claimed it first
                path = claimed
            files.append(path)
        return files

    def _scan_pending(self) -> int:
        if not self.pending_dir.is_dir():
            return 0
        total = 0
        for path in self.pending_dir.glob("*.jsonl"):
            if self._replayable(path.name):
                with contextlib.suppress(OSError):
                    total += path.stat().st_size
        return total

    def _replay(self, producer: Any) -> None:
        # The file being appended to is closed first so it can be replayed and removed.
        self._spool.close()
        for path in self._pending_files():
            try:
                data = path.read_bytes()
            except OSError:
                continue
            # A last line without newline is a torn write by a crashed process: not an event.
            events = decode_message(data[: data.rfind(b"\n") + 1])
            failed = self._send(producer, events) if events else []
            if failed:
                return  # the broker went away again; the file stays for the next try
            with contextlib.suppress(OSError):
                path.unlink()
            self._pending_bytes = max(0, self._pending_bytes - len(data))
            self._counters["resent"] += len(events)
            producer = self._producer
            if producer is None:
                return
        self._pending_bytes = self._scan_pending()

    def _check_fork(self) -> None:
        if os.getpid() != self._pid:
            # A forked child must not share the parent's producer (its sockets and threads).
            self._pid = os.getpid()
            self._producer = None
            self._key = f"{self._host}-{self._pid}".encode()
            self._counters = dict.fromkeys(self._counters, 0)
