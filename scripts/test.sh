#!/usr/bin/env bash
# The test suite: lint, then every test (multi-process ones run real gloo process groups).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/env.sh
./scripts/ensure_chromium.sh  # for the dashboard's screenshot test
./scripts/ensure_compose.sh   # docker-compose v1.29, to validate docker-compose.yml
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
