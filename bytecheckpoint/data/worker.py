"""The reader worker process: one stream, driven over a pipe by the loader.

Requests, answered in order:
  ("next",)            -> ("window", Window | None)
  ("state", tag)       -> ("state", tag, state dict)      now
  ("state_after", n, tag) -> the same, right after serving the next n windows (prefetch)
  ("stop",)
Between requests the worker cuts windows ahead (up to ``prefetch``), so the loader rarely
waits; windows cut ahead are put back into the buffer in any state it reports.
"""

from __future__ import annotations

import collections
import traceback
from typing import Any

from .source import TokenSource
from .streams import Layout, Stream, StreamState, Window


def run_worker(conn: Any, layout: dict[str, Any], state: dict[str, Any], prefetch: int) -> None:
    try:
        _serve(conn, layout, state, prefetch)
    except BaseException:  # report, so the loader raises instead of waiting forever
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
        raise


def _serve(conn: Any, layout: dict[str, Any], state: dict[str, Any], prefetch: int) -> None:
    lay = Layout.from_dict(layout)
    stream = Stream(lay, StreamState.from_dict(state), [TokenSource(p) for p in lay.sources])
    ready: collections.deque[Window | None] = collections.deque()
    pending: list[Any] = []  # [windows still to serve, tag] of a prepared-state request
    ended = False
    while True:
        idle = len(ready) < prefetch and not ended
        if idle and not conn.poll(0):
            window = stream.next_window()
            ready.append(window)
            ended = window is None
            continue
        msg = conn.recv()
        if msg[0] == "next":
            if not ready:
                ready.append(stream.next_window())
            window = ready.popleft()
            conn.send(("window", window))
            if pending:
                pending[0] -= 1
                if pending[0] <= 0:
                    _send_state(conn, stream, ready, pending[1])
                    pending = []
        elif msg[0] == "state":
            _send_state(conn, stream, ready, msg[1])
        elif msg[0] == "state_after":
            if msg[1] <= 0:
                _send_state(conn, stream, ready, msg[2])
            else:
                pending = [msg[1], msg[2]]
        elif msg[0] == "stop":
            conn.close()
            return


def _send_state(conn: Any, stream: Stream, ready: collections.deque, tag: int) -> None:
    cut_ahead = [w for w in ready if w is not None]
    conn.send(("state", tag, stream.snapshot(cut_ahead).to_dict()))
