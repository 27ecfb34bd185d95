"""Kafka sink: a write-ahead spool that a shipper drains into Kafka, like a log shipper's disk buffer.

Every event is first appended to this process's segment in ``{spool_dir}/kafka-pending/``
(by the emitting thread: one ``write()``), so process exit, a SIGKILL after the append and
broker outages lose nothing. The emitter's writer thread then ships the segments, oldest
first, many events per message, and records how far the broker acknowledged in a cursor file
beside each segment (``events-...jsonl.acked``). A sealed segment shipped to its end is
deleted. Segments left by a dead process on this host (exit while the broker was down,
SIGKILL, crash) are claimed by the next process using the same spool directory and shipped
from their cursor on. Delivery is at least once: a resend may repeat events, which the
store deduplicates on event_id. Past ``spool_limit_bytes`` of unacknowledged events the
oldest sealed segments are dropped, counted (``telemetry.stats()["sink_dropped"]``) and
warned about.

Message format: the value is UTF-8 JSON lines, one event per line, lz4-compressed by the
producer; the key is ``host-pid`` of the sender.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, ClassVar

import tenacity

from telemetry.sinks.base import Sink
from telemetry.sinks.segments import (
    DEFAULT_FSYNC,
    SegmentLog,
    SpoolPruner,
    encode_line,
    is_sealed,
    parse_name,
    pid_alive,
    read_acked,
    remove_segment,
    segments,
    this_host,
    write_acked,
)
from telemetry.sinks.spool import DEFAULT_MAX_BYTES, DEFAULT_SPOOL_LIMIT

log = logging.getLogger("telemetry.kafka")

DEFAULT_TOPIC = "bcp-telemetry"
# Well under kafka-python's default max_request_size (1 MiB) after framing.
MESSAGE_MAX_BYTES = 512 * 1024
# How much of a segment one send round reads.
SHIP_CHUNK_BYTES = 4 * 1024 * 1024
PENDING_DIR = "kafka-pending"

__all__ = ["DEFAULT_SPOOL_LIMIT", "DEFAULT_TOPIC", "KafkaSink", "PENDING_DIR", "decode_message"]


def pack_lines(data: bytes) -> list[tuple[bytes, int, int]]:
    """Complete JSON lines -> message values of at most MESSAGE_MAX_BYTES: (value, bytes of
    ``data`` covered, events). Blank lines are covered but not sent."""
    out: list[tuple[bytes, int, int]] = []
    lines: list[bytes] = []
    size = covered = 0
    for line in data.split(b"\n")[:-1]:
        if lines and size + len(line) + 1 > MESSAGE_MAX_BYTES:
            out.append((b"\n".join(lines), covered, len(lines)))
            lines, size, covered = [], 0, 0
        covered += len(line) + 1
        if line.strip():
            lines.append(line)
            size += len(line) + 1
    if covered:
        out.append((b"\n".join(lines), covered, len(lines)))
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
    """Ships events to ``topic`` on the brokers in ``bootstrap`` (``host:port[,...]``) through a
    write-ahead spool under ``spool_dir``."""

    inline: ClassVar[bool] = True

    def __init__(
        self,
        bootstrap: str,
        topic: str = DEFAULT_TOPIC,
        spool_dir: str | os.PathLike[str] = ".",
        *,
        spool_limit_bytes: int = DEFAULT_SPOOL_LIMIT,
        spool_file_bytes: int = DEFAULT_MAX_BYTES,
        fsync: str = DEFAULT_FSYNC,
        send_timeout_s: float = 5.0,
        retry_backoff_s: tuple[float, float] = (1.0, 30.0),
        producer_config: dict[str, Any] | None = None,
    ) -> None:
        if not bootstrap or not bootstrap.strip():
            raise ValueError("KafkaSink needs bootstrap servers, e.g. '127.0.0.1:9092'")
        if spool_limit_bytes <= 0 or spool_file_bytes <= 0:
            raise ValueError("spool_limit_bytes and spool_file_bytes must be positive")
        self.bootstrap = bootstrap
        self.topic = topic
        self.pending_dir = Path(spool_dir) / PENDING_DIR
        self.spool_limit_bytes = spool_limit_bytes
        self.send_timeout_s = send_timeout_s
        # The same backoff shape as the ingester's and storage's retries (tenacity), but never
        # slept: while the broker is down, events wait in the spool until the next try is due.
        self._backoff = tenacity.wait_exponential(multiplier=retry_backoff_s[0], max=retry_backoff_s[1])
        self._producer_config = dict(producer_config or {})
        self._log = SegmentLog(self.pending_dir, min(spool_file_bytes, max(1, spool_limit_bytes // 4)), fsync)
        self._pruner = SpoolPruner(self.pending_dir, spool_limit_bytes, "not yet acknowledged by Kafka")
        self._host = this_host()
        self._producer: Any = None
        self._tried = False
        self._next_try = 0.0
        self._failures = tenacity.RetryCallState(None, None, (), {})  # attempt_number: failures + 1
        self._warned_down = False
        self._init_process()

    def _init_process(self) -> None:
        self._pid = os.getpid()
        self._key = f"{self._host}-{self._pid}".encode()
        self._producer = None
        self._counters = {"sent": 0, "resent": 0, "send_failures": 0}
        self._sent_own = 0
        self._pending_bytes = sum(size - done for _, size, done, _ in self._pending(claim=False))

    # -- Sink interface ------------------------------------------------------------

    def append(self, event: dict[str, Any]) -> None:
        self._log.append(encode_line(event))

    def emit(self, batch: list[dict[str, Any]]) -> None:
        for event in batch:
            self.append(event)
        self.poll()

    def poll(self) -> None:
        self._check_fork()
        self._log.sync()
        self._ship(self._connected_producer() if self._pending_bytes or self._log.current_path else None)

    def flush(self) -> None:
        self.poll()

    def close(self) -> None:
        self._check_fork()
        self._log.close()
        # At exit, one more connection attempt only if none was made yet: after a failure the
        # events wait on disk for the next process instead of delaying this one's exit.
        producer = self._producer if self._tried else self._connected_producer()
        self._ship(producer)
        producer, self._producer = self._producer, None
        if producer is not None:
            with contextlib.suppress(Exception):
                producer.close(timeout=self.send_timeout_s)
        if self._pending_bytes:
            log.warning("telemetry: %d bytes of events are still spooled in %s for Kafka at %s; "
                        "the next process using this spool directory re-sends them",
                        self._pending_bytes, self.pending_dir, self.bootstrap)

    @property
    def delivering(self) -> bool:
        """Connected to the broker. While not (down, or a connection attempt that hangs), every
        event is safe in the spool, so interpreter exit waits on this sink only briefly
        (``telemetry.emitter.EXIT_NETWORK_WAIT_S``); an explicit ``flush()`` still waits."""
        return self._producer is not None

    def stats(self) -> dict[str, int]:
        pending = max(0, self._log.appended - self._sent_own - self._pruner.dropped)
        return {**self._counters, "appended": self._log.appended, "dropped": self._pruner.dropped,
                "pending": pending, "pending_bytes": self._pending_bytes}

    # -- producer ------------------------------------------------------------------

    def _connected_producer(self) -> Any:
        if self._producer is not None:
            return self._producer
        now = time.monotonic()
        if now < self._next_try:
            return None
        self._tried = True
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
            log.warning("telemetry: Kafka at %s is reachable again; sending spooled events", self.bootstrap)
        self._warned_down = False
        self._failures.attempt_number = 1
        return self._producer

    def _mark_down(self, exc: BaseException) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            with contextlib.suppress(Exception):
                # timeout=0 discards unsent records: they are still in the spool.
                producer.close(timeout=0)
        self._next_try = time.monotonic() + self._backoff(self._failures)
        self._failures.attempt_number += 1
        if not self._warned_down:
            self._warned_down = True
            log.warning("telemetry: cannot send to Kafka at %s (%s: %s); events are spooled in %s "
                        "and sent when the broker is back. Check BCP_TELEMETRY_KAFKA and that "
                        "the broker is running.", self.bootstrap, type(exc).__name__, exc,
                        self.pending_dir)

    def _send(self, producer: Any, data: bytes, own: bool) -> int:
        """Send the complete lines in ``data``; return how many bytes of it the broker
        acknowledged, as a prefix (a later message's ack does not cover an earlier loss)."""
        futures = []
        try:
            for value, covered, count in pack_lines(data):
                future = producer.send(self.topic, value=value, key=self._key) if count else None
                futures.append((future, covered, count))
            producer.flush(timeout=self.send_timeout_s)
        except Exception as exc:  # noqa: BLE001 - KafkaTimeoutError, connection errors
            self._counters["send_failures"] += 1
            self._mark_down(exc)
        acked = 0
        for future, covered, count in futures:
            if future is not None and not (future.is_done and future.succeeded()):
                if self._producer is not None:
                    self._counters["send_failures"] += 1
                    self._mark_down(future.exception if future.is_done else TimeoutError("no ack"))
                break
            acked += covered
            self._counters["sent" if own else "resent"] += count
            if own:
                self._sent_own += count
        return acked

    # -- the spool -----------------------------------------------------------------

    def _pending(self, claim: bool) -> list[tuple[Path, int, int, bool]]:
        """(segment, size, acknowledged offset, sealed) of what this process ships, oldest
        first: its own segments and, claimed by an atomic rename so two live processes never
        ship the same file, those of dead processes of this host."""
        out = []
        for path in segments(self.pending_dir):
            info = parse_name(path.name)
            if info is None or info["host"] != self._host:
                continue  # another host's files are its own shipper's business
            if info["pid"] != self._pid:
                if pid_alive(info["pid"]):
                    continue
                if claim:
                    claimed = path.with_name(f"claimed-{self._host}-{self._pid}-{info['original']}")
                    try:
                        path.rename(claimed)
                    except OSError:
                        continue  # another process claimed it first
                    path = claimed
            try:
                st = path.stat()
            except OSError:
                continue
            sealed = path != self._log.current_path and is_sealed(path, st)
            out.append((path, st.st_size, min(read_acked(path), st.st_size), sealed))
        return out

    def _ship(self, producer: Any) -> None:
        pending = self._pending(claim=producer is not None)
        if producer is not None:
            for path, size, acked, sealed in pending:
                info = parse_name(path.name) or {}
                if not self._ship_segment(producer, path, size, acked, sealed,
                                          own=info.get("writer_pid") == self._pid):
                    break
                producer = self._producer
                if producer is None:
                    break
            pending = self._pending(claim=False)
        self._pending_bytes = self._pruner.enforce(pending)

    def _ship_segment(self, producer: Any, path: Path, size: int, acked: int, sealed: bool,
                      own: bool) -> bool:
        """Ship ``path`` from ``acked`` on; delete it once sealed and shipped. False if the broker failed."""
        while acked < size:
            try:
                with open(path, "rb") as handle:
                    handle.seek(acked)
                    data = handle.read(SHIP_CHUNK_BYTES)
            except OSError:
                return True  # dropped by the size cap meanwhile
            end = data.rfind(b"\n") + 1
            if end == 0:
                if len(data) < SHIP_CHUNK_BYTES:
                    break  # an append in progress, or a torn last line if sealed
                end = len(data)  # no line is this long: garbage, passed on for the ingester to reject
            done = self._send(producer, data[:end], own)
            if done:
                acked += done
                with contextlib.suppress(OSError):
                    write_acked(path, acked)
            if done < end:
                return False
        if sealed:
            # What is left after the last newline of a sealed file is a torn write, not an event.
            remove_segment(path)
        return True

    def _check_fork(self) -> None:
        if os.getpid() != self._pid:
            # A forked child must not share the parent's producer (its sockets and threads).
            self._init_process()
