#!/usr/bin/env bash
# Create or reuse the project's virtual environment (.venv) and install the project into it.
# torch==2.13.0 goes in first: on these machines it is a CPU build on local disk, and
# installing it before anything that depends on torch keeps pip from fetching CUDA builds.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${BCP_VENV:-.venv}"
EXTRAS="${BCP_EXTRAS:-dev}"  # which extras of pyproject.toml (scripts/demo.sh installs only `demo`)
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.bcp-installed"
want="$(sha256sum pyproject.toml | cut -c1-16)-$EXTRAS"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[$EXTRAS]"
  echo "$want" > "$stamp"
fi
