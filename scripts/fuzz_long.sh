#!/usr/bin/env bash
# The long fuzz run of issue 17: at least 100,000 mutations over the metadata, object blobs and
# telemetry spool lines (plus storage files, verify and bcp command lines), run in-process by a
# pool of guarded worker processes that turn a crash or a hang into a finding.
#
#   scripts/fuzz_long.sh                      # 100000 cases, seed 0
#   scripts/fuzz_long.sh --cases 500000 --seed 7 --workers 4 --json fuzz.json
#   scripts/fuzz_long.sh --targets object,spool
#
# Prints counts per target and outcome (ok, named, raw, wrong, crash, hang, harness) and exits 1
# if any case ended in anything but an exact success or a named error. A finding names the seed
# and case index: rerun that case alone with `python -m tests.fuzz.replay TARGET SEED INDEX`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export BCP_TELEMETRY_DIR="${BCP_TELEMETRY_DIR:-$(mktemp -d -t bcp-fuzz-telemetry-XXXX)}"
exec "$PYTHON" -m tests.fuzz.long_run "$@"
