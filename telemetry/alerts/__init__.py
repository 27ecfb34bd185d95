"""Alert rules over the telemetry store: slow ranks, low throughput, failures, stale saves.

Run ``python -m telemetry.alerts --once`` from cron, ``--every 60`` as a loop, or pass
``--alerts RULES.yaml`` to the ingester (needed with an embedded chdb store, which only one
process can open). Rules file::

    window_s: 86400             # how far back each evaluation looks
    webhook: http://hooks.example/bcp   # optional
    rules:
      - {type: slow_rank, z: 3.5, min_ratio: 1.5, min_excess_s: 1.0}
      - {type: low_throughput, min_mb_s: 50, min_bytes: 67108864}
      - {type: failed_ops, include_retries: true}
      - {type: uncommitted, deadline_s: 900}
      - {type: unfinished_ranks, after_s: 300}
"""

from telemetry.alerts.base import Alert, AlertConfigError, AllRule, AnyRule, Context, Window
from telemetry.alerts.engine import RuleSet, Scheduler, evaluate, load_rules
from telemetry.alerts.failures import FailedOps
from telemetry.alerts.slow_rank import SlowRank
from telemetry.alerts.throughput import LowThroughput
from telemetry.alerts.uncommitted import Uncommitted
from telemetry.alerts.unfinished import UnfinishedRanks

__all__ = [
    "Alert",
    "AlertConfigError",
    "AllRule",
    "AnyRule",
    "Context",
    "FailedOps",
    "LowThroughput",
    "RuleSet",
    "Scheduler",
    "SlowRank",
    "Uncommitted",
    "UnfinishedRanks",
    "Window",
    "evaluate",
    "load_rules",
]
