"""Headless Chromium screenshots of a page, and a check that a PNG shows a rendered page.

Chromium comes from Debian's ``chromium`` package (``scripts/ensure_chromium.sh``, run by
``scripts/test.sh``, installs it when missing).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars")


def find_chromium() -> str | None:
    return next((path for name in CANDIDATES if (path := shutil.which(name))), None)


def screenshot(browser: str, url: str, out: Path, *, size: tuple[int, int] = (1400, 900),
               budget_ms: int = 15000, timeout_s: float = 90.0) -> None:
    """One screenshot of ``url`` into ``out`` with a fresh profile."""
    with tempfile.TemporaryDirectory(prefix="bcp-chromium-") as profile:
        cmd = [browser, *FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}",
               f"--window-size={size[0]},{size[1]}", f"--screenshot={out}", url]
        subprocess.run(cmd, capture_output=True, timeout=timeout_s, check=False)


def rendered(png: Path, *, min_colours: int = 64, min_ink: float = 0.05, min_chart: float = 0.0,
             sidebar: float = 0.25) -> tuple[bool, str]:
    """Whether ``png`` looks like a rendered page, not a blank or half-loaded one. Streamlit
    draws its sidebar and widgets before the page body's charts, so only the area right of the
    sidebar counts: it needs enough distinct colours and non-background pixels, and, with
    ``min_chart``, that fraction of strongly coloured pixels (a chart's colour scale or bars;
    text and widgets are grey). Returns (ok, description)."""
    if not png.is_file() or png.stat().st_size == 0:
        return False, "no screenshot written"
    with Image.open(png) as img:
        rgb = img.convert("RGB")
    body = rgb.crop((int(rgb.width * sidebar), 0, rgb.width, rgb.height))
    small = body.resize((max(1, body.width // 2), max(1, body.height // 2)))
    colours = small.getcolors(maxcolors=1 << 20) or []
    count, background = max(colours) if colours else (0, (255, 255, 255))
    ink = 1.0 - count / (small.width * small.height)
    pixels = np.asarray(body, dtype=np.int16)
    chart = float(((pixels.max(axis=2) - pixels.min(axis=2)) > 60).mean())
    desc = (f"{rgb.width}x{rgb.height}; page body: {len(colours)} colours, {ink:.1%} non-background "
            f"{background}, {chart:.2%} chart-coloured")
    return len(colours) >= min_colours and ink >= min_ink and chart >= min_chart, desc
