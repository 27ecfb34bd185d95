"""Rank-side functions for the telemetry pipeline tests (run through tests/support/dist.py pools).

Each one points this rank's telemetry at a Kafka broker for the duration of the call, then
puts the session's spool sink back, so other tests sharing the pool are unaffected.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

import bytecheckpoint as bcp
import telemetry
from bytecheckpoint.storage import register_backend
from bytecheckpoint.storage.local import LocalStorage
from telemetry import config
from telemetry.context import reset_context
from telemetry.sinks.kafka import KafkaSink
from tests.support import workloads as w


class SlowStorage(LocalStorage):
    """Local disk, but opening a file for writing on ``slow_rank`` first sleeps ``delay_s``."""

    scheme = "slowfs"

    def __init__(self, slow_rank: int, delay_s: float) -> None:
        super().__init__()
        self.slow_rank, self.delay_s = slow_rank, delay_s

    def open_writer(self, path: str):
        if dist.get_rank() == self.slow_rank:
            time.sleep(self.delay_s)
        return super().open_writer(path)


def _use_kafka(bootstrap: str, topic: str, spool_dir: str, job: str, run: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    # Short timeouts and backoff keep outage tests quick; production keeps the defaults.
    telemetry.configure(sink=KafkaSink(bootstrap, topic, f"{spool_dir}/rank{rank}", send_timeout_s=2.0,
                                       retry_backoff_s=(0.2, 1.0)))
    telemetry.set_context(job=job, run=run, rank=rank, world_size=world, dp=rank, tp=0, pp=0)


def _restore() -> None:
    telemetry.flush(timeout=10)
    config.reset()
    reset_context()


def _emitted() -> int:
    telemetry.flush(timeout=10)
    return telemetry.stats()["emitted"]


def kafka_save(root: str, bootstrap: str, topic: str, spool_dir: str, job: str, run: str,
               slow_rank: int | None = None, delay_s: float = 0.0, keep_sink: bool = False) -> dict[str, Any]:
    """Train one FSDP2 step and save through the Kafka sink; report what telemetry saw."""
    _use_kafka(bootstrap, topic, spool_dir, job, run)
    try:
        url = f"{root}/step_1"
        if slow_rank is not None:
            register_backend("slowfs", lambda: SlowStorage(slow_rank, delay_s), clobber=True)
            url = f"slowfs://{url}"
        model, optim = w.make_fsdp2(seed=0)
        w.train_step(model, optim, 0, dist.get_rank())
        before = _emitted()
        result = bcp.save(url, {"model": model, "optimizer": optim}, framework="fsdp2", step=1)
        events = _emitted() - before
        return {"url": url, "events": events, "bytes": result.bytes_written, "stats": telemetry.stats()}
    finally:
        if not keep_sink:
            _restore()


def kafka_load(root: str, bootstrap: str, topic: str, spool_dir: str, job: str, run: str) -> dict[str, Any]:
    _use_kafka(bootstrap, topic, spool_dir, job, run)
    try:
        model, optim = w.make_fsdp2(seed=123, lr=5e-4)
        before = _emitted()
        result = bcp.load(root, {"model": model, "optimizer": optim}, framework="fsdp2")
        return {"events": _emitted() - before, "bytes_read": result.bytes_read}
    finally:
        _restore()


def connect_kafka(bootstrap: str, topic: str, spool_dir: str, job: str, run: str) -> dict[str, int]:
    """Configure the sink and send one event, so the producer is live before an outage."""
    _use_kafka(bootstrap, topic, spool_dir, job, run)
    with telemetry.span("warmup"):
        pass
    telemetry.flush(timeout=10)
    return telemetry.stats()


def drain_spool(timeout_s: float = 60.0) -> dict[str, int]:
    """Wait until this rank's Kafka sink has re-sent everything it spooled; then restore."""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            telemetry.flush(timeout=10)
            stats = telemetry.stats()
            if stats.get("sink_pending_bytes", 0) == 0:
                return stats
            time.sleep(0.2)
        return telemetry.stats()
    finally:
        _restore()
