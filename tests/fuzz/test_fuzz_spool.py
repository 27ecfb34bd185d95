"""Fuzzing the telemetry spool lines the ingester reads.

In this process: every line goes through the ingester's own spool reader and record checks,
and must end as a row that fits the events table or as a quarantined record (never
dropped unaccounted, never a row that makes the whole insert fail). End to end: the real
``python -m telemetry.ingest --once`` on embedded ClickHouse over a spool of hostile and
good lines finishes in time, stores every good event and reports what it quarantined.
"""

from __future__ import annotations

import random
import re
import subprocess

import pytest
from hypothesis import given

from tests.fuzz import corpus, session, spool
from tests.fuzz.strategies import fuzz_settings, spool_lines

pytestmark = pytest.mark.fuzz


@fuzz_settings(100)
@given(spool_lines())
def test_every_spool_line_is_stored_or_quarantined(lines):
    session.check(spool.spool_case(lines), ["spool", lines])


def test_ingest_of_a_hostile_spool_ends_and_stores_every_good_event(tmp_path):
    rng = random.Random(17)
    good = [spool.good_event(rng, tag="good") for _ in range(40)]
    hostile = [spool.random_line(rng) for _ in range(200)]
    hostile += [b'{"event_id": "i1", "name": "n", "step": Infinity}',  # the wedges of issue 17
                b'{"event_id": "i2", "name": "n", "step": ' + b"1" * 31 + b"}",
                b'{"event_id": "i3", "name": "n", "pid": -1}', b"x" * (9 << 20)]
    lines = [spool._json(e) for e in good] + hostile
    rng.shuffle(lines)
    spool_dir, store = tmp_path / "spool", tmp_path / "store"
    spool_dir.mkdir()
    (spool_dir / "events-h-1-00000.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))
    try:
        done = spool.run_ingest(str(spool_dir), str(store), timeout=120)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the ingester wedged on a hostile spool: {exc}")
    assert done.returncode == 3, done.stderr[-3000:]  # 3: done, some records quarantined
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    stored = spool.stored_ids(str(store))
    missing = {e["event_id"] for e in good} - stored
    assert not missing, f"{len(missing)} good events were not stored"
    found = re.search(r"ingested (\d+) events.*quarantined (\d+)", done.stdout)
    assert found, done.stdout
    ingested, quarantined = int(found[1]), int(found[2])
    records = sum(1 for line in lines if line.strip())
    # Every record is accounted for; the count says what was stored (ids may repeat: merged).
    assert ingested + quarantined == records
    assert len(good) <= ingested and len(stored) <= ingested


@pytest.mark.parametrize("name,case", corpus.load("spool"), ids=lambda v: v if isinstance(v, str) else "")
def test_corpus(name, case):
    session.check(spool.spool_case(list(case[1])), case)
