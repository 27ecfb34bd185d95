"""Install what each user needs: the training side (library, span emitter, spool and Kafka sinks,
tiering, the demo) imports none of the ingest/dashboard packages, and the extras say so."""

from __future__ import annotations

import os
import re
import subprocess
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STORE_ONLY = {"clickhouse-connect", "chdb", "pyyaml", "streamlit", "plotly", "pandas"}
# Importing any of these fails in the probe, as on a machine without them.
BLOCKED = ["clickhouse_connect", "chdb", "yaml", "streamlit", "plotly", "pandas", "pyarrow", "safetensors",
           "transformers", "megatron", "moto", "hdfs_native", "kafka", "lz4", "pytest", "hypothesis"]
PROBE = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"blocked: {name}", name=name)
        return None
sys.meta_path.insert(0, Block())
for module in sys.argv[2:]:
    __import__(module)
print("ok")
"""


def extras() -> dict[str, set[str]]:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    name = lambda req: re.split(r"[\\[<>=!~; ]", req, maxsplit=1)[0].lower()  # noqa: E731
    return {extra: {name(r) for r in reqs} for extra, reqs in project["optional-dependencies"].items()}


def test_training_side_imports_without_store_or_dashboard_packages() -> None:
    modules = ["bytecheckpoint", "bytecheckpoint.api", "bytecheckpoint.storage", "telemetry",
               "telemetry.emitter", "telemetry.sinks.spool", "telemetry.sinks.kafka", "storage_tiering",
               "demo.__main__", "demo.train"]
    done = subprocess.run([sys.executable, "-c", PROBE, ",".join(BLOCKED), *modules], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


def test_probe_blocks_what_it_says() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE, "yaml", "yaml"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and "blocked: yaml" in done.stderr


def test_extras_split_training_from_store() -> None:
    e = extras()
    assert not (e["telemetry"] | e["demo"] | e["cli"] | e["s3"] | e["hdfs"]) & STORE_ONLY
    assert {"clickhouse-connect", "chdb", "pyyaml", "kafka-python"} <= e["ingest"]
    assert {"streamlit", "clickhouse-connect", "chdb"} <= e["dashboard"]


def test_dev_installs_every_extra() -> None:
    e = extras()
    for extra, reqs in e.items():
        assert reqs <= e["dev"], f"extra {extra!r} needs {sorted(reqs - e['dev'])}, missing from dev"
