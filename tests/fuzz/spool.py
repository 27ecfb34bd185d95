"""Telemetry spool lines: what the ingester reads from a spool directory.

A case is a list of lines (bytes, without the newline) written to one spool file. The
in-process oracle reads them through the ingester's own source and row conversion and
checks every row it would insert against the ClickHouse column types of the events table:
a record either becomes a row the store accepts, or is quarantined (or skipped as not an
event); a record that would make the insert fail forever is a finding. The end-to-end check
(:func:`run_ingest`) runs the real ``python -m telemetry.ingest --once`` on embedded
ClickHouse in a subprocess, with a time limit.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import tempfile
import uuid
from datetime import datetime
from typing import Any

from tests.fuzz.mutate import apply_bytes, random_byte_ops
from tests.fuzz.outcomes import OK, RAW, WRONG, Result

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Column types of the events table (telemetry/store/schema.py), as value ranges.
_INT_RANGES = {"step": 64, "bytes": 64, "rank": 32, "world_size": 32, "dp": 32, "tp": 32, "pp": 32,
               "attempt": 32}
_DT64_MIN, _DT64_MAX = datetime(1900, 1, 1).timestamp(), datetime(2299, 12, 31).timestamp()

HOSTILE = (None, True, -1, 0, 2**31, 2**63, 10**30, -(10**30), float("nan"), float("inf"), -float("inf"),
           1e20, -1e20, "x", "", "\u0000", "é" * 3, [1], {"a": [1]}, 2**64, 4294967296, 1.5)
FIELDS = ("event_id", "name", "ts", "duration_s", "outcome", "error", "step", "rank", "world_size", "dp",
          "tp", "pp", "pid", "bytes", "attempt", "job", "run", "host", "path", "attrs", "checkpoint")


def good_event(rng: random.Random, tag: str = "") -> dict[str, Any]:
    return {"event_id": uuid.UUID(int=rng.getrandbits(128)).hex, "name": "save.write",
            "ts": 1.7e9 + rng.random() * 1e6, "duration_s": rng.random(), "outcome": "ok", "job": "fuzz",
            "run": tag or "r", "rank": rng.randrange(8), "world_size": 8, "step": rng.randrange(10**6),
            "pid": rng.randrange(1, 2**22), "host": "h", "bytes": rng.randrange(2**40),
            "attrs": {"k": rng.random()}}


def _json(event: Any) -> bytes:
    # allow_nan: Python writes Infinity/NaN, exactly what a hostile or buggy emitter sends.
    return json.dumps(event, allow_nan=True).encode()


def random_line(rng: random.Random) -> bytes:
    event = good_event(rng)
    r = rng.random()
    if r < 0.45:
        for _ in range(rng.randrange(1, 3)):
            event[rng.choice(FIELDS)] = rng.choice(HOSTILE)
        return _json(event)
    if r < 0.55:
        del event[rng.choice(list(event))]
        return _json(event)
    if r < 0.85:
        line = _json(event)
        return apply_bytes(line, random_byte_ops(rng, len(line))).replace(b"\n", b" ")
    return rng.choice((b"[]", b"null", b"1", b'"x"', b"{", b"\xff\xfe", b"{}", b'{"event_id": "a"}',
                       b'{"event_id": "a", "name": "n", "ts": 1e400}', b" " * 10))


# -- the in-process oracle -----------------------------------------------------------------------------

def _cell_ok(column: str, value: Any) -> bool:
    if column == "ts":
        return isinstance(value, datetime) and _DT64_MIN <= value.timestamp() <= _DT64_MAX
    if column == "duration_s":
        return isinstance(value, float) and math.isfinite(value) or isinstance(value, int)
    if column == "pid":
        return isinstance(value, int) and 0 <= value < 2**32
    if column in _INT_RANGES:
        bits = _INT_RANGES[column]
        return value is None or (isinstance(value, int) and -(2 ** (bits - 1)) <= value < 2 ** (bits - 1))
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
    return True


def spool_case(lines: list[bytes]) -> Result:
    """Read ``lines`` as a spool file through the ingester's source and record checks: every
    non-blank line is either a row that fits the events table's column types or quarantined
    (nothing dropped unaccounted, nothing that would make the insert fail for the batch)."""
    from telemetry.ingest.spool_source import SpoolSource
    from telemetry.store.writer import EVENT_COLUMNS, event_rows, split_events

    with tempfile.TemporaryDirectory(prefix="bcp-fuzz-spool-") as tmp:
        with open(os.path.join(tmp, "events-h-1-00000.jsonl"), "wb") as f:
            f.write(b"".join(line + b"\n" for line in lines))
        try:
            batch = SpoolSource(tmp).poll(10**6, 0.0)
            good, bad = split_events(batch.events)
            rows = event_rows(good)
        except Exception as exc:  # noqa: BLE001 - nothing here may raise on bad input
            return Result(RAW, f"{type(exc).__name__}: {exc}"[:500])
    records = sum(1 for line in lines if line.strip())
    accounted = len(good) + len(bad) + len(getattr(batch, "rejects", []))
    if accounted != records:
        return Result(WRONG, f"{records} records in, {len(good)} stored + {accounted - len(good)} "
                             "quarantined out: records vanished unaccounted")
    for row in rows:
        for column, value in zip(EVENT_COLUMNS, row):
            if not _cell_ok(column, value):
                return Result(WRONG, f"row would be inserted with {column}={value!r}: the insert fails "
                                     "for the whole batch (not quarantined)")
    return Result(OK)


# -- end to end ----------------------------------------------------------------------------------------

def run_ingest(spool_dir: str, store_dir: str, timeout: float) -> subprocess.CompletedProcess:
    """``python -m telemetry.ingest --spool DIR --once`` on an embedded store; raises
    subprocess.TimeoutExpired when it does not finish (a wedge)."""
    return subprocess.run(
        [sys.executable, "-m", "telemetry.ingest", "--spool", spool_dir, "--dsn", f"chdb://{store_dir}",
         "--once", "--idle-s", "0.5", "--linger-s", "0.1"],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def stored_ids(store_dir: str, timeout: float = 60.0) -> set[str]:
    """Event ids in the store (read in a subprocess: chdb binds a store to one process)."""
    code = ("import sys; from telemetry.store import connect; c = connect(sys.argv[1]); "
            "print('\\n'.join(r[0] for r in c.query('SELECT DISTINCT event_id FROM events').result_rows))")
    out = subprocess.run([sys.executable, "-c", code, f"chdb://{store_dir}"], cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout, check=True)
    return {line for line in out.stdout.splitlines() if line}
