"""Runs the code examples of one documentation page, in order, as a reader would type them.

``python tests/support/docs_runner.py STEPS.json`` in the page's scratch directory. The steps
come from ``tests/e2e/test_docs_examples.py``: ``python`` blocks and the hidden ``given``
set-up before them run in one shared namespace, ``bash`` blocks in ``bash -e -o pipefail``,
``file`` blocks are written to their file. A failure prints the page and line and exits 1.

It is a script file, not ``python -c``, because a launcher that re-runs ``sys.argv`` on other
ranks (Lightning's DDP) must find it again: each such rank runs the page from the top.
"""

from __future__ import annotations

import json
import subprocess
import sys
import traceback


class BlockFailed(Exception):
    """A bash block exited non-zero."""


def _run_step(step: dict, namespace: dict) -> None:
    if step["kind"] == "file":
        with open(step["name"], "w", encoding="utf-8") as f:
            f.write(step["code"])
    elif step["kind"] == "bash":
        done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", step["code"]])
        if done.returncode != 0:
            raise BlockFailed(f"the bash block exited {done.returncode}")
    else:  # python, or the hidden set-up ("given") of the block at that line
        exec(compile(step["code"], f"{step['page']}:{step['line']}", "exec"), namespace)  # noqa: S102


def main(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        steps = json.load(f)
    namespace: dict = {"__name__": "__main__"}
    for step in steps:
        try:
            _run_step(step, namespace)
        except BaseException as exc:  # noqa: BLE001 - report which block failed, then fail
            if isinstance(exc, SystemExit) and exc.code in (None, 0):
                continue
            if not isinstance(exc, BlockFailed):
                traceback.print_exc()
            where = f"{step['page']}:{step['line']}"
            print(f"FAILED: the {step['kind']} block at {where}: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # the page's output in order with its children's
    sys.exit(main(sys.argv[1]))
