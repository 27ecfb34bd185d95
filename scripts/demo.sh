#!/usr/bin/env bash
# The main job: FSDP2 training on 4 processes with checkpoints, resumed on 2 (see demo/).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/env.sh
exec .venv/bin/python -m demo "$@"
