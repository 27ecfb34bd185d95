"""What a fuzz case may end in, and how an exception is classified.

Acceptable: ``ok`` (bit-exact success) and ``named`` (a documented error type). Everything
else is a finding: ``raw`` (an exception that is not ours, even when wrapped in a named
one), ``wrong`` (a success that returned other data than it should), ``crash`` (the process
died), ``hang`` (no answer within the time limit).
"""

from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import dataclass, field

from bytecheckpoint.errors import CheckpointError, RankFailedError

OK, NAMED, RAW, WRONG, CRASH, HANG = "ok", "named", "raw", "wrong", "crash", "hang"
HARNESS = "harness"  # the fuzzer itself failed on a case: a bug to fix here, never hidden
GOOD = frozenset({OK, NAMED})
KINDS = (OK, NAMED, RAW, WRONG, CRASH, HANG, HARNESS)


@dataclass
class Result:
    kind: str
    detail: str = ""

    @property
    def bad(self) -> bool:
        return self.kind not in GOOD


def classify(exc: BaseException, named: tuple[type[BaseException], ...] = (CheckpointError,)) -> Result:
    """``named`` when ``exc`` is one of ``named`` and did not merely wrap a foreign exception.

    A single-process load reports a rank's failure as RankFailedError *from* the rank's own
    exception, so a raw IndexError would otherwise pass as a named error: for that wrapper
    the cause decides. A named error raised from a foreign one (a decoder's) is named.
    """
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:]
    e: BaseException | None = exc
    while isinstance(e, RankFailedError) and e.__cause__ is not None:
        e = e.__cause__
    if isinstance(e, named):
        return Result(NAMED, f"{type(e).__name__}: {e}"[:300])
    return Result(RAW, text)


@dataclass
class Tally:
    """Outcome counts of a run plus the first few findings of each bad kind."""

    counts: Counter = field(default_factory=Counter)
    findings: list[dict] = field(default_factory=list)
    keep: int = 20

    def add(self, target: str, result: Result, case: object) -> None:
        self.counts[(target, result.kind)] += 1
        if result.bad:
            self._keep({"target": target, "kind": result.kind, "case": case, "detail": result.detail})

    def _keep(self, finding: dict) -> None:
        if sum(1 for f in self.findings if f["target"] == finding["target"]
               and f["kind"] == finding["kind"]) < self.keep:
            self.findings.append(finding)

    def merge(self, counts: dict, findings: list[dict]) -> None:
        """Add another tally's counts and findings (its counts already include its findings)."""
        for key, n in counts.items():
            self.counts[tuple(key.split(":", 1)) if isinstance(key, str) else key] += n
        for f in findings:
            self._keep(f)

    @property
    def bad(self) -> int:
        return sum(n for (_, kind), n in self.counts.items() if kind not in GOOD)
