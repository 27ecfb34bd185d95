"""Spool source: tails the JSON-lines spool segments of the embedded mode (no broker).

Positions are byte offsets per file, kept in a small state file written atomically (and
fsync'd) after each successful insert. Only complete lines are read, so a file still being
written is picked up where it was left. A line longer than ``max_line_bytes`` is skipped to
the next newline and quarantined (a truncated copy), so it cannot stop the file's tail. With
``prune`` (the ingester's default; other readers keep their own positions and leave files
alone), a segment that is sealed (its writer rotated it, exited or died) and stored to its
end is deleted: the spool does not grow without bound.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from telemetry.ingest.records import Reject, decode_lines
from telemetry.ingest.runner import Batch
from telemetry.sinks.segments import SEGMENT_GLOB, is_sealed

STATE_NAME = ".ingest-state.json"
MAX_LINE_BYTES = 8 << 20


class SpoolSource:
    name = "spool"

    def __init__(self, spool_dir: str | os.PathLike[str], state_file: str | os.PathLike[str] | None = None,
                 *, prune: bool = False, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self.spool_dir = Path(spool_dir)
        self.state_file = Path(state_file) if state_file else self.spool_dir / STATE_NAME
        self.prune = prune
        self.max_line_bytes = max_line_bytes
        self._offsets: dict[str, int] = self._load_state()
        self.assigned = True

    def _load_state(self) -> dict[str, int]:
        try:
            data = json.loads(self.state_file.read_text())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            return {str(k): int(v) for k, v in data.items()}
        except FileNotFoundError:
            return {}
        except (ValueError, TypeError) as exc:
            raise ValueError(f"ingest state {self.state_file} is corrupt ({exc}); delete it to "
                             "re-ingest the spool (duplicates are merged)") from exc

    def poll(self, max_events: int, linger_s: float) -> Batch:
        events: list[dict[str, Any]] = []
        rejects: list[Reject] = []
        position = dict(self._offsets)
        for path in sorted(self.spool_dir.glob(SEGMENT_GLOB)):
            if len(events) >= max_events:
                break
            start = position.get(path.name, 0)
            try:
                with open(path, "rb") as handle:
                    handle.seek(start)
                    data = handle.read(self.max_line_bytes)  # bounded: a big backlog comes in pieces
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            if end <= 0:
                skipped = self._no_newline(path, start, data, rejects)
                if skipped is not None:
                    position[path.name] = skipped
                continue
            got, bad = decode_lines(data[:end], path.name, start)
            events.extend(got)
            rejects.extend(bad)
            position[path.name] = start + end
        if position == self._offsets:
            return Batch([], None)
        return Batch(events, position, rejects)

    def _no_newline(self, path: Path, start: int, data: bytes, rejects: list[Reject]) -> int | None:
        """Where to go on when no newline follows ``start``: past an over-long line, past the
        torn end of a sealed file, or None to wait for the writer."""
        where = f"{path.name}:{start}"
        if len(data) >= self.max_line_bytes:
            newline = _find_newline(path, start + len(data))
            if newline is not None:
                rejects.append(Reject.of(data, f"line of {newline - start} bytes is over the "
                                         f"{self.max_line_bytes}-byte limit", where, newline - start))
                return newline + 1
        if not data:
            # Read to its end (even an empty file): recorded, so commit() can prune it once sealed.
            return start
        if is_sealed(path):
            size = path.stat().st_size if path.exists() else start + len(data)
            rejects.append(Reject.of(data, "incomplete last line of a finished segment (a torn write)",
                                     where, size - start))
            return size
        return None

    def commit(self, position: Any) -> None:
        # Forget files that are gone, so the state does not grow forever.
        live = {p.name: p for p in self.spool_dir.glob(SEGMENT_GLOB)}
        state = {name: off for name, off in position.items() if name in live}
        done = []
        if self.prune:
            for name, offset in state.items():
                with contextlib.suppress(OSError):
                    st = live[name].stat()
                    if offset >= st.st_size and is_sealed(live[name], st):
                        done.append(name)
        # The state forgets a file before the file goes: a crash between only re-reads it.
        self._save({name: off for name, off in state.items() if name not in done})
        for name in done:
            with contextlib.suppress(OSError):
                live[name].unlink()

    def _save(self, state: dict[str, int]) -> None:
        tmp = self.state_file.with_name(self.state_file.name + ".tmp")
        with open(tmp, "w") as handle:
            handle.write(json.dumps(state))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.state_file)
        self._offsets = state

    def rewind(self, position: Any) -> None:
        return

    def close(self) -> None:
        return


def _find_newline(path: Path, offset: int) -> int | None:
    """Offset of the first newline at or after ``offset``, or None before the end of the file."""
    with contextlib.suppress(OSError), open(path, "rb") as handle:
        handle.seek(offset)
        while chunk := handle.read(1 << 20):
            index = chunk.find(b"\n")
            if index >= 0:
                return offset + index
            offset += len(chunk)
    return None
