"""Default sink: append-only JSON-lines spool files, one series per process."""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path
from typing import Any

from telemetry.sinks.base import Sink

DEFAULT_MAX_BYTES = 64 * 1024 * 1024

_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")
# Built once: json.dumps() with keyword options constructs a new encoder per call.
# default=str is a last resort for events that did not come through span().
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str)


def _safe_component(text: str) -> str:
    return _UNSAFE_CHARS.sub("_", text) or "unknown"


class SpoolSink(Sink):
    """Writes ``events-{host}-{pid}-{seq:05d}.jsonl`` files into ``spool_dir``.

    Each process owns its files, so writers never interleave and a crash can only
    tear the last line of a file.
    """

    def __init__(
        self,
        spool_dir: str | os.PathLike[str],
        max_bytes: int = DEFAULT_MAX_BYTES,
        host: str | None = None,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.spool_dir = Path(spool_dir)
        self.max_bytes = max_bytes
        self._host = _safe_component(host or socket.gethostname())
        self._pid = os.getpid()
        self._seq = 0
        self._file: Any = None
        self._size = 0

    @property
    def current_path(self) -> Path | None:
        return None if self._file is None else Path(self._file.name)

    def _check_fork(self) -> None:
        pid = os.getpid()
        if pid == self._pid:
            return
        # A forked child inherits the parent's open file; it must start its own series.
        # The file is unbuffered, so closing the child's descriptor loses nothing.
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
        self._file = None
        self._size = 0
        self._seq = 0
        self._pid = pid

    def _open_next(self) -> Any:
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        while True:
            name = f"events-{self._host}-{self._pid}-{self._seq:05d}.jsonl"
            self._seq += 1
            try:
                # Exclusive create: a reused pid (e.g. container restarts) must never
                # append to a file written by an earlier process.
                handle = open(self.spool_dir / name, "xb", buffering=0)  # noqa: SIM115
            except FileExistsError:
                continue
            self._file = handle
            self._size = 0
            return handle

    def emit(self, batch: list[dict[str, Any]]) -> None:
        if not batch:
            return
        self._check_fork()
        data = ("\n".join(map(_ENCODER.encode, batch)) + "\n").encode("utf-8")
        handle = self._file if self._file is not None else self._open_next()
        view = memoryview(data)
        # One write() per batch; the loop only matters for a short write (e.g. disk full).
        while view:
            written = handle.write(view)
            if written is None or written <= 0:
                raise OSError(f"short write to {handle.name}")
            view = view[written:]
        handle.flush()
        self._size += len(data)
        if self._size >= self.max_bytes:
            self._close_file()

    def _close_file(self) -> None:
        handle, self._file = self._file, None
        if handle is None:
            return
        try:
            os.fsync(handle.fileno())
        finally:
            handle.close()

    def flush(self) -> None:
        self._check_fork()
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        self._check_fork()
        self._close_file()


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
        lines = path.read_bytes().split(b"\n")
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
