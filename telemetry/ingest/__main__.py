"""python -m telemetry.ingest: move telemetry events into ClickHouse (and evaluate alerts).

Examples:
  python -m telemetry.ingest --kafka 127.0.0.1:9092 --dsn chdb:///var/lib/bcp/store
  python -m telemetry.ingest --spool runs/demo/telemetry --once --alerts rules.yaml

Records that cannot be stored are kept in the store's ingest_quarantine table with the reason.
Exit status: 0 done; 1 the store stayed unreachable for --retry-for seconds; 2 a usage or
configuration error; 3 done, but some records were quarantined.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Callable

from telemetry.sinks.kafka import DEFAULT_TOPIC
from telemetry.store import StoreConfigError, StoreUnavailableError, default_dsn
from telemetry.store.client import normalize_dsn


def _seconds(positive: bool, forever: bool = False) -> Callable[[str], float]:
    """An argparse type: a number of seconds, > 0 or >= 0, finite unless ``forever`` allows inf
    (nan compares false with everything: an idle time of nan never ends ``--once``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if math.isnan(value) or (math.isinf(value) and not forever) or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"{text!r}: give a {'' if forever else 'finite '}number "
                                             f"of seconds {'above' if positive else 'of at least'} 0")
        return value

    parse.__name__ = "seconds"
    return parse


def _events(text: str) -> int:
    """An argparse type: events per batch, at least 1 (0 would read nothing and report success)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: at least 1 event per batch")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m telemetry.ingest", description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=None, help="ClickHouse DSN: chdb:///PATH or http(s)://host:port/db "
                        "(default $BCP_CLICKHOUSE_DSN, else an embedded store next to the spool)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--kafka", default=os.environ.get("BCP_TELEMETRY_KAFKA", ""),
                        help="bootstrap servers (default $BCP_TELEMETRY_KAFKA)")
    source.add_argument("--spool", default=None, help="tail this spool directory instead of Kafka")
    parser.add_argument("--topic", default=os.environ.get("BCP_TELEMETRY_TOPIC") or DEFAULT_TOPIC)
    parser.add_argument("--group", default=os.environ.get("BCP_INGEST_GROUP") or "bcp-ingest",
                        help="Kafka consumer group")
    parser.add_argument("--once", action="store_true",
                        help="exit once nothing new arrived for --idle-s seconds (for cron / tests)")
    parser.add_argument("--idle-s", type=_seconds(False), default=3.0)
    parser.add_argument("--batch-events", type=_events, default=5000, help="events per insert at most")
    parser.add_argument("--linger-s", type=_seconds(False), default=1.0, help="how long a batch may fill up")
    parser.add_argument("--retry-for", type=_seconds(False, forever=True), default=900.0, metavar="S",
                        help="give up (exit 1) when the store stays unreachable this long")
    parser.add_argument("--keep-spool", action="store_true",
                        help="with --spool: keep segments once stored (default: delete sealed ones)")
    parser.add_argument("--alerts", default=None, metavar="RULES.yaml",
                        help="also evaluate these alert rules on the store this process owns")
    parser.add_argument("--alerts-every", type=_seconds(True), default=60.0, metavar="S")
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in ("kafka", "kafka.conn", "kafka.coordinator"):
        logging.getLogger(name).setLevel(logging.ERROR)  # their reconnect chatter is not ours to report
    try:
        dsn = normalize_dsn(args.dsn or default_dsn())  # a bad DSN is reported now, not at first insert
    except StoreConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from telemetry.ingest.runner import Ingester

    try:
        if args.spool:
            from telemetry.ingest.spool_source import SpoolSource

            source = SpoolSource(args.spool, prune=not args.keep_spool)
        elif args.kafka:
            from telemetry.ingest.kafka_source import KafkaSource, ensure_topic

            ensure_topic(args.kafka, args.topic)
            source = KafkaSource(args.kafka, args.topic, args.group)
        else:
            print("error: say where events come from: --kafka HOST:PORT (or BCP_TELEMETRY_KAFKA) "
                  "or --spool DIR", file=sys.stderr)
            return 2
    except Exception as exc:  # noqa: BLE001 - reported with the fix, not as a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    on_idle = None
    if args.alerts:
        from telemetry.alerts.engine import Scheduler, load_rules

        try:
            on_idle = Scheduler(load_rules(args.alerts), every_s=args.alerts_every).maybe_run
        except (OSError, ValueError) as exc:  # a missing or wrong rules file: say which, no traceback
            print(f"error: --alerts {args.alerts}: {exc}", file=sys.stderr)
            return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ingester = Ingester(source, dsn, batch_events=args.batch_events, linger_s=args.linger_s,
                        retry_for_s=args.retry_for, on_idle=on_idle)
    code = 0
    try:
        ingester.run(once=args.once, idle_s=args.idle_s, stop=stop)
    except StoreConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except StoreUnavailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 1
    stats = ingester.stats
    print(f"ingested {stats.events} events in {stats.batches} batches; quarantined {stats.quarantined} "
          f"records ({stats.insert_failures} insert retries, {stats.commit_failures} commit failures)")
    if stats.quarantined:
        print(f"warning: {stats.quarantined} records could not be stored; they are kept with the reason "
              "in the ingest_quarantine table", file=sys.stderr)
        code = code or 3
    return code


if __name__ == "__main__":
    sys.exit(main())
