"""The reader worker process: one stream, driven over a pipe by the loader.

Requests, answered in order:
  ("next",)            -> ("window", Window | None)
  ("state", tag)       -> ("state", tag, answered, state dict)      now
  ("state_after", n, tag) -> the same, right after serving the next n windows (prefetch)
  ("stop",)
``answered`` is how many ``next`` requests the worker had answered when it took the state,
so the loader can tell whether a prefetched state is the one after exactly the windows it
consumed. A ``state`` request drops a pending ``state_after``.
Between requests the worker cuts windows ahead (up to ``prefetch``), so the loader rarely
waits; windows cut ahead are put back into the buffer in any state it reports.

The worker exits when the loader goes away: on EOF of its pipe, and (whatever else holds
the pipe open) when its parent process is gone.
"""

from __future__ import annotations

import collections
import os
import traceback
from collections.abc import Sequence
from typing import Any

from .source import TokenSource
from .streams import Layout, Stream, StreamState, Window

PARENT_POLL_S = 0.5  # how often an idle worker checks that its parent is alive


def run_worker(conn: Any, layout: dict[str, Any], state: dict[str, Any], prefetch: int,
               inherited: Sequence[Any] = ()) -> None:
    # A forked worker holds copies of the loader's ends of every pipe made so far: close
    # them, so that the loader's death is an EOF here (and for the other workers).
    for c in inherited:
        try:
            c.close()
        except OSError:
            pass
    try:
        _serve(conn, layout, state, prefetch)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the loader is gone
    except BaseException:  # report, so the loader raises instead of waiting forever
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
        raise


def _serve(conn: Any, layout: dict[str, Any], state: dict[str, Any], prefetch: int) -> None:
    parent = os.getppid()
    lay = Layout.from_dict(layout)
    stream = Stream(lay, StreamState.from_dict(state), [TokenSource(p) for p in lay.sources],
                    ahead=prefetch)
    ready: collections.deque[Window | None] = collections.deque()
    pending: list[Any] = []  # [windows still to serve, tag] of a prepared-state request
    answered = 0  # "next" requests answered
    ended = False
    while True:
        idle = len(ready) < prefetch and not ended
        if idle and not conn.poll(0):
            window = stream.next_window()
            ready.append(window)
            ended = window is None
            continue
        while not conn.poll(PARENT_POLL_S):
            if os.getppid() != parent:  # the loader's process died (SIGKILL, OOM)
                return
        msg = conn.recv()
        if msg[0] == "next":
            if not ready:
                ready.append(stream.next_window())
            window = ready.popleft()
            conn.send(("window", window))
            answered += 1
            if pending:
                pending[0] -= 1
                if pending[0] <= 0:
                    _send_state(conn, stream, ready, pending[1], answered)
                    pending = []
        elif msg[0] == "state":
            pending = []
            _send_state(conn, stream, ready, msg[1], answered)
        elif msg[0] == "state_after":
            if msg[1] <= 0:
                pending = []
                _send_state(conn, stream, ready, msg[2], answered)
            else:
                pending = [msg[1], msg[2]]
        elif msg[0] == "stop":
            conn.close()
            return


def _send_state(conn: Any, stream: Stream, ready: collections.deque, tag: int, answered: int) -> None:
    cut_ahead = [w for w in ready if w is not None]
    conn.send(("state", tag, answered, stream.snapshot(cut_ahead).to_dict()))
