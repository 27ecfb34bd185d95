"""A staging arena bounded below the rank's share (``staging_max_bytes`` /
``BCP_STAGING_MAX_BYTES``): the copy runs in rounds through the bounded arena, the snapshot is
still the state at ``save()`` bit for bit, and the arena never holds more than the bound (issue
21, memory). The functions without ``test_`` run on every rank of a gloo group."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

import bytecheckpoint as bcp
from bytecheckpoint.engine import staging
from demo.model import GPTConfig, batch, loss_fn
from tests.support.helpers import same_bits
from tests.support.workloads import full_state, make_fsdp2

# ~0.9M parameters: about 5.5 MB of model and AdamW state per rank on 2 ranks.
CFG = GPTConfig(vocab_size=2003, context=16, dim=128, heads=4, layers=3)
CAP = 1 << 20  # several times smaller than a rank's share
CHUNK = 64 << 10


def _fsdp2(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    # AdamW's default weight decay (0.01), on this file's small model
    return make_fsdp2(seed, cfg=CFG, weight_decay=1e-2)


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    inputs, targets = batch(CFG, step, dist.get_rank(), size=2)
    loss_fn(model, inputs, targets).backward()
    optim.step()
    optim.zero_grad()


def _loaded(path: str) -> dict[str, Any]:
    model, optim = _fsdp2(seed=99)
    _train(model, optim, 0)  # optimizer state exists to load into
    bcp.load(path, {"model": model, "optimizer": optim}, framework="fsdp2")
    return full_state(model, optim)


def _differs(ref: dict[str, Any], got: dict[str, Any]) -> list[str]:
    return [k for k, v in ref.items() if isinstance(v, torch.Tensor) and not same_bits(v, got[k])]


def capped_saves(root: str, snapshot: str) -> dict[str, Any]:
    """Two saves (planned, then a plan-cache hit) with a bounded arena; the optimizer steps on
    the line after each save() returns."""
    staging.release_pools()
    os.environ["BCP_SNAPSHOT_WRITE_THROUGH"] = "0"  # an overlapped save goes through the arena too
    try:
        return _capped_saves(root, snapshot)
    finally:
        del os.environ["BCP_SNAPSHOT_WRITE_THROUGH"]


def _capped_saves(root: str, snapshot: str) -> dict[str, Any]:
    model, optim = _fsdp2(seed=0)
    state = {"model": model, "optimizer": optim}
    _train(model, optim, 0)
    out: dict[str, Any] = {"differs": [], "peak": [], "share": 0, "capacity": []}
    share = sum(t.numel() * t.element_size() for t in full_state(model, optim).values()
                if isinstance(t, torch.Tensor)) // dist.get_world_size()
    out["share"] = share
    for k in range(2):
        _train(model, optim, 1 + k)
        ref = full_state(model, optim)
        handle = bcp.save(f"{root}/s{k}", state, framework="fsdp2", async_save=True, snapshot=snapshot,
                          staging_max_bytes=CAP, chunk_bytes=CHUNK)
        _train(model, optim, 10 + k)  # changes every saved tensor: waits for the last round
        result = handle.wait(timeout=300)
        out["peak"].append(result.staging_bytes)
        out["capacity"].append(staging.pool(False).capacity)
        out["differs"].append(_differs(ref, _loaded(f"{root}/s{k}")))
    return out


@pytest.mark.parametrize("snapshot", ["blocking", "overlapped"])
def test_bounded_arena_saves_the_exact_state_within_the_bound(world, tmp_path, snapshot):
    for r in world(2).run(capped_saves, str(tmp_path), snapshot):
        assert r["share"] > 4 * CAP  # the bound is several times below the share
        assert r["differs"] == [[], []]
        assert all(0 < p <= CAP for p in r["peak"])  # the stager's own accounting
        assert all(0 < c <= CAP for c in r["capacity"])  # the arena itself (an earlier save's freed)


def test_setting_bounds_the_arena_and_non_contiguous_sources_copy_exactly(tmp_path, monkeypatch):
    """One process: BCP_STAGING_MAX_BYTES applies when save() is not told; transposed and
    sliced tensors (no flat view) are copied in segments of their row-major order."""
    torch.manual_seed(0)
    model = _views_module()
    state = {"model": model}
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    staging.pool(False).reserve(8 << 20)  # an earlier, larger arena must not be kept alive
    monkeypatch.setenv("BCP_STAGING_MAX_BYTES", str(256 << 10))
    handle = bcp.save(str(tmp_path / "c"), state, async_save=True, chunk_bytes=16 << 10)
    with torch.no_grad():
        for v in model.state_dict().values():
            v.add_(1.0)
    result = handle.wait(timeout=120)
    assert 0 < result.staging_bytes <= 256 << 10
    assert staging.pool(False).capacity <= 256 << 10
    fresh = _views_module()
    bcp.load(str(tmp_path / "c"), {"model": fresh})
    assert all(same_bits(fresh.state_dict()[k], v) for k, v in ref.items())


def _views_module() -> torch.nn.Module:
    m = torch.nn.Module()
    m.register_buffer("t", torch.randn(700, 300).t())  # no flat view: copied box by box
    m.register_buffer("s", torch.randn(900, 400)[::2, 5:305])
    m.register_buffer("x", torch.tensor(3.5))
    m.register_buffer("e", torch.zeros(0, 4))
    m.w = torch.nn.Parameter(torch.randn(300, 500))
    return m


def test_bound_below_one_checksum_chunk_fails_by_name(tmp_path):
    state = {"model": torch.nn.Linear(256, 256)}
    with pytest.raises(bcp.StagingError, match="smaller than one checksum chunk"):
        bcp.save(str(tmp_path / "a"), state, async_save=True, staging_max_bytes=64 << 10,
                 chunk_bytes=1 << 20).wait(timeout=60)
    assert not (tmp_path / "a").exists()
    for bad in (0, -5, "1MB", True):
        with pytest.raises(bcp.InvalidArgumentError, match="staging_max_bytes"):
            bcp.save(str(tmp_path / "b"), state, async_save=True, staging_max_bytes=bad)


def test_bad_setting_fails_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("BCP_STAGING_MAX_BYTES", "lots")
    with pytest.raises(bcp.StagingError, match="BCP_STAGING_MAX_BYTES"):
        bcp.save(str(tmp_path / "b"), {"model": torch.nn.Linear(64, 64)}, async_save=True).wait(timeout=60)
    assert not (tmp_path / "b").exists()


def test_writer_failure_does_not_leave_the_copy_waiting(tmp_path):
    """A save under a cached plan whose target exists fails in the writer while the bounded
    copy waits for it to drain a round: the save fails by name, it does not hang."""
    state = {"model": torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))}
    bcp.save(str(tmp_path / "a"), state, async_save=True, staging_max_bytes=128 << 10,
             chunk_bytes=16 << 10).wait(timeout=60)
    handle = bcp.save(str(tmp_path / "a"), state, async_save=True, staging_max_bytes=128 << 10,
                      chunk_bytes=16 << 10)
    with pytest.raises(bcp.CheckpointExistsError):
        handle.wait(timeout=60)


def test_many_small_tensors_through_a_small_ring_are_exact(tmp_path, monkeypatch):
    """600 small tensors of odd sizes and three dtypes through a 256 KiB ring: copied segments
    reach the writers in groups (the GPU test's workload, where each group has one event),
    many groups per save, and every byte lands where it belongs. That a group is handed over
    before the copy waits for ring memory is tested in tests/unit/test_staging_ring.py."""
    monkeypatch.setenv("BCP_SNAPSHOT_WRITE_THROUGH", "0")  # overlapped goes through the arena too
    staging.release_pools()
    g = torch.Generator().manual_seed(11)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    sizes = [1 + (i * 7919) % 6000 for i in range(600)]

    def module(fill: bool) -> torch.nn.Module:
        m = torch.nn.Module()
        for i, n in enumerate(sizes):
            t = torch.randn(n, generator=g) if fill else torch.zeros(n)
            m.register_buffer(f"t{i}", t.to(dtypes[i % 3]))
        return m

    saved = module(fill=True)
    cap = 256 << 10
    assert sum(t.numel() * t.element_size() for t in saved.buffers()) > 10 * cap
    for snapshot in ("blocking", "overlapped"):
        root = str(tmp_path / snapshot)
        result = bcp.save(root, {"model": saved}, async_save=True, snapshot=snapshot,
                          staging_max_bytes=cap).wait(timeout=120)
        assert 0 < result.staging_bytes <= cap
        into = module(fill=False)
        bcp.load(root, {"model": into})
        differs = [k for k, v in saved.state_dict().items() if not same_bits(v, into.state_dict()[k])]
        assert differs == [], differs[:5]
