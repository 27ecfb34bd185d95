"""An overlapped save of host tensors to a page-cached storage writes straight from the live
tensors (``engine.write_through``): no staging arena, and the saved bytes are still the state
at ``save()``, because the optimizer step waits until every piece has gone through write()."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bytecheckpoint as bcp
from bytecheckpoint.engine import staging, write_through
from bytecheckpoint.storage import faults, open_storage
from bytecheckpoint.storage.hdfs import HdfsStorage
from bytecheckpoint.storage.local import LocalStorage
from bytecheckpoint.storage.memory import MemoryStorage
from bytecheckpoint.storage.s3 import S3Storage
from bytecheckpoint.storage.shm import SharedMemoryStorage
from bytecheckpoint.storage.wrapper import StorageWrapper
from tests.support.helpers import same_bits


def _model(sizes: list[int], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Module()
    for i, n in enumerate(sizes):
        m.register_parameter(f"p{i}", torch.nn.Parameter(torch.randn(n).to(dtype)))
    return m


def _grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.ones_like(p)


def _snapshot(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(optim.state.values()):
        out.update({f"optim.{i}.{k}": v.detach().clone() for k, v in s.items() if torch.is_tensor(v)})
    return out


def _loaded(path: str, sizes: list[int], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    model = _model(sizes, dtype, seed=123)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    _grads(model)
    optim.step()  # state exists to load into
    bcp.load(path, {"model": model, "optimizer": optim})
    return _snapshot(model, optim)


def _differs(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, v in ref.items() if not same_bits(v, got[k])]


@pytest.fixture
def no_arena():
    staging.release_pools()
    yield
    staging.release_pools()


def _trained(sizes: list[int], dtype: torch.dtype = torch.float32):
    model = _model(sizes, dtype)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    _grads(model)
    optim.step()
    _grads(model)  # the next step's gradients are ready when save() is called
    return model, optim


def test_an_overlapped_save_of_host_tensors_stages_nothing_and_is_exact(tmp_path, no_arena):
    sizes = [1 << 16, 3, 1 << 18]
    model, optim = _trained(sizes)
    ref = _snapshot(model, optim)
    handle = bcp.save(str(tmp_path / "a"), {"model": model, "optimizer": optim}, async_save=True,
                      snapshot="overlapped")
    optim.step()  # waits until every piece is written
    result = handle.wait(timeout=60)
    assert result.staging_bytes == 0 and staging.pool(False).capacity == 0
    assert _differs(ref, _snapshot(model, optim))  # the step did change the state
    assert _differs(ref, _loaded(str(tmp_path / "a"), sizes)) == []


def test_the_setting_and_the_blocking_mode_keep_the_arena(tmp_path, no_arena, monkeypatch):
    model, optim = _trained([1 << 14])
    state = {"model": model, "optimizer": optim}
    assert bcp.save(str(tmp_path / "b"), state, async_save=True).wait(timeout=60).staging_bytes > 0
    monkeypatch.setenv("BCP_SNAPSHOT_WRITE_THROUGH", "0")
    assert bcp.save(str(tmp_path / "o"), state, async_save=True, snapshot="overlapped"
                    ).wait(timeout=60).staging_bytes > 0


@pytest.mark.parametrize("value", ["no", "true", "2", "off"])
def test_a_bad_setting_fails_save_by_name_before_anything_runs(tmp_path, monkeypatch, value):
    monkeypatch.setenv("BCP_SNAPSHOT_WRITE_THROUGH", value)
    with pytest.raises(bcp.InvalidArgumentError, match="BCP_SNAPSHOT_WRITE_THROUGH"):
        bcp.save(str(tmp_path / "x"), {"model": torch.nn.Linear(4, 4)}, async_save=True,
                 snapshot="overlapped")
    assert not (tmp_path / "x").exists()


def test_a_module_with_buffers_keeps_the_arena(tmp_path, no_arena):
    """Its forward waits for the snapshot: the short wait of a copy, not the whole write."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    handle = bcp.save(str(tmp_path / "bn"), {"model": model}, async_save=True, snapshot="overlapped")
    assert handle.wait(timeout=60).staging_bytes > 0


def test_which_storages_take_writes_into_memory(tmp_path):
    """Only storages whose write() returns once the bytes are copied into memory: a network
    write (S3 parts, an HDFS stream) would make the optimizer step wait for the network."""
    assert LocalStorage.buffered_writes and SharedMemoryStorage.buffered_writes
    assert MemoryStorage.buffered_writes
    assert not S3Storage.buffered_writes and not HdfsStorage.buffered_writes
    assert StorageWrapper(LocalStorage()).buffered_writes  # a wrapper is its inner storage
    assert open_storage(str(tmp_path))[0].buffered_writes  # retries and telemetry around a disk

    class Remote(MemoryStorage):
        buffered_writes = False

    views = [torch.zeros(4)]
    assert write_through.applies(views, LocalStorage(), forward_waits=False, files_per_host=False)
    assert not write_through.applies(views, StorageWrapper(Remote()), forward_waits=False,
                                     files_per_host=False)
    assert not write_through.applies(views, LocalStorage(), forward_waits=True, files_per_host=False)
    assert not write_through.applies(views, LocalStorage(), forward_waits=False, files_per_host=True)
    assert not write_through.applies([torch.zeros(4, device="meta")], LocalStorage(),
                                     forward_waits=False, files_per_host=False)


def test_the_optimizer_step_waits_for_a_slow_write(tmp_path, no_arena):
    """Each write call takes 20 ms: the step on the line after save() must wait for all of them,
    and the checkpoint holds the state of the call, not the stepped one."""
    sizes = [1 << 15] * 6
    model, optim = _trained(sizes)
    ref = _snapshot(model, optim)
    path = tmp_path / "slow"
    faults.install(f"latency_s=0.02;ops=write;path={tmp_path}")
    try:
        handle = bcp.save(str(path), {"model": model, "optimizer": optim}, async_save=True,
                          snapshot="overlapped", chunk_bytes=1 << 14)
        assert not handle.wait_snapshot(timeout=0)  # the write is still going
        optim.step()
        assert handle._snapshot is not None and handle._snapshot.done.is_set()
        handle.wait(timeout=60)
    finally:
        faults.install(None)
    assert _differs(ref, _loaded(str(path), sizes)) == []


def test_a_failing_write_releases_training_and_fails_the_save(tmp_path, no_arena):
    """The third write call fails for good: the step must not wait for pieces that will never
    be written, and the save fails by name with nothing committed."""
    model, optim = _trained([1 << 15] * 4)
    path = tmp_path / "broken"
    faults.install(f"fail_call=3;permanent=1;ops=write;path={tmp_path}")
    try:
        handle = bcp.save(str(path), {"model": model, "optimizer": optim}, async_save=True,
                          snapshot="overlapped", chunk_bytes=1 << 14)
        stepped = threading.Event()
        threading.Thread(target=lambda: (optim.step(), stepped.set()), daemon=True).start()
        assert stepped.wait(30), "the optimizer step waited for a write that had failed"
        with pytest.raises(bcp.StorageError):
            handle.wait(timeout=60)
    finally:
        faults.install(None)
    assert not path.exists()


def test_non_contiguous_parameters_are_written_exactly(tmp_path, no_arena):
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.t = torch.nn.Parameter(torch.randn(300, 70).t())  # no flat view
    m.s = torch.nn.Parameter(torch.randn(90, 40)[::2, 5:35])
    m.e = torch.nn.Parameter(torch.zeros(0, 4))
    ref = {k: v.detach().clone() for k, v in m.state_dict().items()}
    optim = torch.optim.SGD(m.parameters(), lr=1.0)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    handle = bcp.save(str(tmp_path / "v"), {"model": m}, async_save=True, snapshot="overlapped")
    optim.step()
    assert handle.wait(timeout=60).staging_bytes == 0
    fresh = torch.nn.Module()
    fresh.t = torch.nn.Parameter(torch.zeros(70, 300))
    fresh.s = torch.nn.Parameter(torch.zeros(45, 30))
    fresh.e = torch.nn.Parameter(torch.zeros(0, 4))
    bcp.load(str(tmp_path / "v"), {"model": fresh})
    assert all(same_bits(fresh.state_dict()[k], v) for k, v in ref.items())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 40_000), min_size=1, max_size=6),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
       chunk=st.sampled_from([1 << 12, 1 << 14, 1 << 20]),
       latency=st.sampled_from([0.0, 0.002]))
def test_any_state_steps_at_once_and_the_checkpoint_is_the_state_at_save(tmp_path_factory, sizes, dtype,
                                                                          chunk, latency):
    path = tmp_path_factory.mktemp("wt") / "c"
    model, optim = _trained(sizes, dtype)
    ref = _snapshot(model, optim)
    faults.install(f"latency_s={latency};ops=write;path={path.parent}" if latency else None)
    try:
        t = time.perf_counter()
        handle = bcp.save(str(path), {"model": model, "optimizer": optim}, async_save=True,
                          snapshot="overlapped", chunk_bytes=chunk)
        optim.step()
        handle.wait(timeout=60)
        assert time.perf_counter() - t < 60
    finally:
        faults.install(None)
    assert _differs(ref, _loaded(str(path), sizes, dtype)) == []
