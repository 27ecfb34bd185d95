"""Headless Chromium screenshots of a page, and a check that a PNG shows a rendered page.

Chromium comes from Debian's ``chromium`` package (``scripts/ensure_chromium.sh``, run by
``scripts/test.sh``, installs it when missing).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

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


def rendered(png: Path, *, min_colours: int = 64, min_ink: float = 0.03) -> tuple[bool, str]:
    """Whether ``png`` looks like a rendered page, not a blank or half-loaded one: enough
    distinct colours (a chart's colour scale, text antialiasing) and enough non-background
    pixels. Returns (ok, why)."""
    if not png.is_file() or png.stat().st_size == 0:
        return False, "no screenshot written"
    with Image.open(png) as img:
        rgb = img.convert("RGB")
        small = rgb.resize((rgb.width // 2, rgb.height // 2))
        colours = small.getcolors(maxcolors=1 << 20) or []
        background = max(colours)[1] if colours else (255, 255, 255)
        ink = 1.0 - max(colours)[0] / (small.width * small.height) if colours else 0.0
        desc = f"{rgb.width}x{rgb.height}, {len(colours)} colours, {ink:.1%} non-background {background}"
    if len(colours) < min_colours or ink < min_ink:
        return False, desc
    return True, desc
