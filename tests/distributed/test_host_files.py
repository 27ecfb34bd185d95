"""One storage file per host and kind (``save(..., files_per="host")``): 4 ranks as 2 hosts of
2. File counts and owners, bit-for-bit loads into the same layout and into 2 ranks, the plan
cache, async saves, failures on members and leaders, verify, and each byte read once."""

from __future__ import annotations

import os
import uuid
from collections import Counter

import pytest
import torch
from safetensors import safe_open

import bytecheckpoint as bcp
from bytecheckpoint.commit.integrity import read_metadata, resolve
from tests.support import host_files_workloads as hw
from tests.support import save_workloads as sw
from tests.support import workloads as w
from tests.support.helpers import assert_changed_structure_loads, assert_same_state, payload_bytes, same_bits
from tests.support.servers import s3_root

# 2 hosts: exactly 2 files per kind
HOST_FILES = [f"{k}-h{h:05d}.safetensors" for k in ("extra", "model", "optim") for h in (0, 1)]


def _same_tensors(ref: dict, got: dict) -> None:
    assert sorted(ref) == sorted(got)
    for key, value in ref.items():
        assert same_bits(value, got[key]), key


def _storage_files(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))


def _check_host_layout(path: str) -> None:
    names = _storage_files(path)
    assert names == HOST_FILES
    meta = read_metadata(*resolve(path))
    assert sorted(f.name for f in meta.files) == names
    assert {f.name: f.rank for f in meta.files} == {n: 0 if "h00000" in n else 2 for n in names}
    # Each per-rank object keeps its owner, and lies in its host's extra file.
    owners = {o.rank: o.bytes.file for o in meta.objects if o.rank is not None}
    assert owners == {r: f"extra-h{r // 2:05d}.safetensors" for r in range(4)}
    # A host file is a valid safetensors file holding both of its ranks' boxes.
    per_file = Counter(meta.files[i].name for i in meta.boxes.file.tolist())
    for name in names:
        with safe_open(os.path.join(path, name), "pt") as f:
            keys = [k for k in f.keys() if not k.startswith("__padding__/")]  # align the pieces
            assert len(keys) == per_file[name] + sum(o.bytes.file == name for o in meta.objects)
            assert all(f.get_tensor(k) is not None for k in keys)
    assert bcp.verify(path) == []  # the padding included


def test_host_files_sync_cached_and_async_load_bit_for_bit(world, tmp_path):
    root = str(tmp_path)
    results = world(4).run(hw.sync_cached_and_async, root)
    for rank, r in enumerate(results):
        assert r["cached"] == [False, True, True]  # planned, then from the plan cache
        assert r["files"] == [6, 6, 6]
        # Leaders write their host's bytes; members write nothing themselves.
        assert all((b > 0) == (rank % 2 == 0) for b in r["bytes_written"]), r["bytes_written"]
    for name in ("h1", "h2", "h3"):
        _check_host_layout(os.path.join(root, name))
        assert not bcp.verify(os.path.join(root, name))
    refs = {"h1": "ref1", "h2": "ref2", "h3": "ref3"}
    for name, ref in refs.items():  # the same layout: each rank gets its own object back
        for rank, got in enumerate(world(4).run(sw.load_step, root, name)):
            _same_tensors(results[0][ref], got["state"])
            assert got["extra"] == {"step": int(name[1:]), "rank": rank}
    for got in world(2).run(sw.load_step, root, "h1"):  # resharded onto 2 ranks
        _same_tensors(results[0]["ref1"], got["state"])
        assert got["extra"]["step"] == 1
    # The async checkpoint holds the values of the moment of the call, not the later ones.
    changed = results[0]["after_async"]
    assert any(not same_bits(results[0]["ref3"][k], changed[k]) for k in changed)
    assert not [n for n in os.listdir(root) if ".staging-" in n]
    _flip_a_members_byte_and_verify(os.path.join(root, "h1"))


def _flip_a_members_byte_and_verify(path: str) -> None:
    """Checksums cover the bytes a member streamed: a flipped byte there is reported."""
    meta = read_metadata(*resolve(path))
    model0 = next(i for i, f in enumerate(meta.files) if f.name == "model-h00000.safetensors")
    rows = [i for i, f in enumerate(meta.boxes.file.tolist()) if f == model0]
    last = max(rows, key=lambda i: int(meta.boxes.byte_offset[i]))  # rank 1's, after rank 0's
    offset = int(meta.boxes.byte_offset[last])
    with open(os.path.join(path, "model-h00000.safetensors"), "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    problems = bcp.verify(path)
    assert problems and all("model-h00000.safetensors" in p for p in problems), problems


def test_failures_on_members_and_leaders_reach_every_rank(world, tmp_path):
    root = str(tmp_path)
    results = world(4).run(hw.failures, root)
    for rank, r in enumerate(results):
        for case in ("member_mid_stream", "member_first_piece", "leader_write"):
            outcome, seconds = r[case]["outcome"], r[case]["seconds"]
            assert outcome[0] != "saved", (rank, case)
            assert seconds < 30, (rank, case, seconds)  # raised, not timed out
        assert r["member_mid_stream"]["outcome"][0] == ("OSError" if rank == 1 else "RankFailedError")
        assert "rank 1" in r["member_mid_stream"]["outcome"][1] or rank == 1
        assert r["member_first_piece"]["outcome"][0] == ("OSError" if rank == 3 else "RankFailedError")
        assert r["leader_write"]["outcome"][0] != "RankFailedError" or rank != 2
        assert r["after_files"] == 6
    for name in ("bad1", "bad2", "bad3"):
        assert not os.path.exists(os.path.join(root, name))
    assert not [n for n in os.listdir(root) if ".staging-" in n]
    # The checkpoints before and after the failures load bit for bit.
    for name, ref in (("good", "ref"), ("after", "after_ref")):
        _check_host_layout(os.path.join(root, name))
        for got in world(4).run(sw.load_step, root, name):
            _same_tensors(results[0][ref], got["state"])


def test_host_files_from_the_environment_and_each_byte_read_once(world, tmp_path):
    root = str(tmp_path / "ddp")
    env = {"BCP_FILES_PER": "host", "BCP_COMM_HOST_SIZE": "2"}
    saved = world(4).run(hw.with_env, env, "tests.support.workloads", "ddp_train_save", root, 2)
    storage, path = resolve(root)
    assert _storage_files(path) == HOST_FILES
    loaded = world(4).run(w.ddp_load, root)
    for r in loaded:
        assert_same_state(saved[0]["ref"], r["state"])
    per_rank = [r["bytes_read"] for r in loaded]
    # Every rank needs all of it; together they read it once, from the host files.
    assert sum(per_rank) == payload_bytes(path)
    assert max(per_rank) <= 1.3 * sum(per_rank) / 4, per_rank


def test_host_files_on_s3_streamed_in_many_blocks(world):
    """Object stores commit by writing the metadata last (no rename): the same host files.
    Members send in 2 KiB blocks of 512-byte checksum chunks, so large pieces cross many
    blocks, and every chunk's checksum must still line up."""
    root = s3_root("hf")
    ref = world(4).run(hw.save_once, root, 2048, 512)[0]
    meta = read_metadata(*resolve(f"{root}/h"))
    assert sorted(f.name for f in meta.files) == HOST_FILES
    assert meta.chunk_bytes == 512 and int(meta.boxes.byte_length.max()) > 4 * 2048
    assert not bcp.verify(f"{root}/h")
    for rank, got in enumerate(world(4).run(sw.load_step, root, "h")):
        _same_tensors(ref, got["state"])
        assert got["extra"] == {"step": 1, "rank": rank}


@pytest.mark.parametrize("async_save", [False, True])
def test_structure_change_on_one_host_replans_with_host_files(world, tmp_path, async_save):
    """Rank 1 alone adds a tensor: its cache misses, the others' hit, and with host files no
    rank writes before the world agrees, so every rank plans again and the save completes,
    async ones too (one file per rank fails an async save here: its hits wrote already)."""
    env = {"BCP_FILES_PER": "host", "BCP_COMM_HOST_SIZE": "2"}
    results = world(4).run(hw.with_env, env, "tests.support.save_workloads", "structure_changes_on_one_rank",
                           str(tmp_path), async_save)
    for r in results:
        assert r["second"] == ("saved", False)
    assert _storage_files(str(tmp_path / "second")) == [f"model-h0000{h}.safetensors" for h in (0, 1)]
    assert_changed_structure_loads(str(tmp_path))


def test_ranks_that_disagree_on_files_per_fail_by_name(world, tmp_path):
    """files_per="host" on some ranks and not others, by argument or by environment, whether
    the host-mode or the rank-mode ranks hit their plan caches: every rank raises an
    InvalidArgumentError naming files_per within seconds (a host-mode rank used to wait for
    its host forever), nothing is committed, and the agreed save after it loads bit for bit."""
    results = world(4).run(hw.files_per_differs, str(tmp_path))
    for name in ("planned", "hosts_hit", "ranks_hit", "environment"):
        for rank, r in enumerate(results):
            kind, message = r[name]["outcome"]
            assert kind == "InvalidArgumentError", (name, rank, r[name])
            assert "files_per" in message and "'host'" in message and "'rank'" in message, message
            assert r[name]["seconds"] < 30, (name, rank, r[name])
        assert not (tmp_path / name).exists(), name
    assert [r["agreed"]["outcome"] for r in results] == [("saved", False)] * 4
    assert [r["agreed_again"]["outcome"] for r in results] == [("saved", True)] * 4
    assert _storage_files(str(tmp_path / "agreed_again")) == HOST_FILES
    for got in world(4).run(sw.load_step, str(tmp_path), "agreed_again"):
        _same_tensors(results[0]["ref"], got["state"])
    assert sorted(os.listdir(tmp_path)) == ["agreed", "agreed_again", "hosts", "latest", "ranks"]


def test_single_process_host_files_and_bad_settings(tmp_path, monkeypatch):
    torch.manual_seed(0)
    src, dst = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    for root in (str(tmp_path / "one"), f"mem://hf-{uuid.uuid4().hex[:8]}/one"):
        bcp.save(root, {"model": src, "extra": {"n": 3}}, files_per="host", host_size=1)
        meta = read_metadata(*resolve(root))
        assert sorted(f.name for f in meta.files) == ["extra-h00000.safetensors", "model-h00000.safetensors"]
        extra: dict = {}
        bcp.load(root, {"model": dst, "extra": extra})
        assert same_bits(src.weight, dst.weight) and same_bits(src.bias, dst.bias) and extra == {"n": 3}
        torch.nn.init.zeros_(dst.weight)
    with pytest.raises(ValueError, match="files_per='sometimes'"):
        bcp.save(str(tmp_path / "x"), {"model": src}, files_per="sometimes")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("BCP_COMM_HOST_SIZE", raising=False)
    with pytest.raises(ValueError, match="host_size"):
        bcp.save(str(tmp_path / "y"), {"model": src}, files_per="host")
