"""Retries with exponential backoff and full jitter, bounded in attempts and in time.

Only transient failures are retried: a missing file, a refused permission or a missing
bucket is an answer, and retrying it would only delay the error the caller must see.
The loop is tenacity's (as in the ingester and the Kafka sink); this module says what is
transient and turns :class:`RetrySettings` into tenacity's stop and wait strategies.
"""

from __future__ import annotations

import errno
import random
import time
from collections.abc import Callable
from typing import TypeVar

import tenacity

from ..errors import PermanentStorageError, TransientStorageError
from .config import RetrySettings

T = TypeVar("T")

_TRANSIENT_ERRNOS = frozenset({
    errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED,
    errno.ECONNREFUSED, errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EBUSY,
})
# Answers, not failures: retrying cannot change them.
_PERMANENT = (
    PermanentStorageError, FileNotFoundError, FileExistsError, IsADirectoryError,
    NotADirectoryError, PermissionError, ValueError, TypeError, EOFError,
)


# A server that says it is busy (S3's SlowDown, a 503) is waited for longer than a dropped
# connection: what clears it is load draining off the server, which takes seconds, and a
# checkpoint burst from many ranks is what causes it. A busy marker is set by the backend
# (``TransientStorageError.server_busy``).
BUSY_BASE_S = 0.5
BUSY_MAX_S = 20.0


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, TransientStorageError):
        return True
    if isinstance(exc, _PERMANENT):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS


def call(
    fn: Callable[[], T],
    policy: RetrySettings,
    *,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[T, int]:
    """Run ``fn`` until it succeeds; return its value and the attempts it took.

    Raises the last error when it is permanent, when attempts run out, or when waiting
    again would pass the deadline; the error then carries ``attempts`` (an int attribute).
    The delay before attempt ``n + 1`` is uniform in [0, min(max_s, base_s * 2**(n-1))].
    """
    attempts = 0

    def attempt() -> T:
        nonlocal attempts
        attempts += 1
        try:
            return fn()
        except Exception as exc:
            exc.attempts = attempts  # type: ignore[attr-defined]
            raise

    def before_sleep(state: tenacity.RetryCallState) -> None:
        if on_retry is not None and state.outcome is not None:
            on_retry(state.attempt_number, state.outcome.exception(), state.upcoming_sleep)

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(policy.attempts) | tenacity.stop_before_delay(policy.deadline_s),
        wait=lambda state: backoff_s(policy, state.attempt_number,
                                     state.outcome.exception() if state.outcome else None),
        retry=tenacity.retry_if_exception(is_transient),
        before_sleep=before_sleep,
        sleep=sleep,
        reraise=True,
    )
    return retrying(attempt), attempts


def backoff_s(policy: RetrySettings, attempt: int, exc: BaseException | None) -> float:
    """The wait after failed attempt ``attempt``: uniform in [0, min(cap, base * 2**(attempt-1))],
    with the policy's base and cap, or at least ``BUSY_BASE_S`` / ``BUSY_MAX_S`` when the server
    said it was busy."""
    base, cap = policy.base_s, policy.max_s
    if getattr(exc, "server_busy", False):
        base, cap = max(base, BUSY_BASE_S), max(cap, BUSY_MAX_S)
    return random.uniform(0, min(cap, base * 2 ** (attempt - 1)))
