"""Reads that start before the read plan is agreed (``load_pipeline.Prefetch``): a rank reads
what it needs of the files it wrote (in a DDP load exactly its own files: test_load_dedup),
and a corrupt byte in a box read early is still refused by name on every rank."""

from __future__ import annotations

import os

from bytecheckpoint.commit.integrity import read_metadata, resolve
from tests.support import prefetch_workloads as pw
from tests.support import workloads as w
from tests.support.helpers import file_payload


def test_a_corrupt_byte_in_a_box_read_early_is_refused_on_every_rank(world, tmp_path):
    root = str(tmp_path / "fsdp2")
    world(2).run(w.fsdp2_train_save, root, 1)
    storage, path = resolve(f"{root}/step_1")
    meta = read_metadata(storage, path)
    name = max((f for f in meta.files if f.rank == 1), key=lambda f: f.size).name
    start, size = file_payload(path, name)
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
