#!/usr/bin/env bash
# The main job: FSDP2 training on 4 processes with checkpoints, resumed on 2 (see demo/).
# It runs in its own environment (.venv-demo) with only what the demo needs: the library and
# the `demo` extra, not the test tooling of `.venv` (scripts/test.sh keeps installing everything).
set -euo pipefail
cd "$(dirname "$0")/.."
BCP_VENV=.venv-demo BCP_EXTRAS=demo ./scripts/env.sh
exec .venv-demo/bin/python -m demo "$@"
