"""``bcp`` and the ``BCP_*`` settings, from a review (2026-11-27): a bad setting is a named
configuration error (exit 2) naming the variable, never an internal error, a silent default or
a lease that protects nothing; a checkpoint of a newer format gets its own exit code (7, not
"corrupt"); an unreachable HDFS name node or S3 endpoint fails within seconds, named."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint import errors
from bytecheckpoint.cli import app as cli
from bytecheckpoint.format.metadata import FORMAT_VERSION, METADATA_FILE, pack_document, unpack_document

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXIT_NEWER_FORMAT = 7  # docs/cli.md


def bcp_cli(*argv: str, env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    full_env.pop("BCP_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "bytecheckpoint.cli", *argv], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("cfg")
    for s in (1, 2):
        bcp.save(f"{base}/run/step_{s}", {"model": {"w": torch.arange(64.0) + s}}, step=s)
    return str(base / "run")


# -- a) a bad setting is a configuration error, before anything is read --------------------------

def test_a_bad_metadata_limit_is_a_configuration_error_not_an_internal_one(root):
    # Was: exit 70, "internal error: ValueError: ... (a bug: ...)".
    proc = bcp_cli("inspect", root, env={"BCP_METADATA_MAX_BYTES": "abc"})
    assert proc.returncode == cli.EXIT_USAGE, proc.stderr
    assert "configuration error" in proc.stderr and "BCP_METADATA_MAX_BYTES = 'abc'" in proc.stderr


@pytest.mark.parametrize("command", ["ls", "gc"])
def test_ls_and_gc_refuse_a_bad_metadata_limit_instead_of_noting_every_checkpoint(root, command, capsys,
                                                                                  monkeypatch):
    # Was: exit 0, every checkpoint "unreadable metadata (BCP_METADATA_MAX_BYTES = ...)".
    monkeypatch.setenv("BCP_METADATA_MAX_BYTES", "-1")
    argv = [command, root] + (["--keep-last", "1"] if command == "gc" else [])
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "configuration error: BCP_METADATA_MAX_BYTES = '-1'" in err


@pytest.mark.parametrize(("name", "value", "says"), [
    ("BCP_STORAGE_THREADS", "abc", "BCP_STORAGE_THREADS='abc' is not a valid int"),
    ("BCP_STORAGE_RETRY_BASE_S", "inf", "BCP_STORAGE_RETRY_BASE_S='inf' must be positive"),
    ("BCP_STORAGE_CONFIG", "{root}", "cannot be read"),
    ("BCP_CLI_CONNECT_TIMEOUT_S", "-1", "BCP_CLI_CONNECT_TIMEOUT_S = '-1'"),
])
def test_bad_storage_and_cli_settings_are_configuration_errors(root, capsys, monkeypatch, name, value, says):
    # Was: exit 6 "storage error" (a directory as the config file: a raw IsADirectoryError in
    # the library; inf: accepted, a backoff sleep then overflows), or silently nothing.
    monkeypatch.setenv(name, value.format(root=root))
    for command in ("inspect", "ls"):
        assert cli.main([command, root]) == cli.EXIT_USAGE, command
        err = capsys.readouterr().err
        assert "configuration error" in err and says in err, err


def test_storage_settings_errors_are_named_in_the_library(tmp_path, monkeypatch):
    conf = tmp_path / "storage.toml"
    conf.write_text('[s3]\nconnect_timeout_s = "soon"\n')
    monkeypatch.setenv("BCP_STORAGE_CONFIG", str(conf))
    with pytest.raises(errors.InvalidStorageSettingError, match=r"\[s3\].connect_timeout_s='soon'"):
        bcp.save(str(tmp_path / "c"), {"w": torch.zeros(2)})  # was: a raw ValueError
    monkeypatch.setenv("BCP_STORAGE_CONFIG", str(tmp_path))
    with pytest.raises(errors.StorageError, match="cannot be read"):  # still a StorageError
        bcp.save(str(tmp_path / "c"), {"w": torch.zeros(2)})


# -- the sweep: settings a save or a load reads ---------------------------------------------------

@pytest.mark.parametrize("value", ["0", "-5", "nan", "soon"])
def test_a_lease_ttl_that_protects_nothing_is_refused(root, monkeypatch, value):
    # Was: accepted; the read lease was written already expired, so gc and tiering could take
    # the checkpoint while it was being loaded.
    monkeypatch.setenv("BCP_LEASE_TTL_S", value)
    with pytest.raises(errors.InvalidSettingError, match="BCP_LEASE_TTL_S"):
        bcp.load(f"{root}/step_1", {"model": {"w": torch.zeros(64)}})


@pytest.mark.parametrize(("name", "value"), [("BCP_LOAD_EARLY", "maybe"), ("BCP_LOAD_THREADS", "many")])
def test_load_settings_are_refused_by_name(root, monkeypatch, name, value):
    # Was: BCP_LOAD_EARLY=maybe silently on; BCP_LOAD_THREADS a ValueError wrapped twice in
    # RankFailedError.
    monkeypatch.setenv(name, value)
    with pytest.raises(errors.InvalidSettingError, match=f"{name} = '{value}'"):
        bcp.load(f"{root}/step_1", {"model": {"w": torch.zeros(64)}})


def test_files_per_from_the_environment_is_a_setting_error(tmp_path, monkeypatch):
    monkeypatch.setenv("BCP_FILES_PER", "node")  # was: a builtin ValueError
    with pytest.raises(errors.InvalidSettingError, match="BCP_FILES_PER"):
        bcp.save(str(tmp_path / "c"), {"w": torch.zeros(2)})
    assert not os.path.exists(tmp_path / "c" / METADATA_FILE)


@pytest.mark.parametrize(("env", "names"), [
    ({"BCP_COMM_TREE": "sometimes"}, "BCP_COMM_TREE"),  # was: silently automatic
    ({"BCP_COMM_TREE": "1", "BCP_COMM_FANOUT": "0"}, "BCP_COMM_FANOUT"),  # was: silently 16
    ({"BCP_COMM_TREE": "1", "BCP_COMM_HOST_SIZE": "eight"}, "BCP_COMM_HOST_SIZE"),  # was: raw int()
    ({"BCP_COMM_TREE_MIN_WORLD": "-3"}, "BCP_COMM_TREE_MIN_WORLD"),  # was: silently 256
])
def test_coordination_settings_are_refused_by_name(monkeypatch, env, names):
    from bytecheckpoint.runtime.comm import tree_settings

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(errors.InvalidSettingError, match=names):
        tree_settings(8)


def test_gc_pause_takes_the_usual_spellings_of_off(monkeypatch):
    from bytecheckpoint.runtime.gc_pause import hold

    monkeypatch.setenv("BCP_GC_PAUSE", "off")  # was: anything but "0" paused the collector
    release = hold()
    try:
        assert gc.isenabled()
    finally:
        release()


# -- b) a newer format has its own exit code ------------------------------------------------------

def test_a_newer_format_is_not_called_corrupt(root, tmp_path):
    ckpt = str(tmp_path / "step_9")
    bcp.save(ckpt, {"model": {"w": torch.zeros(4)}}, step=9)
    meta = os.path.join(ckpt, METADATA_FILE)
    with open(meta, "rb") as f:
        doc = unpack_document(f.read())
    doc["version"] = FORMAT_VERSION + 1
    with open(meta, "wb") as f:
        f.write(pack_document(doc))
    for command in ("inspect", "verify"):
        # Was: exit 4, "corrupt checkpoint: ... upgrade bytecheckpoint ... (run 'bcp verify')".
        proc = bcp_cli(command, ckpt)
        assert proc.returncode == EXIT_NEWER_FORMAT, proc.stderr
        assert "newer format" in proc.stderr and "upgrade bytecheckpoint" in proc.stderr
        assert "corrupt" not in proc.stderr and "run 'bcp verify'" not in proc.stderr
    with pytest.raises(errors.NewerFormatError):  # a CorruptCheckpointError still, for callers
        bcp.load(ckpt, {"model": {"w": torch.zeros(4)}})


# -- c) an unreachable server fails within seconds, named ----------------------------------------

@pytest.fixture
def silent_port():
    """A port that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


def _refused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


@pytest.mark.parametrize("server", ["refused", "silent"])
def test_an_unreachable_hdfs_name_node_fails_within_seconds(silent_port, server):
    # Was: about three minutes of the HDFS client's retries (a silent one: longer), then an error.
    port = silent_port if server == "silent" else _refused_port()
    start = time.monotonic()
    proc = bcp_cli("inspect", f"hdfs://127.0.0.1:{port}/ckpt", env={"BCP_CLI_CONNECT_TIMEOUT_S": "1"},
                   timeout=60)
    assert time.monotonic() - start < 20
    assert proc.returncode == cli.EXIT_STORAGE, proc.stderr
    assert f"HDFS name node 127.0.0.1:{port}" in proc.stderr and "BCP_CLI_CONNECT_TIMEOUT_S" in proc.stderr


def test_an_unreachable_s3_endpoint_fails_within_seconds(silent_port):
    # Was: over a minute of retries (six attempts of the client's own).
    env = {"BCP_CLI_CONNECT_TIMEOUT_S": "1", "BCP_S3_ENDPOINT": f"http://127.0.0.1:{silent_port}",
           "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    start = time.monotonic()
    proc = bcp_cli("ls", "s3://bucket/ckpt", env=env, timeout=60)
    assert time.monotonic() - start < 20
    assert proc.returncode == cli.EXIT_STORAGE, proc.stderr
    assert f"S3 endpoint 127.0.0.1:{silent_port}" in proc.stderr


def test_the_probe_is_the_command_lines_only():
    # A training job's saves keep the storage's own retries: the library never probes.
    import bytecheckpoint.storage.hdfs as hdfs
    import bytecheckpoint.storage.s3 as s3

    for module in (hdfs, s3):
        with open(module.__file__) as f:
            assert "preflight" not in f.read()
