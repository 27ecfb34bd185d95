"""The suite collects and lints every test file it holds.

A tier folder named like a directory pytest or ruff skip by default (``dist``, ``build``,
``venv``...) would drop its tests from ``pytest tests`` and ``ruff check .`` without a word:
the folder ``tests/dist`` did, until this test. Every test module lives in a tier folder.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
TIERS = {"unit", "distributed", "integration", "e2e", "fuzz"}


def _test_files() -> set[str]:
    return {str(p.relative_to(REPO)) for p in TESTS.rglob("test_*.py")}


def test_every_test_module_is_in_a_tier_folder() -> None:
    outside = {f for f in _test_files() if pathlib.Path(f).parts[1] not in TIERS}
    assert outside == set(), f"move these into a tier folder ({sorted(TIERS)}): {sorted(outside)}"


def test_pytest_collects_every_test_module() -> None:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "tests"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    collected = {line.split("::")[0] for line in done.stdout.splitlines() if "::" in line}
    assert _test_files() - collected == set(), done.stdout[-2000:] + done.stderr[-2000:]


def test_ruff_lints_every_python_file_of_the_tests() -> None:
    ruff = pathlib.Path(sys.executable).with_name("ruff")
    done = subprocess.run([str(ruff), "check", ".", "--show-files"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    linted = {str(pathlib.Path(line.strip()).resolve().relative_to(REPO))
              for line in done.stdout.splitlines() if line.strip().endswith(".py")}
    missing = {str(p.relative_to(REPO)) for p in TESTS.rglob("*.py")} - linted
    assert missing == set(), sorted(missing)
