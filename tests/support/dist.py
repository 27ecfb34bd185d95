"""A pool of worker processes forming one gloo process group, reused across tests.

Importing torch and joining a process group cost seconds per process, so each world size
is started once per test session and then runs many checks: ``pool.run(fn, *args)`` calls
the module-level function ``fn`` on every rank and returns the per-rank results.
"""

from __future__ import annotations

import faulthandler
import importlib
import multiprocessing as mp
import os
import pickle
import queue
import socket
import tempfile
import traceback
from datetime import timedelta
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stack_file(port: int, rank: int) -> str:
    """Where a rank writes every thread's stack when a task outlasts its dump time, so a hang
    that the pool's timeout ends is reported with where each rank was stuck."""
    return os.path.join(tempfile.gettempdir(), f"bcp-test-pool-{port}-rank{rank}.stacks")


def _worker(rank: int, world: int, port: int, tasks: Any, results: Any, dump_after_s: float) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=90))
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:  # the test session died: do not linger
                break
            continue
        if task is None:
            break
        module, name, args, kwargs = pickle.loads(task)
        with open(_stack_file(port, rank), "w") as stacks:
            faulthandler.dump_traceback_later(dump_after_s, file=stacks)
            try:
                fn = getattr(importlib.import_module(module), name)
                payload = (True, fn(*args, **kwargs))
            except BaseException:  # report everything, including assertion failures
                payload = (False, traceback.format_exc())
            finally:
                faulthandler.cancel_dump_traceback_later()
        try:
            results.put((rank, pickle.dumps(payload)))
        except Exception:
            results.put((rank, pickle.dumps((False, traceback.format_exc()))))
    dist.destroy_process_group()


class WorldPool:
    def __init__(self, world_size: int, timeout: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.timeout = timeout
        port = self._port = free_port()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            # not daemonic: ranks start their own processes (data loader readers)
            ctx.Process(target=_worker, args=(r, world_size, port, self._tasks[r], self._results,
                                              max(1.0, timeout - 30)))
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.broken: str | None = None

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> list[Any]:
        if self.broken:
            raise RuntimeError(f"worker pool is unusable: {self.broken}")
        task = pickle.dumps((fn.__module__, fn.__name__, args, kwargs))
        for q in self._tasks:
            q.put(task)
        out: dict[int, Any] = {}
        failures: dict[int, str] = {}
        while len(out) + len(failures) < self.world_size:
            try:
                rank, raw = self._results.get(timeout=self.timeout)
            except queue.Empty:
                self.broken = f"{fn.__name__} timed out after {self.timeout}s"
                silent = sorted(set(range(self.world_size)) - set(out) - set(failures))
                report = [f"{self.broken}; no answer from ranks {silent}"]
                report += [f"--- rank {r} failed ---\n{tb}" for r, tb in sorted(failures.items())]
                for r in silent:
                    try:
                        with open(_stack_file(self._port, r)) as f:
                            report.append(f"--- rank {r} stacks ---\n{f.read()}")
                    except OSError:
                        pass
                self.close()
                raise TimeoutError("\n".join(report)) from None
            ok, value = pickle.loads(raw)
            (out if ok else failures)[rank] = value
        if failures:
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            raise AssertionError(f"{fn.__name__} failed on ranks {sorted(failures)}:\n{detail}")
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        for r in range(self.world_size):
            try:
                os.unlink(_stack_file(self._port, r))
            except OSError:
                pass
