"""Fault injection: a wrapper that makes storage calls fail, slow down, or lose bytes.

Used by tests and drills. A spec is a ``;``-separated list of ``key=value`` settings:

    fail_call=K        fail the K-th matching call (counted per process)
    fail_every=K       fail every K-th matching call
    fail_fraction=P    fail each matching call with probability P (seeded: ``seed=``)
    permanent=1        injected failures are permanent (permission denied) instead of transient
    errno=ENOSPC       injected failures are that operating-system error, with no path, as a
                       full disk's write gives it (retried only if that errno is transient)
    latency_s=S        sleep S seconds before each matching call
    truncate_bytes=N   a matching writer silently drops the last N bytes of its file
    ops=write,read_into    which operations match (default: all but ``abort``, which only
                       follows another failure; names as in ``OPS``)
    path=TEXT          only calls whose path contains TEXT
    ranks=1,3          only in these ranks (the ``RANK`` environment variable)

It comes from ``install(spec)`` in the process, or from ``BCP_STORAGE_FAULTS`` in the
environment (so spawned ranks can be given faults), and ``open_storage`` applies it to every
backend, below retries and telemetry: an injected transient failure is retried exactly as a
real one would be, and injected latency shows in the I/O events.
"""

from __future__ import annotations

import errno as errno_module
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..errors import InvalidSettingError, PermanentStorageError, TransientStorageError
from .base import Storage, WrappedWriter, Writer
from .wrapper import StorageWrapper

T = TypeVar("T")
ENV = "BCP_STORAGE_FAULTS"
OPS = ("open_writer", "write", "commit", "abort", "read_into", "size", "list_dir", "is_dir", "makedirs",
       "rename", "exchange", "delete")


@dataclass(frozen=True)
class FaultSpec:
    fail_call: int = 0
    fail_every: int = 0
    fail_fraction: float = 0.0
    permanent: bool = False
    errno: int = 0
    latency_s: float = 0.0
    truncate_bytes: int = 0
    ops: frozenset[str] = frozenset(OPS) - {"abort"}
    path: str = ""
    ranks: frozenset[int] | None = None
    seed: int = 0

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        fields: dict[str, object] = {}
        for item in filter(None, (s.strip() for s in text.split(";"))):
            key, sep, value = item.partition("=")
            key, value = key.strip(), value.strip()
            try:
                if not sep:
                    raise ValueError("expected key=value")
                if key in ("fail_call", "fail_every", "truncate_bytes", "seed"):
                    fields[key] = int(value)
                elif key in ("fail_fraction", "latency_s"):
                    fields[key] = float(value)
                elif key == "permanent":
                    fields[key] = value.lower() in ("1", "true", "yes")
                elif key == "ops":
                    ops = frozenset(v.strip() for v in value.split(",") if v.strip())
                    if ops - set(OPS):
                        raise ValueError(f"unknown operations {sorted(ops - set(OPS))}; known: {OPS}")
                    fields[key] = ops
                elif key == "ranks":
                    fields[key] = frozenset(int(v) for v in value.split(",") if v.strip())
                elif key == "path":
                    fields[key] = value
                elif key == "errno":
                    code = getattr(errno_module, value.upper(), None) if not value.isdigit() else int(value)
                    if not isinstance(code, int) or code <= 0:
                        raise ValueError(f"unknown errno {value!r}; give a name such as ENOSPC")
                    fields[key] = code
                else:
                    raise ValueError(f"unknown setting {key!r}")
            except ValueError as exc:
                raise InvalidSettingError(f"bad fault spec item {item!r} in {text!r}: {exc}") from None
        return cls(**fields)  # type: ignore[arg-type]

    def applies_here(self) -> bool:
        return self.ranks is None or int(os.environ.get("RANK", "0")) in self.ranks


class _Injector:
    """Per-process state of one spec: the call counter and the random stream."""

    def __init__(self, spec: FaultSpec) -> None:
        self.spec = spec
        self._lock = threading.Lock()
        self._calls = 0
        self._rng = random.Random(spec.seed * 1_000_003 + int(os.environ.get("RANK", "0")))
        self.injected = 0

    def matches(self, op: str, path: str) -> bool:
        return op in self.spec.ops and self.spec.path in path

    def before(self, op: str, path: str) -> None:
        if not self.matches(op, path):
            return
        s = self.spec
        if s.latency_s:
            time.sleep(s.latency_s)
        with self._lock:
            self._calls += 1
            n = self._calls
            fail = (s.fail_call and n == s.fail_call) or (s.fail_every and n % s.fail_every == 0)
            fail = bool(fail) or (s.fail_fraction > 0 and self._rng.random() < s.fail_fraction)
            if fail:
                self.injected += 1
        if not fail:
            return
        if s.errno:
            raise OSError(s.errno, os.strerror(s.errno))  # no path: what a failed syscall gives
        if s.permanent:
            raise PermanentStorageError(f"injected fault: permission denied on {op} {path} (call {n})")
        raise TransientStorageError(f"injected fault: transient failure of {op} {path} (call {n})")


_LOCK = threading.Lock()
_INSTALLED: FaultSpec | None = None
_INJECTORS: dict[FaultSpec, _Injector] = {}


def install(spec: FaultSpec | str | None) -> None:
    """Inject ``spec`` into every storage opened from now on in this process (None: stop)."""
    global _INSTALLED
    with _LOCK:
        _INSTALLED = FaultSpec.parse(spec) if isinstance(spec, str) else spec
        _INJECTORS.clear()


def active() -> _Injector | None:
    """The injector in force for this process, if any (``install`` wins over the env)."""
    spec = _INSTALLED
    if spec is None:
        text = os.environ.get(ENV, "").strip()
        if not text:
            return None
        spec = FaultSpec.parse(text)
    if not spec.applies_here():
        return None
    with _LOCK:
        injector = _INJECTORS.get(spec)
        if injector is None:
            injector = _INJECTORS[spec] = _Injector(spec)
        return injector


class _FaultyWriter(WrappedWriter):
    def __init__(self, inner: Writer, injector: _Injector, path: str) -> None:
        self._inner, self._injector, self._path = inner, injector, path
        self._held = b""  # the tail a truncating fault keeps back

    def write(self, data: memoryview | bytes) -> None:
        self._injector.before("write", self._path)
        keep = self._injector.spec.truncate_bytes if self._injector.matches("write", self._path) else 0
        if keep:
            data = self._held + bytes(data)
            self._inner.write(data[: max(0, len(data) - keep)])
            self._held = data[max(0, len(data) - keep):]
        else:
            self._inner.write(data)

    def commit(self) -> int:
        self._injector.before("commit", self._path)
        size = self._inner.commit()
        # A silent truncation: report the size the caller thinks it wrote.
        return size + len(self._held)

    def abort(self) -> None:
        self._injector.before("abort", self._path)
        self._inner.abort()


class FaultyStorage(StorageWrapper):
    def __init__(self, inner: Storage, injector: _Injector) -> None:
        super().__init__(inner)
        self.injector = injector

    def _call(self, op: str, path: str, fn: Callable[[], T], nbytes: int | None = None) -> T:
        self.injector.before(op, self.inner.url(path))
        return fn()

    def open_writer(self, path: str) -> Writer:
        url = self.inner.url(path)
        self.injector.before("open_writer", url)
        return _FaultyWriter(self.inner.open_writer(path), self.injector, url)
