"""Reads that start before the read plan is agreed (``load_pipeline.Prefetch``): a rank reads
what it needs of the files it wrote, so in a DDP load each rank reads exactly its own files,
the checkpoint is still read once in all, and a corrupt byte in a box read early is still
refused by name on every rank."""

from __future__ import annotations

import json
import os
import struct

from bytecheckpoint.commit.integrity import read_metadata, resolve
from tests.support import prefetch_workloads as pw
from tests.support import workloads as w
from tests.support.helpers import assert_same_state, payload_bytes


def _payload(path: str, name: str) -> tuple[int, int]:
    """(first payload byte, payload bytes) of one safetensors storage file; padding entries,
    which no load reads into a tensor, are not payload."""
    with open(os.path.join(path, name), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    padding = sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
                  if k.startswith("__padding__/"))
    return 8 + n, os.path.getsize(os.path.join(path, name)) - 8 - n - padding


def test_ddp_load_each_rank_reads_the_files_it_wrote_once(world, tmp_path):
    root = str(tmp_path / "ddp")
    saved = world(4).run(w.ddp_train_save, root, 2)
    storage, path = resolve(root)
    meta = read_metadata(storage, path)
    loaded = world(4).run(w.ddp_load, root)
    for r in loaded:
        assert_same_state(saved[0]["ref"], r["state"])
    own = [sum(_payload(path, f.name)[1] for f in meta.files if f.rank == rank) for rank in range(4)]
    assert [r["bytes_read"] for r in loaded] == own
    assert sum(own) == payload_bytes(path)


def test_a_corrupt_byte_in_a_box_read_early_is_refused_on_every_rank(world, tmp_path):
    root = str(tmp_path / "fsdp2")
    world(2).run(w.fsdp2_train_save, root, 1)
    storage, path = resolve(f"{root}/step_1")
    meta = read_metadata(storage, path)
    name = max((f for f in meta.files if f.rank == 1), key=lambda f: f.size).name
    start, size = _payload(path, name)
    with open(os.path.join(path, name), "r+b") as f:  # one byte in the middle of rank 1's data
        f.seek(start + size // 2)
        byte = f.read(1)
        f.seek(start + size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    outcomes = world(2).run(pw.fsdp2_load_outcome, f"{root}/step_1")
    assert outcomes[1].startswith("CorruptCheckpointError") and "checksum mismatch" in outcomes[1], outcomes
    assert outcomes[0].startswith("RankFailedError"), outcomes


def test_a_truncated_file_is_refused_by_its_check_on_every_rank_though_checked_in_the_background(
        world, tmp_path):
    root = str(tmp_path / "fsdp2")
    world(2).run(w.fsdp2_train_save, root, 1)
    storage, path = resolve(f"{root}/step_1")
    meta = read_metadata(storage, path)
    name = max((f for f in meta.files if f.rank == 0), key=lambda f: f.size).name
    os.truncate(os.path.join(path, name), os.path.getsize(os.path.join(path, name)) - 100)
    outcomes = world(2).run(pw.fsdp2_load_outcome, f"{root}/step_1")
    assert outcomes[0].startswith("CorruptCheckpointError") and "metadata records" in outcomes[0], outcomes
    assert outcomes[1].startswith("RankFailedError"), outcomes
