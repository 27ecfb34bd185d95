"""Spool source: tails the JSON-lines spool files of the embedded mode (no broker).

Positions are byte offsets per file, kept in a small state file written atomically after
each successful insert. Only complete lines are read, so a file still being written is
picked up where it was left.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from telemetry.ingest.runner import Batch
from telemetry.sinks.kafka import decode_message

STATE_NAME = ".ingest-state.json"


class SpoolSource:
    def __init__(self, spool_dir: str | os.PathLike[str], state_file: str | os.PathLike[str] | None = None):
        self.spool_dir = Path(spool_dir)
        self.state_file = Path(state_file) if state_file else self.spool_dir / STATE_NAME
        self._offsets: dict[str, int] = self._load_state()
        self.assigned = True

    def _load_state(self) -> dict[str, int]:
        try:
            data = json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return {}
        except ValueError as exc:
            raise ValueError(f"ingest state {self.state_file} is corrupt ({exc}); delete it to "
                             "re-ingest the spool (duplicates are merged)") from exc
        return {str(k): int(v) for k, v in data.items()}

    def poll(self, max_events: int, linger_s: float) -> Batch:
        events: list[dict[str, Any]] = []
        position = dict(self._offsets)
        for path in sorted(self.spool_dir.glob("*.jsonl")):
            if len(events) >= max_events:
                break
            start = position.get(path.name, 0)
            try:
                with open(path, "rb") as handle:
                    handle.seek(start)
                    data = handle.read(8 << 20)  # bounded: a big backlog comes in pieces
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            if end <= 0:
                continue
            events.extend(decode_message(data[:end]))
            position[path.name] = start + end
        if position == self._offsets:
            return Batch([], None)
        return Batch(events, position)

    def commit(self, position: Any) -> None:
        # Forget files that were rotated away, so the state does not grow forever.
        live = {p.name for p in self.spool_dir.glob("*.jsonl")}
        state = {name: off for name, off in position.items() if name in live}
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.state_file)
        self._offsets = state

    def rewind(self, position: Any) -> None:
        return

    def close(self) -> None:
        return
