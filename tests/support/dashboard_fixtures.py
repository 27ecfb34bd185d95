"""A telemetry store holding a real run, for the dashboard tests (wired in through conftest).

4 gloo ranks (TP=2 x DP=2) save twice, the second time with rank 2's storage slowed down;
2 ranks then load the newest checkpoint (resharding). The spool is ingested into an
embedded chdb store by ``python -m telemetry.ingest`` and the alert rules run on it, each in
its own process as in production. Built once per session.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import dashboard_workloads as dw
from tests.support.telemetry_servers import ROOT, run_ingester

JOB, RUN_SAVE, RUN_LOAD = "dash", "train4", "resume2"


@dataclass(frozen=True)
class DashboardRun:
    dsn: str
    spool: Path
    root: str
    saves: list[str]  # checkpoint URLs, step 1 then step 2 (rank 2 slow)


@pytest.fixture(scope="session")
def dashboard_run(world, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DashboardRun]:
    base = tmp_path_factory.mktemp("dashboard")
    spool, root, dsn = base / "spool", str(base / "ckpt"), f"chdb://{base / 'store'}"
    pool = world(4)
    first = pool.run(dw.save, root, 1, str(spool), JOB, RUN_SAVE)
    second = pool.run(dw.save, root, 2, str(spool), JOB, RUN_SAVE, slow_rank=2, delay_s=0.8)
    world(2).run(dw.load, root, str(spool), JOB, RUN_LOAD)
    # The tests read the spool again after ingesting it: keep its segments.
    run_ingester("--spool", str(spool), "--dsn", dsn, "--once", "--idle-s", "0.5", "--keep-spool")
    alerts = subprocess.run([sys.executable, "-m", "telemetry.alerts", "--once", "--dsn", dsn], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert alerts.returncode == 0, alerts.stderr
    yield DashboardRun(dsn=dsn, spool=spool, root=root, saves=[first[0]["url"], second[0]["url"]])
