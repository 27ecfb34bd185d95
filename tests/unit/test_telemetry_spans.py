"""Behavioural tests for the telemetry span API, emitter and spool sink."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import telemetry
from telemetry.sinks import Sink, read_spool

EVENT_KEYS = {
    "event_id",
    "name",
    "ts",
    "duration_s",
    "outcome",
    "error",
    "parent_id",
    "checkpoint",
    "checkpoint_op",
    "call_id",
    "job",
    "run",
    "step",
    "rank",
    "world_size",
    "dp",
    "tp",
    "pp",
    "host",
    "pid",
    "attrs",
}




def _events(spool_dir: Path) -> list[dict[str, Any]]:
    assert telemetry.flush(timeout=5.0)
    return read_spool(spool_dir)


def _delta(before: dict[str, int], key: str) -> int:
    return telemetry.stats()[key] - before[key]


class RecordingSink(Sink):
    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.events: list[dict[str, Any]] = []

    def emit(self, batch: list[dict[str, Any]]) -> None:
        if self.gate is not None:
            self.gate.wait(10.0)
        self.events.extend(batch)


class RaisingSink(Sink):
    def __init__(self) -> None:
        self.calls = 0

    def emit(self, batch: list[dict[str, Any]]) -> None:
        self.calls += 1
        raise RuntimeError("sink is down")


def test_span_writes_event_with_fields_and_context(spool: Path) -> None:
    telemetry.set_context(job="job-a", run="run-1", step=7, rank=3, world_size=8, dp=2, tp=1)
    before = time.time()
    with telemetry.span(
        "ckpt.save",
        bytes=123,
        path=Path("/tmp/x"),
        backend="local",
        custom=42,
        opaque=object(),
        ratio=float("nan"),
    ) as s:
        time.sleep(0.05)
        s.set(attempt=2, shards=[1, 2])
    after = time.time()

    events = _events(spool)
    assert len(events) == 1
    ev = events[0]
    assert set(ev) == EVENT_KEYS | {"bytes", "path", "backend", "attempt"}
    assert ev["name"] == "ckpt.save"
    assert ev["duration_s"] >= 0.05
    assert before <= ev["ts"] <= after
    assert ev["outcome"] == "ok"
    assert ev["error"] is None
    assert ev["parent_id"] is None
    assert len(ev["event_id"]) == 32
    int(ev["event_id"], 16)
    assert (ev["job"], ev["run"], ev["step"], ev["rank"], ev["world_size"]) == (
        "job-a",
        "run-1",
        7,
        3,
        8,
    )
    assert (ev["dp"], ev["tp"], ev["pp"]) == (2, 1, None)
    assert ev["pid"] == os.getpid()
    assert isinstance(ev["host"], str)
    assert ev["host"]
    assert (ev["bytes"], ev["path"], ev["backend"], ev["attempt"]) == (123, "/tmp/x", "local", 2)
    assert ev["attrs"]["custom"] == 42
    assert ev["attrs"]["shards"] == [1, 2]
    assert ev["attrs"]["opaque"].startswith("<object object")
    assert ev["attrs"]["ratio"] == "nan"


def test_spool_file_is_named_per_process_and_one_event_per_line(spool: Path) -> None:
    for i in range(3):
        with telemetry.span("line", i=i):
            pass
    _events(spool)
    files = sorted(spool.glob("*.jsonl"))
    assert len(files) == 1
    assert files[0].name.startswith("events-")
    assert files[0].name.endswith(f"-{os.getpid()}-00000.jsonl")
    lines = files[0].read_text().splitlines()
    assert [json.loads(line)["attrs"]["i"] for line in lines] == [0, 1, 2]


def test_nested_spans_record_parent_id(spool: Path) -> None:
    with telemetry.span("outer") as outer:
        with telemetry.span("inner") as inner:
            inner.set(depth=2)
            with telemetry.span("leaf"):
                pass
        with telemetry.span("sibling"):
            pass
    with telemetry.span("after"):
        pass

    by_name = {ev["name"]: ev for ev in _events(spool)}
    assert by_name["outer"]["event_id"] == outer.event_id
    assert by_name["outer"]["parent_id"] is None
    assert by_name["inner"]["parent_id"] == outer.event_id
    assert by_name["leaf"]["parent_id"] == inner.event_id
    assert by_name["sibling"]["parent_id"] == outer.event_id
    assert by_name["after"]["parent_id"] is None


def test_every_span_of_a_call_carries_its_call_id_and_the_next_call_another(spool: Path) -> None:
    """Children, worker threads and work that continues the call later (an async save's
    background: ``checkpoint_op=`` with the call's ``call_id=``) carry the call's id."""
    def worker() -> None:
        with telemetry.span("storage.write"):  # no parent in this thread: the open call's
            pass

    with telemetry.span("save", path="/c/1", step=3) as call:
        with telemetry.span("save.plan"):
            with telemetry.span("storage.read", checkpoint="/c/other"):
                pass
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    with telemetry.span("save.background", path="/c/1", step=3, checkpoint_op="save",
                        call_id=call.call_id):
        with telemetry.span("save.commit"):
            pass
    with telemetry.span("load", path="/c/1") as other:
        pass
    with telemetry.span("train.step"):
        pass

    events = _events(spool)
    ids = {ev["name"]: ev["call_id"] for ev in events}
    assert call.call_id and len(call.call_id) == 32 and other.call_id not in (None, call.call_id)
    first = ("save", "save.plan", "storage.read", "storage.write", "save.background", "save.commit")
    assert {name: ids[name] for name in first} == dict.fromkeys(first, call.call_id)
    assert (ids["load"], ids["train.step"]) == (other.call_id, None)
    assert all("call_id" not in ev["attrs"] for ev in events)


def test_context_override_is_scoped(spool: Path) -> None:
    telemetry.set_context(step=1, model="m1")
    with telemetry.context(step=2, phase_hint="warmup") as ctx:
        assert ctx["step"] == 2
        assert telemetry.get_context()["step"] == 2
        with telemetry.span("inside"):
            pass
    assert telemetry.get_context()["step"] == 1
    with telemetry.span("outside", step=5):
        pass

    by_name = {ev["name"]: ev for ev in _events(spool)}
    assert by_name["inside"]["step"] == 2
    assert by_name["inside"]["attrs"] == {"model": "m1", "phase_hint": "warmup"}
    # A context key passed to span() lands in its top-level column.
    assert by_name["outside"]["step"] == 5
    with pytest.raises(TypeError):
        telemetry.set_context(step=1.5)


def test_context_override_does_not_leak_across_threads(spool: Path) -> None:
    seen: list[Any] = []
    with telemetry.context(step=99):
        worker = threading.Thread(target=lambda: seen.append(telemetry.get_context()["step"]))
        worker.start()
        worker.join()
    assert seen == [None]


def test_timed_decorator_on_functions_and_methods(spool: Path) -> None:
    @telemetry.timed("io.read", backend="local")
    def read(n: int) -> int:
        """Read n things."""
        return n * 2

    class Writer:
        @telemetry.timed()
        def write(self, data: bytes) -> int:
            return len(data)

        @telemetry.timed
        def fail(self) -> None:
            raise OSError("disk gone")

    assert read(21) == 42
    assert read.__name__ == "read"
    assert read.__doc__ == "Read n things."
    assert read.__wrapped__(1) == 2  # type: ignore[attr-defined]
    assert Writer().write(b"abc") == 3
    with pytest.raises(OSError, match="disk gone"):
        Writer().fail()

    events = _events(spool)
    names = [ev["name"] for ev in events]
    assert names.count("io.read") == 1
    read_ev = next(ev for ev in events if ev["name"] == "io.read")
    assert read_ev["backend"] == "local"
    write_ev = next(ev for ev in events if ev["name"].endswith("Writer.write"))
    assert write_ev["outcome"] == "ok"
    fail_ev = next(ev for ev in events if ev["name"].endswith("Writer.fail"))
    assert fail_ev["outcome"] == "error"
    assert fail_ev["error"] == "OSError: disk gone"


def test_timed_coroutine_and_task_local_parents(spool: Path) -> None:
    @telemetry.timed("async.step")
    async def step(i: int) -> int:
        await asyncio.sleep(0.01)
        with telemetry.span("async.inner", i=i):
            await asyncio.sleep(0)
        return i

    async def main() -> list[int]:
        return list(await asyncio.gather(step(1), step(2)))

    with telemetry.span("driver") as driver:
        assert asyncio.run(main()) == [1, 2]

    events = _events(spool)
    steps = {ev["event_id"]: ev for ev in events if ev["name"] == "async.step"}
    inners = [ev for ev in events if ev["name"] == "async.inner"]
    assert len(steps) == 2
    assert all(ev["duration_s"] >= 0.01 for ev in steps.values())
    # Each task copies the context at creation, so both steps hang off the driver span
    # and each inner span hangs off its own step, never off the sibling task's.
    assert {ev["parent_id"] for ev in steps.values()} == {driver.event_id}
    assert {ev["parent_id"] for ev in inners} == set(steps)
    for inner in inners:
        assert steps[inner["parent_id"]]["ts"] <= inner["ts"]


def test_exception_is_reraised_unchanged_and_recorded(spool: Path) -> None:
    err = ValueError("boom")
    with pytest.raises(ValueError) as caught, telemetry.span("explode"):
        raise err
    assert caught.value is err

    with pytest.raises(KeyError), telemetry.span("long"):
        raise KeyError("x" * 2000)

    by_name = {ev["name"]: ev for ev in _events(spool)}
    assert by_name["explode"]["outcome"] == "error"
    assert by_name["explode"]["error"] == "ValueError: boom"
    assert by_name["long"]["error"].startswith("KeyError: ")
    assert len(by_name["long"]["error"]) == 500


def test_raising_sink_never_reaches_caller_and_is_counted(spool: Path) -> None:
    sink = RaisingSink()
    telemetry.configure(sink=sink)
    before = telemetry.stats()
    for i in range(50):
        with telemetry.span("doomed", i=i):
            pass
    assert telemetry.flush(timeout=5.0)
    assert sink.calls >= 1
    assert _delta(before, "sink_errors") == sink.calls
    assert _delta(before, "written") == 0
    assert _delta(before, "emitted") == 50


def test_blocking_sink_never_blocks_callers_and_full_queue_drops(spool: Path) -> None:
    gate = threading.Event()
    sink = RecordingSink(gate)
    telemetry.configure(sink=sink, queue_size=100)
    before = telemetry.stats()
    try:
        start = time.perf_counter()
        for i in range(1000):
            with telemetry.span("fast", i=i):
                pass
        elapsed = time.perf_counter() - start
        # 1000 spans against a stuck sink must cost microseconds each, not a hang.
        assert elapsed < 0.5
        emitted = _delta(before, "emitted")
        dropped = _delta(before, "dropped")
        assert emitted + dropped == 1000
        assert dropped > 0
        assert telemetry.stats()["queue_size"] <= 100
        assert telemetry.flush(timeout=0.1) is False
    finally:
        gate.set()
    assert telemetry.flush(timeout=5.0)
    assert len(sink.events) == emitted
    assert _delta(before, "written") == emitted


def test_rotation_creates_multiple_files_without_losing_events(spool: Path) -> None:
    telemetry.configure(spool_dir=spool, spool_max_bytes=4096)
    for i in range(400):
        with telemetry.span("rotating", i=i):
            pass
        if i % 50 == 0:
            # Several small batches so rotation happens between writes, not only once.
            assert telemetry.flush()
    events = _events(spool)
    files = sorted(spool.glob("*.jsonl"))
    assert len(files) >= 2
    assert sorted(ev["attrs"]["i"] for ev in events) == list(range(400))
    assert len({ev["event_id"] for ev in events}) == 400


def test_read_spool_skips_torn_last_line(tmp_path: Path) -> None:
    good = [{"name": "a"}, {"name": "b"}]
    path = tmp_path / "events-h-1-00000.jsonl"
    body = "".join(json.dumps(ev) + "\n" for ev in good)
    path.write_text(body + '{"name": "c", "tor')
    assert read_spool(tmp_path) == good
    assert read_spool(tmp_path / "missing") == []


def test_disabled_mode_runs_body_and_emits_nothing(spool: Path) -> None:
    telemetry.configure(enabled=False)
    before = telemetry.stats()
    ran: list[str] = []

    with telemetry.span("quiet", bytes=1) as s:
        ran.append("body")
        s.set(bytes=2)
    with pytest.raises(RuntimeError, match="still raised"), telemetry.span("quiet-error"):
        ran.append("error-body")
        raise RuntimeError("still raised")

    @telemetry.timed("quiet-fn")
    def fn() -> str:
        ran.append("fn")
        return "value"

    assert fn() == "value"
    assert ran == ["body", "error-body", "fn"]
    assert telemetry.flush()
    assert _delta(before, "emitted") == 0
    assert read_spool(spool) == []


def test_stats_has_expected_keys(spool: Path) -> None:
    with telemetry.span("counted"):
        pass
    assert set(telemetry.stats()) == {"emitted", "written", "dropped", "sink_errors", "queue_size",
                                      "sink_appended", "sink_dropped"}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_writes_its_own_spool_file(spool: Path) -> None:
    with telemetry.span("parent-span"):
        pass
    assert telemetry.flush()

    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child process
        code = 1
        try:
            with telemetry.span("child-span"):
                pass
            code = 0 if telemetry.flush(timeout=5.0) else 2
        finally:
            os._exit(code)

    _, status = os.waitpid(child, 0)
    assert os.WIFEXITED(status)
    assert os.WEXITSTATUS(status) == 0

    child_files = list(spool.glob(f"events-*-{child}-*.jsonl"))
    assert len(child_files) == 1
    child_events = read_spool(spool)
    child_only = [ev for ev in child_events if ev["pid"] == child]
    assert [ev["name"] for ev in child_only] == ["child-span"]
    # The parent's already-written event must not be replayed by the child.
    assert [ev["name"] for ev in child_events].count("parent-span") == 1
