"""The production stack's docker-compose.yml, and the settings registry it is checked against.

No Docker engine runs here: docker-compose 1.29 (``scripts/ensure_compose.sh``) validates and
resolves the file, and the resolved services are checked: every service the stack needs is
there with a healthcheck, and the project's services set only variables the code reads.
The settings registries (each package's ``settings`` module) are checked against the source by
``tests/unit/test_settings_registry.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from types import ModuleType

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPOSE = os.path.join(REPO, "docker-compose.yml")
OWN_IMAGE = "bytecheckpoint:"
# Third-party images are configured through their own variables (not the project's).
THIRD_PARTY_ENV = {"apache/kafka": re.compile(r"^KAFKA_[A-Z_]+$"),
                   "clickhouse/clickhouse-server": re.compile(r"^CLICKHOUSE_[A-Z_]+$"),
                   "apache/hadoop": re.compile(r"^ENSURE_NAMENODE_DIR$")}
NEEDED = {"kafka", "clickhouse", "namenode", "datanode", "ingester", "alerts", "dashboard", "tiering"}


def compose(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose is not installed: run scripts/ensure_compose.sh "
                    "(apt-get install -y docker-compose)")
    return subprocess.run([exe, "-f", COMPOSE, *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if not k.startswith(("BCP_", "COMPOSE_"))})


@pytest.fixture(scope="module")
def resolved() -> dict:
    r = compose("config")
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)


def test_compose_file_is_valid_with_and_without_the_example_env():
    r = compose("config", "-q")
    assert r.returncode == 0, r.stderr
    r = compose("--env-file", os.path.join(REPO, ".env.example"), "config", "-q")
    assert r.returncode == 0, r.stderr


def test_every_part_of_the_stack_is_there_with_a_healthcheck(resolved):
    services = resolved["services"]
    assert NEEDED <= set(services), NEEDED - set(services)
    for name in NEEDED:
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    # Kafka in KRaft mode (no ZooKeeper), one node acting as broker and controller
    assert not any("zookeeper" in s.get("image", "") for s in services.values())
    assert set(services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    # the services that need others wait until those are healthy
    assert services["ingester"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert services["tiering"]["depends_on"]["hdfs-init"]["condition"] == "service_completed_successfully"


def test_datanode_has_ssd_and_archive_storage():
    root = ET.parse(os.path.join(REPO, "deploy", "hadoop", "hdfs-site.xml")).getroot()
    props = {p.findtext("name"): p.findtext("value") for p in root.iter("property")}
    dirs = props["dfs.datanode.data.dir"].split(",")
    assert {d.split("]")[0] + "]" for d in dirs} == {"[SSD]", "[ARCHIVE]"}
    with open(COMPOSE) as f:
        text = f.read()
    assert "-policy ALL_SSD" in text  # new checkpoints land on SSD; tiering sets COLD (ARCHIVE)


def test_project_services_set_only_settings_the_code_reads(resolved):
    own = 0
    for name, svc in resolved["services"].items():
        env = svc.get("environment") or {}
        image = svc.get("image", "")
        if image.startswith(OWN_IMAGE):
            own += 1
            unknown = set(env) - NAMES
            assert not unknown, f"service {name} sets {sorted(unknown)}, which no code reads"
            assert svc["command"][0] in {"ingest", "alerts", "dashboard", "tier"}
        else:
            rule = next((r for prefix, r in THIRD_PARTY_ENV.items() if image.startswith(prefix)), None)
            assert rule is not None, f"service {name}: unknown image {image!r}"
            bad = [k for k in env if not rule.match(k)]
            assert not bad, f"service {name} ({image}) sets {bad}"
    assert own == 4


def test_env_example_names_only_settings_or_compose_variables():
    with open(COMPOSE) as f:
        compose_text = f.read()
    with open(os.path.join(REPO, ".env.example")) as f:
        keys = [line.split("=", 1)[0] for line in f if line.strip() and not line.startswith("#")]
    assert keys
    for key in keys:
        assert "${" + key in compose_text, f".env.example sets {key}, which docker-compose.yml never uses"
        if key.startswith("BCP_") and key != "BCP_IMAGE_TAG":
            assert key in NAMES, key


def _source(rel: str) -> str:
    with open(os.path.join(REPO, rel)) as f:
        return f.read()


def _docs_settings_hook() -> ModuleType:
    """``docs/hooks/settings_table.py``: the MkDocs hook that renders the settings reference."""
    path = os.path.join(REPO, "docs", "hooks", "settings_table.py")
    spec = importlib.util.spec_from_file_location("bcp_docs_settings_hook", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Every package's settings, collected as the docs page collects them.
SETTINGS = _docs_settings_hook().all_settings()
NAMES = frozenset(s.name for s in SETTINGS)


def test_the_docs_settings_reference_renders_every_setting_from_the_registry():
    with open(os.path.join(REPO, "mkdocs.yml")) as f:
        site = yaml.safe_load(f)
    assert "docs/hooks/settings_table.py" in site["hooks"]
    assert "operations.md" in json.dumps(site["nav"])
    hook = _docs_settings_hook()
    page = _source("docs/operations.md")
    assert hook.MARKER in page, "docs/operations.md lost the marker the settings table replaces"
    rows: dict[str, list[str]] = {}
    for line in hook.on_page_markdown(page).splitlines():
        if line.startswith("| `"):
            cells = [c.strip().replace("`", "").replace("\\|", "|")
                     for c in re.split(r"(?<!\\)\|", line.strip("|"))]
            assert cells[0] not in rows, f"{cells[0]} is listed twice"
            rows[cells[0]] = cells
    assert set(rows) == NAMES, sorted(set(rows) ^ NAMES)
    for s in SETTINGS:
        _, read_by, default, meaning = rows[s.name]
        assert (read_by, default, meaning) == (s.read_by, s.default or "—", s.meaning), s.name
