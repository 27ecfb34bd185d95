"""Run fuzz cases in a worker subprocess, so a crash (SIGSEGV) or a hang becomes a finding.

One worker serves many cases (starting Python and torch per case would cost a second each);
when it dies or stalls, the case it was on is reported, the worker is restarted, and the
run goes on after that case.
"""

from __future__ import annotations

import mmap
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

from tests.fuzz.outcomes import CRASH, HANG, Result, Tally
from tests.fuzz.worker import read_frame, write_frame

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class WorkerDied(Exception):
    pass


class WorkerStalled(Exception):
    pass


class Guard:
    """A restartable worker. ``timeout`` bounds one case (or one case of a batch)."""

    def __init__(self, workdir: str | None = None, timeout: float = 20.0) -> None:
        self.workdir = workdir or tempfile.mkdtemp(prefix="bcp-fuzz-", dir=_scratch())
        self.timeout = timeout
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._progress_path = os.path.join(self.workdir, "progress")
        with open(self._progress_path, "wb") as f:
            f.write(b"\0" * 8)
        with open(self._progress_path, "r+b") as f:
            self._progress = mmap.mmap(f.fileno(), 8)
        self._log_path = os.path.join(self.workdir, "worker.log")

    # -- process ------------------------------------------------------------------------------
    def _start(self) -> None:
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "PYTHONFAULTHANDLER": "1"}
        self._log = open(self._log_path, "ab")  # noqa: SIM115 - lives as long as the worker
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fuzz.worker", os.path.join(self.workdir, "w"), self._progress_path],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, cwd=ROOT, env=env)
        if self._wait_frame(120.0, watch_progress=False) != ["ready"]:
            raise RuntimeError(f"fuzz worker did not start; see {self._log_path}")

    def _ensure(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        assert self._proc is not None
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        if self._proc is not None:
            self._proc.wait()
            self._log.close()
        self._proc = None
        self.restarts += 1

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._log.close()
        self._proc = None

    @property
    def index(self) -> int:
        return struct.unpack("<q", self._progress[:8])[0]

    def _log_tail(self) -> str:
        try:
            with open(self._log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self._log_path) - 3000))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _wait_frame(self, timeout: float, watch_progress: bool = True) -> Any:
        """The next answer; WorkerDied / WorkerStalled when there is none."""
        proc = self._proc
        assert proc is not None
        fd = proc.stdout.fileno()
        last, deadline = self.index, time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                frame = read_frame(proc.stdout)
                if frame is None:
                    proc.wait()
                    raise WorkerDied(self._death())
                return frame
            if proc.poll() is not None:
                raise WorkerDied(self._death())
            if watch_progress and self.index != last:
                last, deadline = self.index, time.monotonic() + timeout
            if time.monotonic() > deadline:
                raise WorkerStalled(f"no answer within {timeout:.0f}s")

    def _death(self) -> str:
        code = self._proc.returncode if self._proc else None
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        return f"worker died ({how}); stderr tail:\n{self._log_tail()}"

    # -- cases --------------------------------------------------------------------------------
    def case(self, case: list) -> Result:
        proc = self._ensure()
        write_frame(proc.stdin, ["case", case])
        try:
            kind, detail = self._wait_frame(self.timeout, watch_progress=False)
        except WorkerDied as exc:
            self._kill()
            return Result(CRASH, str(exc))
        except WorkerStalled as exc:
            self._kill()
            return Result(HANG, str(exc))
        return Result(kind, detail)

    def batch(self, target: str, seed: int, start: int, count: int, tally: Tally) -> None:
        """Cases ``start .. start+count-1`` of ``target`` drawn in the worker; a crash or hang is
        recorded against the case the worker was on and the batch resumes after it."""
        pending = [(start, start + count)]
        while pending:
            lo, hi = pending.pop(0)
            if lo >= hi:
                continue
            proc = self._ensure()
            self._progress[:8] = struct.pack("<q", lo)
            write_frame(proc.stdin, ["batch", target, seed, lo, hi - lo])
            try:
                counts, findings = self._wait_frame(self.timeout)
                tally.merge(counts, findings)
            except (WorkerDied, WorkerStalled) as exc:
                at = self.index
                self._kill()
                kind = CRASH if isinstance(exc, WorkerDied) else HANG
                tally.add(target, Result(kind, str(exc)), {"seed": seed, "index": at})
                # The cases before ``at`` finished but their counts died with the worker: cases
                # are deterministic, so they run again; the run goes on after the bad one.
                pending[:0] = [(lo, at), (at + 1, hi)]


def _scratch() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
