"""What every alert rule shares: the Alert record, the evaluation window and context, combinators.

A rule is a small frozen dataclass with a pure ``evaluate(window, *, context) -> list[Alert]``:
no I/O, no clock of its own, so tests feed it rows and a time.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, ClassVar, Protocol


class AlertConfigError(ValueError):
    """The alert rules' configuration is wrong (an unknown rule or setting, a value of the wrong
    type or out of range); the message names the setting. Fix the rules file."""


@dataclass(frozen=True, kw_only=True)
class Context:
    """Inputs besides the data: the evaluation time (seconds since the epoch)."""

    now: float


@dataclass(frozen=True)
class Window:
    """Per (job, run, checkpoint, op, step, call, rank, phase) rows, as ``queries.rank_phases``
    returns them.

    Keys used by the rules: job, run, checkpoint, op, rank, phase, step, call, spans, duration_s,
    bytes, errors, retries, start_ts, end_ts, sample_error, world_size (of the rank's newest span).
    ``call`` numbers a rank's calls of one path and step (1, 2, ...); 0 or missing: rows of
    spans with no call id (earlier releases), every call of the step merged.
    """

    rows: Sequence[dict[str, Any]]
    since: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Alert:
    rule: str
    severity: str
    job: str
    run: str
    checkpoint: str
    checkpoint_op: str
    phase: str
    rank: int | None
    value: float
    threshold: float
    message: str
    step: int | None = None
    # Which call of the path at that step (``Window``); 0: not known (spans with no call id).
    call: int = 0
    details: dict[str, Any] = field(default_factory=dict)
    # What makes two alerts the same: the rule, the checkpoint and this subject.
    subject: tuple[Any, ...] = ()

    @property
    def alert_id(self) -> str:
        key = json.dumps([self.rule, self.job, self.run, self.checkpoint, self.checkpoint_op,
                          *self.subject], default=str)
        return hashlib.sha1(key.encode()).hexdigest()

    def to_row(self, now: float) -> dict[str, Any]:
        return {
            "alert_id": self.alert_id, "rule": self.rule, "severity": self.severity, "job": self.job,
            "run": self.run, "checkpoint": self.checkpoint, "checkpoint_op": self.checkpoint_op,
            "step": self.step, "phase": self.phase, "rank": self.rank, "value": float(self.value),
            "threshold": float(self.threshold), "message": self.message,
            "details": json.dumps(self.details, default=str, sort_keys=True),
            "created_at": datetime.fromtimestamp(now, tz=timezone.utc),
        }


class Rule(Protocol):
    name: ClassVar[str]

    def evaluate(self, window: Window, *, context: Context) -> list[Alert]: ...


@dataclass(frozen=True)
class AnyRule:
    """Every alert of every member rule."""

    rules: tuple[Rule, ...]
    name: ClassVar[str] = "any"

    def evaluate(self, window: Window, *, context: Context) -> list[Alert]:
        return [alert for rule in self.rules for alert in rule.evaluate(window, context=context)]


@dataclass(frozen=True)
class AllRule:
    """The first rule's alerts whose (job, run, checkpoint, step, call, rank) every other rule also flags."""

    rules: tuple[Rule, ...]
    name: ClassVar[str] = "all"

    def evaluate(self, window: Window, *, context: Context) -> list[Alert]:
        if not self.rules:
            return []
        results = [rule.evaluate(window, context=context) for rule in self.rules]

        def where(alert: Alert) -> tuple[Any, ...]:
            return (alert.job, alert.run, alert.checkpoint, alert.step, alert.call, alert.rank)

        common = set.intersection(*({where(a) for a in alerts} for alerts in results))
        return [alert for alert in results[0] if where(alert) in common]


def group_rows(rows: Sequence[dict[str, Any]], *keys: str) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row.get(k) for k in keys), []).append(row)
    return groups


def call_of(row: dict[str, Any]) -> int:
    """A row's call number (``Window``): 0 when it has none (spans with no call id)."""
    value = row.get("call")
    if isinstance(value, bool) or not isinstance(value, int):
        return 0
    return max(0, value)


def call_subject(step: Any, call: int, *rest: Any) -> tuple[Any, ...]:
    """An alert's subject in one call: the first call's (or a merged step's) is the one alerts
    had before calls were numbered, so their ids stay; a later call's adds its number."""
    return (step, *rest) if call <= 1 else (step, call, *rest)


def call_text(call: int) -> str:
    """", call N" for a path's second or later call at one step; "" for the first."""
    return f", call {call}" if call > 1 else ""
