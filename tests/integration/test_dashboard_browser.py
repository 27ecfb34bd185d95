"""The dashboard served by ``python -m dashboard`` (streamlit run) on 127.0.0.1, screenshotted
in headless Chromium: the heatmap and timeline pages must render real charts.

Screenshots are kept in test-artifacts/dashboard/ (the pictures in docs/img come from there).
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from urllib.parse import urlencode

import pytest

from dashboard import store
from tests.support.browser import find_chromium, rendered, screenshot
from tests.support.dashboard_fixtures import JOB, RUN_SAVE
from tests.support.dist import free_port
from tests.support.telemetry_servers import ROOT

ARTIFACTS = ROOT / "test-artifacts" / "dashboard"


@pytest.fixture
def served(dashboard_run) -> Iterator[str]:
    store.close()  # the server process must be the one that opens the embedded store
    port = free_port()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    log = open(ARTIFACTS / "streamlit.log", "w")  # noqa: SIM115 - closed when the server stops
    proc = subprocess.Popen([sys.executable, "-m", "dashboard", "--dsn", dashboard_run.dsn,
                             "--port", str(port)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{base}/_stcore/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the dashboard did not start; see {ARTIFACTS / 'streamlit.log'}")
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_heatmap_and_timeline_pages_render_in_chromium(served, dashboard_run):
    browser = find_chromium()
    if browser is None:
        pytest.fail("headless Chromium is needed for this test and was not found: run "
                    "scripts/ensure_chromium.sh (as root: apt-get install -y chromium), or run "
                    "./scripts/test.sh, which does that when apt is usable")
    query = urlencode({"job": JOB, "run": RUN_SAVE, "checkpoint": dashboard_run.saves[1], "op": "save"})
    # The first cold render can come out blank, or with widgets but no chart yet (the app's
    # scripts load, the store opens, the page script runs): render each page once to warm up,
    # then retry until a frame shows the chart.
    for page in ("topology", "timeline"):
        screenshot(browser, f"{served}/{page}?{query}", ARTIFACTS / f"warmup-{page}.png", budget_ms=8000)
    for page in ("topology", "timeline"):
        out = ARTIFACTS / f"{page}.png"
        why = ""
        for _ in range(4):
            out.unlink(missing_ok=True)
            screenshot(browser, f"{served}/{page}?{query}", out)
            ok, why = rendered(out, min_chart=0.005)
            if ok:
                break
        else:
            pytest.fail(f"{page}: the screenshot does not look like a rendered page ({why}); kept at {out}")
        assert out.stat().st_size > 30_000, why
