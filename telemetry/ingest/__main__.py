"""python -m telemetry.ingest: move telemetry events into ClickHouse (and evaluate alerts).

Examples:
  python -m telemetry.ingest --kafka 127.0.0.1:9092 --dsn chdb:///var/lib/bcp/store
  python -m telemetry.ingest --spool runs/demo/telemetry --once --alerts rules.yaml
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from telemetry.sinks.kafka import DEFAULT_TOPIC
from telemetry.store import StoreConfigError, default_dsn
from telemetry.store.client import normalize_dsn


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
    parser.add_argument("--idle-s", type=float, default=3.0)
    parser.add_argument("--batch-events", type=int, default=5000, help="events per insert at most")
    parser.add_argument("--linger-s", type=float, default=1.0, help="how long a batch may fill up")
    parser.add_argument("--alerts", default=None, metavar="RULES.yaml",
                        help="also evaluate these alert rules on the store this process owns")
    parser.add_argument("--alerts-every", type=float, default=60.0, metavar="S")
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

            source = SpoolSource(args.spool)
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

        on_idle = Scheduler(load_rules(args.alerts), every_s=args.alerts_every).maybe_run
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ingester = Ingester(source, dsn, batch_events=args.batch_events, linger_s=args.linger_s, on_idle=on_idle)
    try:
        stats = ingester.run(once=args.once, idle_s=args.idle_s, stop=stop)
    except StoreConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"ingested {stats.events} events in {stats.batches} batches "
          f"({stats.insert_failures} insert retries, {stats.commit_failures} commit failures)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
