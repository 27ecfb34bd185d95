"""Fuzzing the settings parsers: each environment variable bytecheckpoint reads, set to random
text (numbers, nan/inf, huge, padded, non-ASCII digits, keywords of other settings), and the
function that reads it called. The result is a valid value, or InvalidSettingError naming the
variable (its storage subclass for the storage settings); never a raw ValueError, TypeError
or OverflowError, never a NaN or infinite duration. Telemetry's settings never raise (a bad
one must not stop training): they fall back to their defaults with a warning.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bytecheckpoint.cli import preflight
from bytecheckpoint.commit import leases, protocol, save_lock
from bytecheckpoint.engine import host_files, load, replicas, snapshot, staging_ring, write_through
from bytecheckpoint.errors import InvalidSettingError
from bytecheckpoint.format import metadata_file
from bytecheckpoint.runtime import comm, gc_pause
from bytecheckpoint.storage import config, faults, write_slots
from telemetry import config as telemetry_config
from tests.fuzz.strategies import fuzz_settings

pytestmark = pytest.mark.fuzz


def _count(v: Any, lo: int = 1) -> bool:
    return type(v) is int and v >= lo


def _seconds(v: Any, zero_ok: bool = True) -> bool:
    return type(v) is float and math.isfinite(v) and (v >= 0 if zero_ok else v > 0)


def _commit_seconds() -> bool:
    protocol.check_save_settings()
    return (_seconds(save_lock.lease_seconds(), False)
            and _seconds(protocol._seconds(protocol.GRACE_ENV, 60.0))
            and _seconds(protocol._seconds(protocol.WAIT_READERS_ENV, 5.0)))


def _tree() -> bool:
    out = comm.tree_settings(300)
    return out is None or (_count(out[0]) and _count(out[1]))


def _storage() -> bool:
    s = config.settings()
    t, r = s.transfer, s.retry
    return (_count(t.part_bytes) and _count(t.threads) and _count(t.write_behind_bytes, 0)
            and _count(t.host_writers, 0) and _count(r.attempts) and all(
                type(x) is float and 0 < x < math.inf for x in (r.base_s, r.max_s, r.deadline_s)))


def _telemetry() -> bool:
    s = telemetry_config._settings_from_env()
    return (_count(s.queue_size) and _count(s.spool_max_bytes) and _count(s.spool_limit_bytes)
            and s.sink in telemetry_config.SINKS and s.fsync in telemetry_config.FSYNC_POLICIES)


# variable -> a call that reads it and says whether what it returned is valid
READERS: dict[str, Callable[[], bool]] = {
    "BCP_COMM_HOST_SIZE": lambda: comm.host_size_setting() is None or _count(comm.host_size_setting()),
    "LOCAL_WORLD_SIZE": lambda: 1 <= load._local_ranks(8) <= 8 and _tree(),
    "BCP_COMM_TREE": _tree, "BCP_COMM_TREE_MIN_WORLD": _tree,
    "BCP_COMM_FANOUT": lambda: comm.tree_settings(300, tree=True) is not None and _tree(),
    "BCP_GC_PAUSE": lambda: type(gc_pause._enabled()) is bool,
    "BCP_STAGING_MAX_BYTES": lambda: staging_ring.staging_cap() is None or _count(staging_ring.staging_cap()),
    "BCP_SNAPSHOT_WRITE_THROUGH": lambda: type(write_through.enabled()) is bool,
    "BCP_DIFFERING_REPLICAS": lambda: replicas.mode() in replicas.MODES,
    "BCP_LOAD_THREADS": lambda: load.read_threads_setting() is None or _count(load.read_threads_setting()),
    "BCP_LOAD_EARLY": lambda: type(load.early_setting()) is bool,
    "BCP_SNAPSHOT_CONFIRM_S": lambda: _seconds(snapshot.confirm_timeout()),
    "BCP_FILES_PER": lambda: host_files.resolve(None, 2, 0, 4) is None
    or host_files.resolve(None, 2, 1, 4).host == 0,
    "BCP_METADATA_MAX_BYTES": lambda: _count(metadata_file.metadata_max_bytes()),
    "BCP_SAVE_LEASE_S": _commit_seconds, "BCP_SAVE_HEARTBEAT_S": _commit_seconds,
    "BCP_SAVE_STAGING_GRACE_S": _commit_seconds, "BCP_OVERWRITE_WAIT_S": _commit_seconds,
    "BCP_LEASE_TTL_S": lambda: _seconds(leases._ttl(), False),
    "BCP_CLI_CONNECT_TIMEOUT_S": lambda: _seconds(preflight.connect_timeout()),
    "BCP_STORAGE_SLOTS_DIR": lambda: write_slots.check_setting() is None
    and os.path.isdir(write_slots.slots_dir()),
    "BCP_STORAGE_FAULTS": lambda: faults.active() is None or faults.active().spec is not None,
    **{name: _storage for name in config._ENV_NAMES},
    **{name: _telemetry for name in ("BCP_TELEMETRY_QUEUE", "BCP_TELEMETRY_SPOOL_MAX_BYTES",
                                     "BCP_TELEMETRY_SPOOL_LIMIT_BYTES", "BCP_TELEMETRY_FSYNC",
                                     "BCP_TELEMETRY_SINK")},
}
NEVER_RAISE = frozenset(n for n in READERS if n.startswith("BCP_TELEMETRY") or n == "BCP_GC_PAUSE")

_KEYWORDS = ("1", "0", "-1", "true", "off", "yes", "async", "host", "rank", "warn", "refuse", "spool",
             "kafka", "always", "nan", "inf", "-inf", "1e400", "1e-400", "-0", "0.0", "1_000", "0x10", "²",
             "١٢", "１２", "9" * 5000, str(2**64), "/", "/nonexistent", "ops=write;fail_every=2",
             "latency_s=nan", "errno=²", "ranks=a", "fail_fraction=x;seed=1", "path=", "x=1")
_text = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=12)
values = st.one_of(
    st.sampled_from(_KEYWORDS), _text, st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.tuples(st.sampled_from(("", " ", "\t", "\n")), st.sampled_from(_KEYWORDS) | _text,
              st.sampled_from(("", " ", "\n"))).map("".join),
)


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


@fuzz_settings(400)
@given(st.sampled_from(sorted(READERS)), values)
def test_every_setting_read_is_a_valid_value_or_named(name, value):
    logging.disable(logging.WARNING)  # the fallbacks' warnings, thousands of them
    try:
        with _env(name, value):
            try:
                ok = READERS[name]()
            except InvalidSettingError as exc:
                assert name not in NEVER_RAISE, f"{name}={value!r} raised {exc}"
                return
        assert ok is True, f"{name}={value!r}: the reader gave an invalid value"
    finally:
        logging.disable(logging.NOTSET)


@pytest.mark.parametrize("name,value", [
    ("BCP_STAGING_MAX_BYTES", "-5"), ("BCP_STAGING_MAX_BYTES", "1.5"), ("BCP_SNAPSHOT_WRITE_THROUGH", "yes"),
    ("BCP_DIFFERING_REPLICAS", "sometimes"), ("BCP_SNAPSHOT_CONFIRM_S", "nan"), ("BCP_LEASE_TTL_S", "inf"),
    ("BCP_LEASE_TTL_S", "1e400"), ("BCP_STORAGE_FAULTS", "fail_every"), ("LOCAL_WORLD_SIZE", "²"),
])
def test_what_the_settings_fuzzer_found(name, value):
    """Four variables were refused as InvalidArgumentError (not the InvalidSettingError
    docs/errors.md names for a bad BCP_* value), an infinite lease TTL was taken (a lease no
    one released would never lapse), BCP_STORAGE_FAULTS raised a raw ValueError, and a load
    with LOCAL_WORLD_SIZE='²' (isdigit, but no int) a raw ValueError."""
    with _env(name, value):
        if name == "LOCAL_WORLD_SIZE":
            assert load._local_ranks(8) == 8
            return
        with pytest.raises(InvalidSettingError, match=name if name != "BCP_STORAGE_FAULTS" else "fault spec"):
            READERS[name]()
