"""Per-span cost of the telemetry API (enter + exit + enqueue).

Usage: python bench/telemetry_overhead.py [--spans 200000] [--repeats 5]

Prints the median over repeats, in microseconds per span, of:

* empty loop          - the loop itself, for reference;
* on, writer paused   - what the calling thread pays (build the event, put_nowait),
                        with the sink held so the writer thread never competes;
* on, spool sink      - the timed loop while the writer thread serialises and writes
                        concurrently (it shares the GIL, so part of its work lands here);
* on, end to end      - the previous figure plus the time to drain what was still queued
                        when the loop ended: the full CPU cost per event;
* off                 - telemetry disabled: the span still runs the body.

Queues are sized to hold a whole run, so no event is dropped and the figures measure
enqueueing, not dropping.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _us_per_span(body: Callable[[int], None], n: int) -> float:
    start = time.perf_counter()
    body(n)
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n = args.spans

    # Allow running from a checkout without installing the package.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import telemetry
    from telemetry.sinks import Sink, read_spool

    class GatedSink(Sink):
        """Holds the writer inside emit() until released, so it never takes the GIL."""

        def __init__(self) -> None:
            self.gate = threading.Event()

        def emit(self, batch: list[dict[str, Any]]) -> None:
            self.gate.wait()

    span = telemetry.span

    def empty(count: int) -> None:
        for _i in range(count):
            pass

    def spans(count: int) -> None:
        for i in range(count):
            with span("bench.span", bytes=i, op="write"):
                pass

    results: dict[str, list[float]] = {
        "empty loop": [],
        "on, writer paused": [],
        "on, spool sink": [],
        "on, end to end": [],
        "off": [],
    }
    with tempfile.TemporaryDirectory() as spool:
        telemetry.configure(enabled=True, queue_size=n + 1024)
        start_stats = telemetry.stats()
        spool_events = 0
        for _ in range(args.repeats):
            results["empty loop"].append(_us_per_span(empty, n))

            gated = GatedSink()
            telemetry.configure(sink=gated, enabled=True)
            spans(1)  # the writer picks this up and parks inside emit()
            time.sleep(0.2)
            results["on, writer paused"].append(_us_per_span(spans, n))
            gated.gate.set()
            telemetry.flush(timeout=120.0)

            telemetry.configure(spool_dir=spool)
            spans(1000)  # warm-up: opens the spool file
            telemetry.flush(timeout=60.0)
            start = time.perf_counter()
            spans(n)
            timed = time.perf_counter() - start
            telemetry.flush(timeout=120.0)
            drained = time.perf_counter() - start
            spool_events += n + 1000
            results["on, spool sink"].append(timed / n * 1e6)
            results["on, end to end"].append(drained / n * 1e6)

            telemetry.configure(enabled=False)
            results["off"].append(_us_per_span(spans, n))

        end_stats = telemetry.stats()
        on_disk = len(read_spool(spool))
        telemetry.configure(enabled=True)

    print(f"python {sys.version.split()[0]}, {n} spans x {args.repeats} repeats (median)")
    for label, values in results.items():
        print(f"  {label:<20s} {statistics.median(values):8.3f} us/span")
    delta = {k: end_stats[k] - start_stats[k] for k in ("emitted", "written", "dropped")}
    print(f"  events {delta}, sink_errors={end_stats['sink_errors']}")
    print(f"  spool lines on disk {on_disk} (expected {spool_events})")


if __name__ == "__main__":
    main()
