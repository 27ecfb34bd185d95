"""One seed checkpoint and one guarded worker per test session, shared by the fuzz test files
(building them costs seconds; the fuzz suite's whole budget is 60)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache

from tests.fuzz.cases import Context
from tests.fuzz.guard import Guard, _scratch
from tests.fuzz.outcomes import Result


@cache
def context() -> Context:
    """An in-process context, for targets that cannot crash the interpreter."""
    workdir = tempfile.mkdtemp(prefix="bcp-fuzz-ctx-", dir=_scratch())
    atexit.register(shutil.rmtree, workdir, True)
    return Context.create(workdir)


@cache
def guard() -> Guard:
    """A worker subprocess for cases that might crash or hang (decoders, the command line)."""
    g = Guard(timeout=30.0)
    atexit.register(lambda: (g.close(), shutil.rmtree(g.workdir, True)))
    return g


def check(result: Result, case: object) -> None:
    """Fail the test with the case and what happened unless the outcome is acceptable."""
    from tests.fuzz.cases import describe

    assert not result.bad, f"{result.kind} on {describe(case)}:\n{result.detail}"
