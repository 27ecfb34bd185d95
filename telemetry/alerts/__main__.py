"""python -m telemetry.alerts: evaluate alert rules against the telemetry store."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from telemetry.alerts.engine import evaluate, load_rules
from telemetry.store import StoreError, connect, default_dsn, ensure_schema


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m telemetry.alerts", description=__doc__.splitlines()[0])
    parser.add_argument("--rules", default=None, help="YAML rules file (default: every rule, defaults)")
    parser.add_argument("--dsn", default=None, help="ClickHouse DSN (default $BCP_CLICKHOUSE_DSN)")
    parser.add_argument("--job", default="", help="only this job")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="evaluate once and exit (for cron)")
    mode.add_argument("--every", type=float, default=60.0, metavar="S", help="loop period (default 60)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        ruleset = load_rules(args.rules)
        client = connect(args.dsn or default_dsn())
        ensure_schema(client)
    except (OSError, ValueError, StoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    while True:
        new = evaluate(client, ruleset, job=args.job)
        print(f"{len(new)} new alert(s)")
        if args.once:
            return 0
        time.sleep(args.every)


if __name__ == "__main__":
    sys.exit(main())
