"""Retries with exponential backoff and full jitter, bounded in attempts and in time.

Only transient failures are retried: a missing file, a refused permission or a missing
bucket is an answer, and retrying it would only delay the error the caller must see.
"""

from __future__ import annotations

import errno
import random
import time
from collections.abc import Callable
from typing import TypeVar

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


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, TransientStorageError):
        return True
    if isinstance(exc, _PERMANENT):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS


def backoff(attempt: int, policy: RetrySettings, rng: random.Random) -> float:
    """Delay before attempt ``attempt + 1``: uniform in [0, min(max, base * 2**(attempt-1))]."""
    return rng.uniform(0.0, min(policy.max_s, policy.base_s * (2 ** (attempt - 1))))


_rng = random.Random()


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
    """
    start = time.monotonic()
    attempt = 1
    while True:
        try:
            return fn(), attempt
        except Exception as exc:
            exc.attempts = attempt  # type: ignore[attr-defined]
            if not is_transient(exc) or attempt >= policy.attempts:
                raise
            delay = backoff(attempt, policy, _rng)
            if time.monotonic() - start + delay > policy.deadline_s:
                raise
            if on_retry is not None:
                on_retry(attempt, exc, delay)
            sleep(delay)
            attempt += 1
