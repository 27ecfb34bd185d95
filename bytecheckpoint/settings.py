"""Every environment variable the project reads, in one list: the reference for operators.

The code reads each variable where it is used (``bytecheckpoint/storage/config.py``,
``telemetry/config.py``, ``storage_tiering/config.py``, ...); this list only names them.
``tests/test_compose.py`` keeps the two from drifting apart: each name here must appear in the
module it names, every ``BCP_*`` name in the source must be listed here, and the production
``docker-compose.yml`` may set only names from this list on the project's own services.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    name: str
    read_by: str  # the module that reads it (a path relative to the repository root)
    default: str
    meaning: str


_S3 = "bytecheckpoint/storage/config.py"
_TEL = "telemetry/config.py"
_TIER = "storage_tiering/config.py"

SETTINGS: tuple[Setting, ...] = (
    # -- storage (the library, every process that saves or loads) ------------------------------
    Setting("BCP_STORAGE_CONFIG", _S3, "", "TOML file with [transfer], [retry], [s3], [hdfs] sections"),
    Setting("BCP_STORAGE_PART_BYTES", _S3, "67108864", "size of the parts a large write is split into"),
    Setting("BCP_STORAGE_THREADS", _S3, "4", "concurrent parts / ranged reads per file"),
    Setting("BCP_STORAGE_WRITE_BEHIND_BYTES", _S3, "67108864",
            "local files start writeback every this many bytes while written (0: at fsync only)"),
    Setting("BCP_STORAGE_DROP_BEHIND", _S3, "1",
            "1: large local reads and writes drop the page-cache pages they are done with; 0: keep "
            "them cached"),
    Setting("BCP_LOAD_THREADS", "bytecheckpoint/engine/load.py", "4 / ranks on the host",
            "reader threads per rank during a load (each large read is split again into "
            "BCP_STORAGE_THREADS parts)"),
    Setting("BCP_COMM_TREE", "bytecheckpoint/runtime/comm.py", "",
            "1: save/load coordination through a tree of host leaders; 0: flat; unset: tree from "
            "BCP_COMM_TREE_MIN_WORLD ranks"),
    Setting("BCP_COMM_TREE_MIN_WORLD", "bytecheckpoint/runtime/comm.py", "256",
            "world size from which coordination goes through the tree when BCP_COMM_TREE is unset"),
    Setting("BCP_COMM_HOST_SIZE", "bytecheckpoint/runtime/comm.py", "LOCAL_WORLD_SIZE",
            "ranks per host in the coordination tree (blocks of consecutive ranks)"),
    Setting("BCP_COMM_FANOUT", "bytecheckpoint/runtime/comm.py", "16", "children per leader above the host level"),
    Setting("BCP_FILES_PER", "bytecheckpoint/engine/host_files.py", "rank",
            "default of save(files_per=): rank (a storage file per rank and kind) or host (per "
            "host and kind, hosts of BCP_COMM_HOST_SIZE / LOCAL_WORLD_SIZE ranks)"),
    Setting("BCP_GC_PAUSE", "bytecheckpoint/runtime/gc_pause.py", "1",
            "0 keeps Python's garbage collector running during a save's foreground and loads"),
    Setting("BCP_STORAGE_RETRY_ATTEMPTS", _S3, "6", "attempts of a storage operation that fails transiently"),
    Setting("BCP_STORAGE_RETRY_BASE_S", _S3, "0.05", "first backoff between attempts (doubles each time)"),
    Setting("BCP_STORAGE_RETRY_MAX_S", _S3, "2", "longest backoff between attempts"),
    Setting("BCP_STORAGE_RETRY_DEADLINE_S", _S3, "120", "give up retrying after this many seconds"),
    Setting("BCP_STORAGE_FAULTS", "bytecheckpoint/storage/faults.py", "",
            "fault injection for tests (never set in production)"),
    Setting("BCP_S3_ENDPOINT", _S3, "", "S3-compatible endpoint, http://host:port (else AWS)"),
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
    Setting("BCP_METADATA_MAX_BYTES", "bytecheckpoint/commit/integrity.py", "1073741824",
            "the largest metadata file a reader accepts (a larger one is refused as damaged)"),
    Setting("BCP_SAVE_LEASE_S", "bytecheckpoint/commit/save_lock.py", "300",
            "on storage without file locks, a save's owner record counts as dead this long after "
            "its last heartbeat (then another save to the path may clean its staging)"),
    Setting("BCP_SAVE_HEARTBEAT_S", "bytecheckpoint/commit/save_lock.py", "30",
            "how often a save renews its owner record on storage without file locks"),
    Setting("BCP_SAVE_STAGING_GRACE_S", "bytecheckpoint/commit/protocol.py", "60",
            "a staging directory with no owner is left alone this long before it counts as stale"),
    Setting("BCP_OVERWRITE_WAIT_S", "bytecheckpoint/commit/protocol.py", "5",
            "how long an overwrite=True save waits for active read leases on the old checkpoint"),
    Setting("BCP_DEBUG", "bytecheckpoint/cli/app.py", "",
            "1: bcp prints the full traceback of an unexpected error (as --debug does)"),
    Setting("BCP_LEASE_TTL_S", "bytecheckpoint/commit/leases.py", "21600",
            "how long a read lease protects a checkpoint from tiering and gc"),
    # -- telemetry (training processes) ----------------------------------------------------------
    Setting("BCP_TELEMETRY", _TEL, "on", "off / 0 / false disables every event"),
    Setting("BCP_TELEMETRY_SINK", _TEL, "spool (kafka when BCP_TELEMETRY_KAFKA is set)", "spool or kafka"),
    Setting("BCP_TELEMETRY_DIR", _TEL, "./.bytecheckpoint/telemetry", "spool directory"),
    Setting("BCP_TELEMETRY_KAFKA", _TEL, "", "Kafka bootstrap servers, host:port[,host:port]"),
    Setting("BCP_TELEMETRY_TOPIC", _TEL, "bcp-telemetry", "Kafka topic of the events"),
    Setting("BCP_TELEMETRY_QUEUE", _TEL, "65536", "events buffered in memory before dropping"),
    Setting("BCP_TELEMETRY_SPOOL_MAX_BYTES", _TEL, "67108864", "size at which a spool file is rotated"),
    Setting("BCP_TELEMETRY_SPOOL_LIMIT_BYTES", _TEL, "1073741824",
            "spool bytes kept before the oldest are dropped (not yet ingested, or acknowledged by Kafka)"),
    Setting("BCP_TELEMETRY_FSYNC", _TEL, "interval", "spool fsync policy: interval, always or never"),
    Setting("BCP_JOB", "telemetry/context.py", "default", "job name on every event"),
    Setting("BCP_RUN", "telemetry/context.py", "", "run name on every event"),
    # -- telemetry store, ingester, alerts, dashboard ----------------------------------------------
    Setting("BCP_CLICKHOUSE_DSN", "telemetry/store/client.py", "chdb://<spool dir>/../store",
            "ClickHouse: http(s)://user:pass@host:8123/db, or chdb:///abs/path (embedded)"),
    Setting("BCP_INGEST_GROUP", "telemetry/ingest/__main__.py", "bcp-ingest",
            "Kafka consumer group of the ingester"),
    Setting("BCP_INGEST_KILL_AFTER_INSERTS", "telemetry/ingest/runner.py", "0",
            "crash test hook (never set in production)"),
    Setting("BCP_DASHBOARD_DSN", "dashboard/store.py", "BCP_CLICKHOUSE_DSN", "the dashboard's store"),
    Setting("BCP_DASHBOARD_SPOOL", "dashboard/store.py", "",
            "a spool directory the dashboard ingests itself"),
    # -- storage tiering ----------------------------------------------------------------------------
    Setting("BCP_TIERING_CONFIG", _TIER, "", "TOML file with a [tiering] section"),
    Setting("BCP_TIERING_HOT", _TIER, "", "hot root (local dir, or hdfs://nn:8020/ckpt for HDFS mode)"),
    Setting("BCP_TIERING_COLD", _TIER, "", "cold root (local mode only)"),
    Setting("BCP_TIERING_COOL_AFTER", _TIER, "7d", "age at which a checkpoint is cooled"),
    Setting("BCP_TIERING_KEEP_NEWEST", _TIER, "2", "newest N checkpoints of each run stay hot"),
    Setting("BCP_TIERING_DELETE_AFTER", _TIER, "off", "retention: delete checkpoints older than this"),
    Setting("BCP_TIERING_KEEP_EVERY", _TIER, "0", "retention keeps steps divisible by this"),
    Setting("BCP_TIERING_INTERVAL", _TIER, "1h", "period of --loop"),
    Setting("BCP_TIERING_COLD_POLICY", _TIER, "COLD", "HDFS storage policy of cooled checkpoints"),
    Setting("BCP_TIERING_HDFS_CLI", "storage_tiering/hdfs.py", "hdfs", "the Hadoop command line (HDFS mode)"),
)

NAMES: frozenset[str] = frozenset(s.name for s in SETTINGS)


def by_name(name: str) -> Setting:
    for s in SETTINGS:
        if s.name == name:
            return s
    raise KeyError(name)
