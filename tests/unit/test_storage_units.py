"""Storage layer pieces on their own: retry policy, fault specs, settings, local and shm I/O."""

from __future__ import annotations

import os
import time

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.errors import PermanentStorageError, StorageError, TransientStorageError
from bytecheckpoint.storage import faults, open_storage, retry
from bytecheckpoint.storage.config import RetrySettings, TransferSettings, settings
from bytecheckpoint.storage.local import LocalStorage


def test_backoff_grows_exponentially_with_full_jitter_and_a_cap():
    policy = RetrySettings(attempts=10, base_s=0.1, max_s=1.0)
    runs: list[list[float]] = []

    def down():
        raise TransientStorageError("down")

    for _ in range(200):
        runs.append([])
        with pytest.raises(TransientStorageError):
            retry.call(down, policy, sleep=runs[-1].append)
    assert {len(r) for r in runs} == {9}  # a wait between each of the 10 attempts
    for attempt, cap in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (9, 1.0)]:
        delays = [r[attempt - 1] for r in runs]
        assert 0 <= min(delays) and max(delays) <= cap and max(delays) > cap * 0.8


def test_retry_stops_on_permanent_errors_attempts_and_deadline():
    slept: list[float] = []
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] < 3:
            raise TransientStorageError("throttled")
        return "ok"

    policy = RetrySettings(attempts=5, base_s=0.01, max_s=0.01, deadline_s=10)
    assert retry.call(flaky, policy, sleep=slept.append) == ("ok", 3) and len(slept) == 2

    def denied():
        calls["n"] += 1
        raise PermanentStorageError("no permission")

    calls["n"] = 0
    with pytest.raises(PermanentStorageError):
        retry.call(denied, policy, sleep=slept.append)
    assert calls["n"] == 1
    for exc in (FileNotFoundError("x"), PermissionError("x"), ValueError("x")):
        assert not retry.is_transient(exc)
    for exc in (ConnectionResetError("x"), TimeoutError("x"), TransientStorageError("x")):
        assert retry.is_transient(exc)

    def always():
        raise TransientStorageError("down")

    with pytest.raises(TransientStorageError) as info:
        retry.call(always, policy, sleep=lambda s: None)
    assert info.value.attempts == 5
    t = time.monotonic()
    with pytest.raises(TransientStorageError):
        retry.call(always, RetrySettings(attempts=100, base_s=0.05, max_s=0.05, deadline_s=0.2))
    assert time.monotonic() - t < 1.0


def test_gave_up_error_names_the_operation_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("BCP_STORAGE_RETRY_BASE_S", "0.001")
    faults.install("fail_fraction=1;ops=size")
    try:
        storage, path = open_storage(str(tmp_path / "x"))
        with pytest.raises(TransientStorageError, match=r"size .* after 6 attempts.*BCP_STORAGE_RETRY"):
            storage.size(path)
    finally:
        faults.install(None)


def test_fault_spec_parsing_and_rank_selection(monkeypatch):
    spec = faults.FaultSpec.parse("fail_every=3; latency_s=0.01; ops=write,commit; ranks=1,2; path=model")
    assert spec.fail_every == 3 and spec.ops == {"write", "commit"} and spec.ranks == {1, 2}
    monkeypatch.setenv("RANK", "0")
    assert not spec.applies_here()
    monkeypatch.setenv("RANK", "2")
    assert spec.applies_here()
    for bad in ("fail_every", "nope=1", "ops=explode", "fail_fraction=lots"):
        with pytest.raises(ValueError, match="bad fault spec"):
            faults.FaultSpec.parse(bad)


def test_fail_kth_call_latency_and_env_config(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, "fail_call=2;ops=size;permanent=1;latency_s=0.02")
    storage, path = open_storage(str(tmp_path / "f"))
    storage.write_bytes(path, b"x")
    t = time.perf_counter()
    assert storage.size(path) == 1
    assert time.perf_counter() - t >= 0.02
    with pytest.raises(PermanentStorageError, match="call 2"):
        storage.size(path)
    assert storage.size(path) == 1
    monkeypatch.delenv(faults.ENV)
    assert faults.active() is None


def test_truncated_write_is_caught_on_load_naming_the_file(tmp_path):
    model = torch.nn.Linear(64, 64)
    faults.install("truncate_bytes=100;path=model-00000")
    try:
        bcp.save(str(tmp_path / "step_1"), {"model": model}, framework="single")
    finally:
        faults.install(None)
    with pytest.raises(bcp.CorruptCheckpointError, match="model-00000.safetensors.*(truncated|bytes but)"):
        bcp.load(str(tmp_path), {"model": torch.nn.Linear(64, 64)})


def test_settings_from_file_and_env_and_secrets_stay_hidden(tmp_path, monkeypatch):
    conf = tmp_path / "storage.toml"
    conf.write_text('[transfer]\npart_bytes = 1048576\nthreads = 2\n[retry]\nattempts = 3\n[s3]\n'
                    'endpoint = "http://127.0.0.1:9000"\naccess_key = "AK"\nsecret_key = "SUPERSECRET"\n')
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "BCP_S3_ENDPOINT", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("BCP_STORAGE_CONFIG", str(conf))
    monkeypatch.setenv("BCP_STORAGE_THREADS", "8")
    s = settings()
    assert s.transfer == TransferSettings(part_bytes=1 << 20, threads=8) and s.retry.attempts == 3
    assert s.s3.endpoint == "http://127.0.0.1:9000" and s.s3.secret_key == "SUPERSECRET"
    assert "SUPERSECRET" not in repr(s) and "AK" not in repr(s.s3)
    monkeypatch.setenv("BCP_STORAGE_THREADS", "zero")
    with pytest.raises(StorageError, match="BCP_STORAGE_THREADS='zero' is not a valid int"):
        settings()


def test_local_parallel_parts_write_and_read_back_exactly(tmp_path):
    local = LocalStorage(fsync=False, transfer=TransferSettings(part_bytes=4096, threads=4))
    data = os.urandom(100_000)
    path = str(tmp_path / "f")
    writer = local.open_writer(path)
    writer.write(data[:10])
    writer.write(memoryview(data)[10:])
    assert writer.commit() == len(data)
    buf = bytearray(90_000)
    assert local.read_into(path, 5, memoryview(buf)) == len(buf) and buf == data[5:90_005]
    tail = bytearray(50_000)
    assert local.read_into(path, 60_000, memoryview(tail)) == 40_000 and tail[:40_000] == data[60_000:]


def test_shm_is_shared_memory_and_refuses_paths_outside_its_root(tmp_path, monkeypatch):
    monkeypatch.setenv("BCP_SHM_DIR", str(tmp_path / "shm"))
    storage, path = open_storage("shm://job/a/f")
    storage.makedirs("job/a")
    storage.write_bytes(path, b"abc")
    assert (tmp_path / "shm" / "job" / "a" / "f").read_bytes() == b"abc"
    assert storage.url(path) == "shm://job/a/f"
    with pytest.raises(StorageError, match="outside the shared-memory root"):
        storage.size("../../etc/passwd")


def test_unknown_scheme_names_the_known_ones():
    with pytest.raises(StorageError, match=r"no storage backend for ftp://.*s3://"):
        open_storage("ftp://x/y")


_NO_SPAWN = """
import subprocess, sys, torch
started = []
def refuse(self, *args, **kwargs):  # recorded: a failed lookup may be swallowed as "not here"
    started.append(args[:1])
    raise OSError("no process may be started here")
subprocess.Popen.__init__ = refuse
import bytecheckpoint as bcp
root = sys.argv[1]
w = torch.arange(3 << 20, dtype=torch.float32)  # 12 MiB: large writes, direct-write checks
bcp.save(root, {"model": {"w": w}}, overwrite=True)
into = torch.zeros_like(w)
bcp.load(root, {"model": {"w": into}})
assert torch.equal(into, w)
assert not started, f"processes started: {started}"
print("ok")
"""


def test_a_save_and_a_load_start_no_process(tmp_path):
    """A training process may not be allowed to fork (and a fork of one holding GBs is slow):
    the C library's functions are looked up in the process itself, not through ldconfig."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _NO_SPAWN, str(tmp_path / "c")], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "BCP_STORAGE_DIRECT_WRITES": "1"})
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
