"""The settings registry: each package declares the environment variables it reads.

A registry names variables with their default and meaning, for operators; the code still reads
each variable where it is used. Every package owns its own registry in its ``settings`` module:
the library's is below, telemetry's is ``telemetry/settings.py``, the dashboard's
``dashboard/settings.py``, the tiering service's ``storage_tiering/settings.py`` and the test
suite's and scripts' ``tests/support/settings.py``. The docs build renders one table per registry
(``docs/hooks/settings_table.py``), and ``tests/unit/test_settings_registry.py`` reads the source to
check that every variable read is declared exactly once and every declared one is read.

This module is foundation-level and light (no torch, no upper package): every settings module
imports it, and the docs build loads them all.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import CheckpointError

_NAME = re.compile(r"^[A-Z][A-Z0-9_]*[A-Z0-9]$")
_PATH = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./-]*\.(py|sh)$")


class SettingsError(CheckpointError, ValueError):
    """A settings registry is malformed: a bad name, a duplicate, a multi-line description."""


@dataclass(frozen=True)
class Setting:
    name: str  # the environment variable
    read_by: str  # the module that reads it, relative to the repository root
    default: str  # what applies when it is unset ("" when nothing does)
    meaning: str  # one line for the reference table


@dataclass(frozen=True)
class Registry:
    """The settings one package reads, in the order the reference page lists them."""

    package: str
    title: str  # the heading of this package's table on the reference page
    settings: tuple[Setting, ...]

    @property
    def names(self) -> frozenset[str]:
        return frozenset(s.name for s in self.settings)


def _check(package: str, s: object) -> Setting:
    if not isinstance(s, Setting):
        raise SettingsError(f"{package} settings: {s!r} is not a Setting; declare it as "
                            "Setting(name, read_by, default, meaning)")
    if not _NAME.match(s.name):
        raise SettingsError(f"{package} settings: {s.name!r} is not an environment variable name "
                            "(upper-case letters, digits and underscores)")
    if not _PATH.match(s.read_by) or ".." in s.read_by.split("/"):
        raise SettingsError(f"{package} settings: {s.name} read_by={s.read_by!r} must be a .py or .sh path "
                            "relative to the repository root, inside it")
    if not isinstance(s.default, str) or "\n" in s.default:
        raise SettingsError(f"{package} settings: {s.name} default={s.default!r} must be one line of text "
                            "(\"\" when nothing applies)")
    if not isinstance(s.meaning, str) or not s.meaning.strip() or "\n" in s.meaning:
        raise SettingsError(f"{package} settings: {s.name} needs a one-line meaning, got {s.meaning!r}")
    return s


def registry(package: str, title: str, settings: Iterable[Setting]) -> Registry:
    """A package's registry, checked: well-formed entries, each name once."""
    if not package.isidentifier():
        raise SettingsError(f"settings registry {package!r}: name it after its package (an identifier)")
    if not title.strip() or "\n" in title:
        raise SettingsError(f"settings registry {package}: the title must be one line, got {title!r}")
    checked = tuple(_check(package, s) for s in settings)
    twice = sorted(name for name, n in Counter(s.name for s in checked).items() if n > 1)
    if twice:
        raise SettingsError(f"{package} settings declare {twice} more than once: keep one entry each")
    return Registry(package, title.strip(), checked)


def merge(registries: Iterable[Registry]) -> tuple[Setting, ...]:
    """Every setting of ``registries``, in order; a name or a package declared twice is an error."""
    owner: dict[str, str] = {}
    packages: set[str] = set()
    out: list[Setting] = []
    for reg in registries:
        if reg.package in packages:
            raise SettingsError(f"two settings registries are named {reg.package!r}: one per package")
        packages.add(reg.package)
        for s in reg.settings:
            if s.name in owner:
                raise SettingsError(f"{s.name} is declared by both {owner[s.name]} and {reg.package}: "
                                    "keep it in the package that reads it")
            owner[s.name] = reg.package
            out.append(s)
    return tuple(out)


_S3 = "bytecheckpoint/storage/config.py"

REGISTRY = registry("bytecheckpoint", "Library: every process that saves or loads", (
    Setting("BCP_STORAGE_CONFIG", _S3, "", "TOML file with [transfer], [retry], [s3], [hdfs] sections"),
    Setting("BCP_STORAGE_PART_BYTES", _S3, "67108864", "size of the parts a large write is split into"),
    Setting("BCP_STORAGE_THREADS", _S3, "4", "concurrent parts / ranged reads per file"),
    Setting("BCP_STORAGE_WRITE_BEHIND_BYTES", _S3, "67108864",
            "local files start writeback every this many bytes while written (0: at fsync only)"),
    Setting("BCP_STORAGE_DROP_BEHIND", _S3, "1",
            "1: large local reads and writes drop the page-cache pages they are done with; 0: keep "
            "them cached"),
    Setting("BCP_STORAGE_DIRECT_WRITES", _S3, "async",
            "async: in async saves the aligned middle of a large local write goes to the disk from "
            "the caller's memory (O_DIRECT, where the file system reports its alignment), sparing "
            "training the CPU of a page-cache copy, and saves training waits for go through the "
            "page cache; 1: direct in every save; 0: everything through the page cache"),
    Setting("BCP_STORAGE_HOST_WRITERS", _S3, "4",
            "in saves training waits for: large local files written at once to one file system by "
            "all the processes of a host, each process at most its share of them (the others wait "
            "their turn; 0: no limit)"),
    Setting("BCP_STORAGE_SLOTS_DIR", "bytecheckpoint/storage/write_slots.py", "the temporary directory",
            "where the host's write-slot lock files live (a directory every process of the host sees)"),
    Setting("BCP_LOAD_THREADS", "bytecheckpoint/engine/load.py",
            "4 / ranks on the host, at most cores / ranks",
            "reader threads per rank during a load (each large read is split again into "
            "BCP_STORAGE_THREADS parts)"),
    Setting("BCP_LOAD_EARLY", "bytecheckpoint/engine/load.py", "1",
            "0: a load reads nothing before its plan is agreed (the order before early reads; for "
            "comparison and as a way out)"),
    Setting("BCP_COMM_TREE", "bytecheckpoint/runtime/comm.py", "",
            "1: save/load coordination through a tree of host leaders; 0: flat; unset: tree from "
            "BCP_COMM_TREE_MIN_WORLD ranks"),
    Setting("BCP_COMM_TREE_MIN_WORLD", "bytecheckpoint/runtime/comm.py", "256",
            "world size from which coordination goes through the tree when BCP_COMM_TREE is unset"),
    Setting("BCP_COMM_HOST_SIZE", "bytecheckpoint/runtime/comm.py", "LOCAL_WORLD_SIZE",
            "ranks per host in the coordination tree (blocks of consecutive ranks)"),
    Setting("BCP_COMM_FANOUT", "bytecheckpoint/runtime/comm.py", "16",
            "children per leader above the host level"),
    Setting("BCP_FILES_PER", "bytecheckpoint/engine/host_files.py", "rank",
            "default of save(files_per=): rank (a storage file per rank and kind) or host (per "
            "host and kind, hosts of BCP_COMM_HOST_SIZE / LOCAL_WORLD_SIZE ranks)"),
    Setting("BCP_STAGING_MAX_BYTES", "bytecheckpoint/engine/staging_ring.py", "",
            "the most host memory a save stages into per rank (default of save(staging_max_bytes=); "
            "unset: one copy of the rank's share); below it the copy runs in rounds that wait for "
            "the writer"),
    Setting("BCP_SNAPSHOT_CONFIRM_S", "bytecheckpoint/engine/snapshot.py", "30",
            "an overlapped save waits this long for training to confirm its snapshot, then checks alone"),
    Setting("BCP_SNAPSHOT_WRITE_THROUGH", "bytecheckpoint/engine/write_through.py", "1",
            "0 makes overlapped saves of host tensors copy into the staging arena instead of writing "
            "straight from the live tensors to a page-cached storage"),
    Setting("BCP_DIFFERING_REPLICAS", "bytecheckpoint/engine/replicas.py", "refuse",
            "replicas that differ between ranks: refuse the save, warn (save one copy), or off (no check)"),
    Setting("BCP_GC_PAUSE", "bytecheckpoint/runtime/gc_pause.py", "1",
            "0 keeps Python's garbage collector running during a save's foreground and loads"),
    Setting("BCP_STORAGE_RETRY_ATTEMPTS", _S3, "6", "attempts of a storage operation that fails transiently"),
    Setting("BCP_STORAGE_RETRY_BASE_S", _S3, "0.05", "first backoff between attempts (doubles each time)"),
    Setting("BCP_STORAGE_RETRY_MAX_S", _S3, "2", "longest backoff between attempts"),
    Setting("BCP_STORAGE_RETRY_DEADLINE_S", _S3, "120", "give up retrying after this many seconds"),
    Setting("BCP_STORAGE_FAULTS", "bytecheckpoint/storage/faults.py", "",
            "fault injection for tests (never set in production)"),
    Setting("BCP_S3_ENDPOINT", _S3, "", "S3-compatible endpoint, http://host:port (else AWS)"),
    Setting("BCP_S3_CONNECT_TIMEOUT_S", _S3, "5", "seconds to open a connection to the S3 endpoint"),
    Setting("BCP_S3_REQUEST_TIMEOUT_S", _S3, "20",
            "seconds an S3 request may go without receiving a byte (whole seconds) before the "
            "attempt fails naming the endpoint (then retried as BCP_STORAGE_RETRY_* say)"),
    Setting("AWS_ENDPOINT_URL_S3", _S3, "", "S3 endpoint, the AWS SDK's name (after BCP_S3_ENDPOINT)"),
    Setting("AWS_ENDPOINT_URL", _S3, "", "S3 endpoint, the AWS SDK's generic name"),
    Setting("AWS_REGION", _S3, "", "S3 region"),
    Setting("AWS_DEFAULT_REGION", _S3, "", "S3 region (fallback name)"),
    Setting("AWS_ACCESS_KEY_ID", _S3, "", "S3 access key"),
    Setting("AWS_SECRET_ACCESS_KEY", _S3, "", "S3 secret key"),
    Setting("AWS_SESSION_TOKEN", _S3, "", "S3 session token"),
    Setting("BCP_HDFS_URL", _S3, "", "default name node for hdfs:///path URLs, hdfs://host:8020"),
    Setting("BCP_SHM_DIR", "bytecheckpoint/storage/shm.py", "/dev/shm/bytecheckpoint",
            "directory behind shm:// URLs"),
    Setting("BCP_METADATA_MAX_BYTES", "bytecheckpoint/format/metadata_file.py", "1073741824",
            "the largest metadata file a reader accepts (a larger one is refused as damaged)"),
    Setting("BCP_SAVE_LEASE_S", "bytecheckpoint/commit/save_lock.py", "300",
            "on storage without file locks, a save's owner record counts as dead this long after "
            "its last heartbeat (then another save to the path may clean its staging)"),
    Setting("BCP_SAVE_HEARTBEAT_S", "bytecheckpoint/commit/save_lock.py", "30",
            "how often a save renews its owner record on storage without file locks (under "
            "BCP_SAVE_LEASE_S)"),
    Setting("BCP_SAVE_STAGING_GRACE_S", "bytecheckpoint/commit/protocol.py", "60",
            "a staging directory with no owner is left alone this long before it counts as stale"),
    Setting("BCP_OVERWRITE_WAIT_S", "bytecheckpoint/commit/protocol.py", "5",
            "how long an overwrite=True save waits for active read leases on the old checkpoint"),
    Setting("BCP_DEBUG", "bytecheckpoint/cli/app.py", "",
            "1: bcp prints the full traceback of an unexpected error (as --debug does)"),
    Setting("BCP_CLI_CONNECT_TIMEOUT_S", "bytecheckpoint/cli/preflight.py", "5",
            "bcp: how long a command tries to reach the HDFS name node or S3 endpoint of its URLs "
            "before it fails naming it (0: no check; training saves keep their own retries)"),
    Setting("BCP_LEASE_TTL_S", "bytecheckpoint/commit/leases.py", "21600",
            "how long a read lease protects a checkpoint from tiering and gc"),
))
