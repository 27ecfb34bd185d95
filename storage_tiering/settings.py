"""The environment variables the tiering service reads (see bytecheckpoint.settings).

``storage_tiering/config.py`` reads ``BCP_TIERING_<FIELD>`` for each field of ``TieringConfig``;
``bcp ls`` and ``bcp gc`` read ``BCP_TIERING_COLD`` too, by name (the core never imports this).
"""

from __future__ import annotations

from bytecheckpoint.settings import Setting, registry

_TIER = "storage_tiering/config.py"

REGISTRY = registry("storage_tiering", "Storage tiering", (
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
))
