#!/usr/bin/env bash
# Create or reuse the project's virtual environment (.venv) and install the project into it.
# torch==2.13.0 goes in first: on these machines it is a CPU build on local disk, and
# installing it before anything that depends on torch keeps pip from fetching CUDA builds.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${BCP_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.bcp-installed"
want="$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[dev]"
  echo "$want" > "$stamp"
fi
