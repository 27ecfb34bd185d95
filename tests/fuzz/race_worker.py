"""A process for the concurrency tests: saves, loads, gc and cooling passes in a loop.

``python -m tests.fuzz.race_worker save PATH_FMT FIRST LAST [overwrite]`` saves steps FIRST..LAST
(a state whose every value is the step), ``load PATH SECONDS`` loads in a loop, ``gc ROOT
SECONDS`` and ``tier HOT COLD SECONDS`` run the deleting tools in a loop. Each prints one JSON
line per attempt: what it saw, whether it failed and whether the failure was a named error.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

import bytecheckpoint as bcp
from bytecheckpoint.errors import CheckpointError


def state(value: int) -> dict[str, Any]:
    return {"model": {"w": torch.full((64, 16), float(value)), "b": torch.arange(8) + value},
            "extra": {"value": value}}


def value_of(loaded: dict[str, Any]) -> int | None:
    """The one save a loaded state came from, or None when its parts disagree (a mixture)."""
    w, b, extra = loaded["model"]["w"], loaded["model"]["b"], loaded["extra"]
    v = int(w[0, 0])
    ok = torch.equal(w, torch.full((64, 16), float(v))) and torch.equal(b, torch.arange(8) + v)
    return v if ok and extra.get("value") == v else None


def _report(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def _failure(exc: BaseException) -> dict[str, Any]:
    return {"ok": False, "named": isinstance(exc, CheckpointError),
            "error": f"{type(exc).__name__}: {exc}"[:300]}


def main(argv: list[str]) -> int:
    what = argv[0]
    if what == "save":
        fmt, first, last = argv[1], int(argv[2]), int(argv[3])
        overwrite = len(argv) > 4 and argv[4] == "overwrite"
        for step in range(first, last + 1):
            try:
                bcp.save(fmt.format(step=step), state(step), step=step, overwrite=overwrite)
                _report(ok=True, step=step)
            except Exception as exc:  # noqa: BLE001 - reported, classified by the test
                _report(step=step, **_failure(exc))
        return 0
    deadline = time.monotonic() + float(argv[-1])
    while time.monotonic() < deadline:
        if what == "load":
            target = state(-1)
            try:
                bcp.load(argv[1], target)
                _report(ok=True, value=value_of(target))
            except Exception as exc:  # noqa: BLE001
                _report(**_failure(exc))
        elif what == "gc":
            from bytecheckpoint.cli import app as cli
            _report(ok=True, code=cli.main(["gc", argv[1], "--keep-last", "2", "--yes", "-q"]))
        elif what == "tier":
            from storage_tiering import load_config, run_once

            config = load_config(hot=argv[1], cold=argv[2], cool_after="1", keep_newest=1)
            try:
                report = run_once(config, now=time.time() + 10)
                _report(ok=not report.failed, cooled=len(report.cooled), failed=report.failed)
            except Exception as exc:  # noqa: BLE001
                _report(**_failure(exc))
        time.sleep(0.01)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
