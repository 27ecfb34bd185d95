"""Spans: timed, nested units of work that each become one flat telemetry event."""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import numbers
import os
import random
import time
from collections.abc import Callable
from contextvars import ContextVar, Token
from types import TracebackType
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, overload

from telemetry.config import settings
from telemetry.context import CONTEXT_KEYS, event_context
from telemetry.emitter import EMITTER
from telemetry.schema import SCOPE_SPANS

if TYPE_CHECKING:  # typing.Self needs Python 3.11 at runtime
    from typing import Self

# Span fields that get their own top-level column instead of living under "attrs".
PROMOTED_KEYS: tuple[str, ...] = ("bytes", "path", "backend", "op", "attempt", "phase")
MAX_ERROR_CHARS = 500

# Set from the enclosing scope span (see telemetry.schema), never copied into attrs.
SCOPE_KEYS: tuple[str, ...] = ("checkpoint", "checkpoint_op", "call_id")
_TOP_LEVEL = frozenset(PROMOTED_KEYS) | frozenset(CONTEXT_KEYS)
_SCOPE_NAMES = frozenset(SCOPE_SPANS)
_SCALARS = (str, int, bool, type(None))
_MAX_DEPTH = 8

# Version 4 / RFC 4122 variant bits, applied by hand: uuid.uuid4() costs ~2 us per call
# (a urandom syscall plus UUID object construction), a large share of a span's cost.
_UUID4_CLEAR = ~((0xF << 76) | (0x3 << 62))
_UUID4_SET = (0x4 << 76) | (0x2 << 62)
# A private generator seeded from os.urandom: training code routinely calls
# random.seed(), which must not make every rank produce the same event ids.
_rng = random.Random()
_getrandbits = _rng.getrandbits
if hasattr(os, "register_at_fork"):
    # Without a reseed a forked child would replay the parent's id sequence.
    os.register_at_fork(after_in_child=_rng.seed)
# Values of these types go into events as they are; everything else is sanitised.
_PLAIN_TYPES = frozenset({str, int, bool, type(None)})

_current: ContextVar[Span | None] = ContextVar("bcp_telemetry_span", default=None)
# Scope spans open in this process, newest last. A span with no parent in its own context
# (e.g. a read in a ThreadPoolExecutor worker) takes the newest open scope, so I/O done on
# behalf of a save or load is attributed to it without the caller copying contextvars.
_open_scopes: list[Span] = []


class _PendingStep:
    def __repr__(self) -> str:
        return "PENDING_STEP"


# ``step=PENDING_STEP`` on a scope span: the step is not known yet (a load learns it from the
# checkpoint's metadata, see ``scope_step``); until then the scope's events carry no step,
# not the step training last set, which is another checkpoint's.
PENDING_STEP: Any = _PendingStep()


class _Scope:
    """The save / load a span works for: shared by reference with the spans inside it, so a
    step named after they started (``scope_step``) reaches every event built from then on."""

    __slots__ = ("call_id", "checkpoint", "op", "pinned", "step")

    def __init__(self, checkpoint: str | None, op: str | None, step: Any, call_id: str | None) -> None:
        self.checkpoint = checkpoint
        self.op = op
        # Which save / load call: the dashboard and alerts group a rank's spans by it.
        self.call_id = call_id
        # A pinned step overrides the context's; an unpinned scope leaves the context's step.
        self.pinned = step is not None
        self.step = None if step is PENDING_STEP else step


P = ParamSpec("P")
R = TypeVar("R")


def _unprintable(value: Any) -> str:
    return f"<unprintable {getattr(type(value), '__name__', 'object')}>"


def _safe_str(value: Any) -> str:
    """``str(value)``, or a placeholder when that raises (a broken ``__str__``, RecursionError
    from a very deeply nested container)."""
    try:
        text = str(value)
    except Exception:  # noqa: BLE001 - any object may come in as a span field
        return _unprintable(value)
    return text


def _jsonable(value: Any, depth: int = 0) -> Any:
    """Coerce ``value`` into something json.dumps accepts without surprises; never raises.

    Containers are followed ``_MAX_DEPTH`` levels down; below that a value becomes its
    ``str()``. Whatever cannot be converted becomes ``"<unprintable TYPE>"``."""
    try:
        if isinstance(value, _SCALARS):
            return value
        if isinstance(value, float):
            # NaN/Infinity are not valid JSON and would break strict readers downstream.
            return value if math.isfinite(value) else str(value)
        if depth >= _MAX_DEPTH:
            return _safe_str(value)
        if isinstance(value, (list, tuple)):
            return [_jsonable(item, depth + 1) for item in value]
        if isinstance(value, dict):
            return {key if isinstance(key, str) else _safe_str(key): _jsonable(item, depth + 1)
                    for key, item in value.items()}
        if isinstance(value, numbers.Integral):  # numpy / torch integer scalars
            return int(value)
        if isinstance(value, numbers.Real):
            return _jsonable(float(value), depth)
        return _safe_str(value)
    except Exception:  # noqa: BLE001 - e.g. a container that fails while iterated
        return _unprintable(value)


def _new_event_id() -> str:
    """Same value space and format as ``uuid.uuid4().hex``."""
    return f"{_getrandbits(128) & _UUID4_CLEAR | _UUID4_SET:032x}"


def _format_error(exc_type: type[BaseException], exc: BaseException | None) -> str:
    try:
        message = str(exc) if exc is not None else ""
    except Exception:  # noqa: BLE001 - a broken __str__ must not mask the real error
        message = "<unprintable exception>"
    return f"{exc_type.__name__}: {message}"[:MAX_ERROR_CHARS]


class Span:
    """One unit of work; use via ``with span(...) as s`` and ``s.set(...)``.

    A Span is single-use: enter it once.
    """

    __slots__ = (
        "_active",
        "_opens_scope",
        "_parent",
        "_scope",
        "_t0",
        "_token",
        "duration_s",
        "error",
        "event_id",
        "fields",
        "name",
        "outcome",
        "parent_id",
        "ts",
    )

    def __init__(self, name: str, fields: dict[str, Any]) -> None:
        self.name = name
        self.fields = fields
        self.event_id: str | None = None
        self.parent_id: str | None = None
        self.ts: float | None = None
        self.duration_s: float | None = None
        self.outcome: str | None = None
        self.error: str | None = None
        self._parent: Span | None = None
        # The save / load this span works for.
        self._scope: _Scope | None = None
        self._opens_scope = False
        self._token: Token[Span | None] | None = None
        self._t0 = 0.0
        self._active = False

    @property
    def call_id(self) -> str | None:
        """The id of the save / load call this span works for (None outside one, or before
        the span is entered); pass it as ``call_id=`` to a span that continues the call."""
        scope = self._scope
        return scope.call_id if scope is not None else None

    def set(self, **fields: Any) -> Span:
        """Add or replace fields, e.g. byte counts only known at the end of the work."""
        self.fields.update(fields)
        return self

    def __enter__(self) -> Self:
        if not settings.enabled:
            return self
        self._active = True
        parent = _current.get()
        self._parent = parent
        self.parent_id = parent.event_id if parent is not None else None
        self.event_id = _new_event_id()
        self._enter_scope(parent)
        self._token = _current.set(self)
        self.ts = time.time()
        self._t0 = time.perf_counter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if not self._active:
            return False
        self.duration_s = time.perf_counter() - self._t0
        self._active = False
        self._restore_parent()
        if self._opens_scope:
            with contextlib.suppress(ValueError):  # list.remove on a scope already gone
                _open_scopes.remove(self)
        if exc_type is None:
            self.outcome = "ok"
        else:
            self.outcome = "error"
            self.error = _format_error(exc_type, exc)
        # Telemetry must never change the behaviour of the code it observes, and an event
        # that cannot be built is counted as dropped, never lost silently.
        try:
            event = self.to_event()
        except Exception as build_error:  # noqa: BLE001 - e.g. RecursionError deep in the caller's stack
            with contextlib.suppress(Exception):
                EMITTER.count_unbuilt(self.name, build_error)
            return False
        with contextlib.suppress(Exception):
            EMITTER.emit(event)
        # Never swallow the exception: the caller sees exactly what the body raised.
        return False

    def _enter_scope(self, parent: Span | None) -> None:
        fields = self.fields
        # An explicit checkpoint_op= opens a scope too: an async save's background work runs
        # after its "save" span has ended, on threads that cannot see that span.
        self._opens_scope = self.name in _SCOPE_NAMES or "checkpoint_op" in fields
        if self._opens_scope:
            # A fresh call, unless the span continues one (an async save's background work
            # passes its save's ``call_id=``).
            self._scope = _Scope(_as_str(fields.get("checkpoint", fields.get("path"))),
                                 _as_str(fields.get("checkpoint_op", self.name)), fields.get("step"),
                                 _as_str(fields.get("call_id")) or _new_event_id())
            # list.append is atomic under the GIL; readers only look at the last item.
            _open_scopes.append(self)
            return
        if parent is not None:
            inherited = parent._scope
        else:
            try:
                inherited = _open_scopes[-1]._scope
            except IndexError:
                inherited = None
        if "checkpoint" in fields:
            inherited = _Scope(_as_str(fields["checkpoint"]), inherited.op if inherited else None, None,
                               inherited.call_id if inherited else None)
        self._scope = inherited

    def _restore_parent(self) -> None:
        token, self._token = self._token, None
        if token is None:
            return
        try:
            _current.reset(token)
        except ValueError:
            # Exited in a different context (e.g. another asyncio task) than entered.
            if _current.get() is self:
                _current.set(self._parent)

    def to_event(self) -> dict[str, Any]:
        """Build the flat event dict (see the package docs for the schema)."""
        columns, extras = event_context()
        event: dict[str, Any] = {
            "event_id": self.event_id,
            "name": self.name,
            "ts": self.ts,
            "duration_s": self.duration_s,
            "outcome": self.outcome,
            "error": self.error,
            "parent_id": self.parent_id,
        }
        event.update(columns)
        scope = self._scope
        if scope is None:
            event["checkpoint"] = event["checkpoint_op"] = event["call_id"] = None
        else:
            event["checkpoint"], event["checkpoint_op"] = scope.checkpoint, scope.op
            event["call_id"] = scope.call_id
            if scope.pinned:  # the checkpoint's step, not the one training has moved on to
                step = scope.step
                event["step"] = step if type(step) in _PLAIN_TYPES else _jsonable(step)
        # Extra set_context() fields travel with the event but outside the fixed columns.
        attrs: dict[str, Any] = dict(extras) if extras else {}
        for key, value in self.fields.items():
            if value is PENDING_STEP or (key == "step" and self._opens_scope):
                continue  # the scope's step, applied above (step=None: training's step)
            if type(value) not in _PLAIN_TYPES:
                value = _jsonable(value)
            if key in _TOP_LEVEL:
                event[key] = value
            elif key in SCOPE_KEYS:
                continue
            else:
                attrs[key] = value
        event["attrs"] = attrs
        return event


def _as_str(value: Any) -> str | None:
    # Called on entering a span: a broken __str__ must not reach the caller.
    return None if value is None else _safe_str(value)


def scope_step(step: int | None) -> None:
    """Name the step of the checkpoint that the current span's save or load works on: every
    event of that scope built from now on (the scope span's own included) carries it."""
    current = _current.get()
    # Only this thread's own span: the newest open scope may be another thread's save.
    scope = current._scope if current is not None else None
    if scope is not None:
        scope.step, scope.pinned = step, True


def span(name: str, /, **fields: Any) -> Span:
    """Context manager timing a block: ``with span("save", bytes=n) as s: ...``."""
    return Span(name, fields)


@overload
def timed(name: Callable[P, R], /) -> Callable[P, R]: ...


@overload
def timed(
    name: str | None = None, /, **fields: Any
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...


def timed(name: Any = None, /, **fields: Any) -> Any:
    """Decorator wrapping each call in ``span(name, **fields)``.

    ``name`` defaults to the function's qualified name; bare ``@timed`` also works.
    Coroutine functions are timed until the awaited result is ready.
    """

    def decorate(func: Callable[P, R]) -> Callable[P, R]:
        span_name = name if isinstance(name, str) else func.__qualname__

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
                with Span(span_name, dict(fields)):
                    return await func(*args, **kwargs)

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            # A fresh dict per call so Span.set() in one call cannot leak into the next.
            with Span(span_name, dict(fields)):
                return func(*args, **kwargs)

        return wrapper

    if callable(name):
        return decorate(name)
    return decorate
