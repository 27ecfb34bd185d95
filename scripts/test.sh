#!/usr/bin/env bash
# The test suite: lint, then every test (multi-process ones run real gloo process groups).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/env.sh
./scripts/ensure_chromium.sh  # for the dashboard's screenshot test
./scripts/ensure_compose.sh   # docker-compose v1.29, to validate docker-compose.yml
.venv/bin/ruff check .
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict -d build/site  # the docs site: fails on a broken link, anchor or reference (not -q: it hides warnings from --strict)
exec .venv/bin/python -m pytest -q "$@"
