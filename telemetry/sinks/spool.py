"""Default sink: the write-ahead spool itself, read later by ``python -m telemetry.ingest --spool``.

Events are appended by the emitting thread (see ``segments.SegmentLog``); the emitter's writer
thread only fsyncs, seals rotated files and keeps the directory under its size cap. The
ingester deletes sealed segments it has durably stored.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, ClassVar

from telemetry.sinks.base import Sink
from telemetry.sinks.segments import (
    DEFAULT_FSYNC,
    SegmentLog,
    SpoolPruner,
    encode_line,
    is_sealed,
    segments,
)

DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_SPOOL_LIMIT = 1024 * 1024 * 1024
# Listing the directory to enforce the cap is cheap, but once a second is enough.
PRUNE_EVERY_S = 1.0


class SpoolSink(Sink):
    """Writes ``events-{host}-{pid}-{seq:05d}.jsonl`` files into ``spool_dir``.

    Each process owns its files, so writers never interleave and a crash can only tear the
    last line of a file. ``limit_bytes`` caps the whole directory: past it the oldest sealed
    segments are dropped and their events counted in ``stats()["dropped"]``.
    """

    inline: ClassVar[bool] = True

    def __init__(
        self,
        spool_dir: str | os.PathLike[str],
        max_bytes: int = DEFAULT_MAX_BYTES,
        host: str | None = None,
        *,
        limit_bytes: int = DEFAULT_SPOOL_LIMIT,
        fsync: str = DEFAULT_FSYNC,
    ) -> None:
        if max_bytes <= 0 or limit_bytes <= 0:
            raise ValueError("max_bytes and limit_bytes must be positive")
        self.spool_dir = Path(spool_dir)
        self.max_bytes = max_bytes
        # Rotate well under the cap, or one open segment could hold the whole budget.
        self._log = SegmentLog(self.spool_dir, min(max_bytes, max(1, limit_bytes // 4)), fsync, host)
        self._pruner = SpoolPruner(self.spool_dir, limit_bytes, "not yet ingested")
        self._last_prune = float("-inf")

    @property
    def current_path(self) -> Path | None:
        return self._log.current_path

    def append(self, event: dict[str, Any]) -> None:
        self._log.append(encode_line(event))

    def emit(self, batch: list[dict[str, Any]]) -> None:
        for event in batch:
            self.append(event)

    def poll(self) -> None:
        self._log.sync()
        if time.monotonic() - self._last_prune >= PRUNE_EVERY_S:
            self._prune()

    def _prune(self) -> None:
        self._last_prune = time.monotonic()
        pending = []
        for path in segments(self.spool_dir):
            try:
                st = path.stat()
            except OSError:
                continue
            pending.append((path, st.st_size, 0, is_sealed(path, st) and path != self._log.current_path))
        self._pruner.enforce(pending)

    def flush(self) -> None:
        self._log.sync()
        self._prune()

    def close(self) -> None:
        self._log.close()

    def stats(self) -> dict[str, int]:
        return {"appended": self._log.appended, "dropped": self._pruner.dropped}


def read_spool(spool_dir: str | os.PathLike[str], strict: bool = False) -> list[dict[str, Any]]:
    """Return every event in ``spool_dir``'s ``*.jsonl`` files, file by file in name order.

    A last line without its newline is a write torn by a crash (or still in progress)
    and is skipped. Other undecodable lines are skipped too unless ``strict``.
    """
    root = Path(spool_dir)
    if not root.is_dir():
        return []
    events: list[dict[str, Any]] = []
    for path in sorted(root.glob("*.jsonl")):
        try:
            lines = path.read_bytes().split(b"\n")
        except FileNotFoundError:
            continue  # ingested and deleted since the listing
        # The final element is b"" for a complete file, otherwise a torn fragment.
        for lineno, line in enumerate(lines[:-1], start=1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except ValueError:
                if strict:
                    raise ValueError(f"{path}:{lineno}: malformed telemetry line") from None
                continue
            if isinstance(event, dict):
                events.append(event)
            elif strict:
                raise ValueError(f"{path}:{lineno}: telemetry line is not an object")
    return events
