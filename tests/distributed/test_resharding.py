"""Load-time resharding across world sizes and frameworks, compared bit for bit.

Runs real process groups (gloo on CPU): FSDP2 on 4 ranks saved, then loaded on 2, 3 (uneven
shards), 1 process without a process group, and 4 again; DDP on 4 ranks saved and loaded
into FSDP2 on 2; DTensors with assorted placements on a 2x2 mesh loaded into other layouts.
Every test runs on each backend of ``storage_root`` (local disk, shared memory, S3 on moto).
"""

from __future__ import annotations

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.commit.integrity import read_metadata, resolve
from tests.support import workloads as w
from tests.support.helpers import assert_same_state, same_bits

STEPS = 3


@pytest.fixture(scope="module")
def fsdp2_ckpt(world, storage_root):
    root = storage_root("fsdp2")
    saved = world(4).run(w.fsdp2_train_save, root, STEPS)
    return root, saved


def test_fsdp2_save_writes_every_rank(fsdp2_ckpt):
    root, saved = fsdp2_ckpt
    storage, path = resolve(root)
    meta = read_metadata(storage, path)
    assert meta.world_size == 4 and meta.framework == "fsdp2" and meta.step == STEPS
    assert sorted(meta.bytes_per_rank()) == [0, 1, 2, 3]
    assert sum(r["bytes"] for r in saved) == meta.total_bytes == saved[0]["total"]


@pytest.mark.parametrize("n", [2, 3])
def test_fsdp2_4_ranks_to_n_ranks(world, fsdp2_ckpt, n):
    root, saved = fsdp2_ckpt
    results = world(n).run(w.fsdp2_load, root)
    for rank, r in enumerate(results):
        assert_same_state(saved[0]["ref"], r["state"])
        # Per-rank extra state comes from rank 0 when the world size changed.
        assert r["extra"] == {"step": STEPS, "rank": 0}, rank
        # ... and the load says so: the saved ranks' values differed ("rank").
        said = [m for m in r["warnings"] if "saved per rank with different values" in m]
        assert len(said) == 1 and "'extra_state'" in said[0] and "rank 0's" in said[0], r["warnings"]


def test_fsdp2_to_single_process_without_process_group(fsdp2_ckpt):
    root, saved = fsdp2_ckpt
    assert not torch.distributed.is_initialized()
    model, optim = w.make_plain(seed=77, lr=1e-4)
    result = bcp.load(root, {"model": model, "optimizer": optim})
    assert result.framework == "fsdp2" and result.missing_keys == []
    assert_same_state(saved[0]["ref"], w.full_state(model, optim))


def test_fsdp2_back_on_4_ranks_continues_identically(world, fsdp2_ckpt):
    root, saved = fsdp2_ckpt
    results = world(4).run(w.fsdp2_load, root, STEPS)
    for rank, (r, s) in enumerate(zip(results, saved)):
        assert_same_state(s["ref"], r["state"])
        assert r["extra"] == {"step": STEPS, "rank": rank}
        assert not [m for m in r["warnings"] if "saved per rank" in m]
        # Same data, same state: the next step's loss is the uninterrupted run's, exactly.
        assert r["next_loss"] == s["next_loss"]


def test_ddp_save_is_balanced_and_loads_into_fsdp2(world, storage_root):
    root = storage_root("ddp")
    saved = world(4).run(w.ddp_train_save, root, 2)
    storage, path = resolve(root)
    meta = read_metadata(storage, path)
    per_rank = meta.bytes_per_rank()
    assert sorted(per_rank) == [0, 1, 2, 3]
    mean = sum(per_rank.values()) / 4
    assert max(per_rank.values()) / mean <= 1.15, per_rank
    assert [r["bytes"] for r in saved] == [per_rank[i] for i in range(4)]
    # Each tensor is stored once: the checkpoint is no bigger than one replica (+ headers).
    replica = sum(t.nbytes for t in meta.tensors)
    assert replica <= meta.total_bytes < replica + 64 * 1024
    loaded = world(2).run(w.fsdp2_load, root, None, False)
    for r in loaded:
        assert_same_state(saved[0]["ref"], r["state"])


@pytest.fixture(scope="module")
def dtensor_root(world, storage_root):
    root = storage_root("dtensor")
    world(4).run(w.dtensor_save, root)
    return root


@pytest.mark.parametrize("layout,n", [("shard_last", 3), ("mixed", 2), ("replicate", 4)])
def test_dtensor_placements_reshard(world, dtensor_root, layout, n):
    root = dtensor_root
    for rank_result in world(n).run(w.dtensor_load, root, layout):
        for name, shape, _ in w.DTENSOR_CASES:
            assert same_bits(rank_result[name], w.reference_tensor(name, shape)), name


def test_dtensor_checkpoint_loads_into_plain_tensors(dtensor_root):
    root = dtensor_root
    module = torch.nn.Module()
    for name, shape, _ in w.DTENSOR_CASES:
        module.register_parameter(name, torch.nn.Parameter(torch.zeros(shape)))
    bcp.load(f"{root}/dtensor", {"model": module})
    for name, shape, _ in w.DTENSOR_CASES:
        assert same_bits(getattr(module, name).detach(), w.reference_tensor(name, shape)), name
