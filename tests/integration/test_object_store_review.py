"""Review of the object-store path (moto S3): the ``latest`` pointer under racing saves, torn
reads of it, and paths S3 cannot hold. Every test here failed before its fix."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.commit.protocol import LATEST_FILE, read_latest
from bytecheckpoint.errors import (
    CorruptCheckpointError,
    InvalidArgumentError,
    InvalidStorageURLError,
    NotACheckpointError,
)
from bytecheckpoint.format.metadata import METADATA_FILE
from bytecheckpoint.storage import open_storage
from bytecheckpoint.storage.config import TransferSettings
from bytecheckpoint.storage.s3 import MIN_PART_BYTES, S3Storage
from tests.support.servers import S3_BUCKET, s3_root


def _state(value: float) -> dict:
    return {"w": torch.full((4,), value)}


def _loaded(url: str) -> float:
    state = _state(0.0)
    bcp.load(url, state)
    return float(state["w"][0])


def _restored(root: str, step: int | None = None) -> tuple[int | None, float]:
    state = _state(0.0)
    with bcp.CheckpointManager(root, async_save=False) as mgr:
        got = mgr.restore(state, step=step)
    return got, float(state["w"][0])


def test_s3_a_latest_pointer_a_racing_save_left_behind_never_resumes_an_older_step():
    root = s3_root("race")
    with bcp.CheckpointManager(root, save_every_steps=1, async_save=False) as mgr:
        for step in (10, 20):
            mgr.save(step, _state(float(step)))
    # Two saves committed at once: step 10's PUT of the pointer lands after step 20's (S3 has no
    # conditional write, so neither saw the other's).
    storage, path = open_storage(root)
    stale = {"checkpoint": "step_10", "step": 10, "time": time.time()}
    storage.write_bytes(f"{path}/{LATEST_FILE}", json.dumps(stale).encode())

    assert _loaded(root) == 20.0  # was 10: the older checkpoint, silently
    assert _restored(root) == (20, 20.0)
    with bcp.CheckpointManager(root, async_save=False) as mgr:
        assert mgr.latest_step() == 20
        with pytest.raises(InvalidArgumentError, match="not after step 20"):
            mgr.save(15, _state(15.0), force=True)  # would hide behind step 20

    # A rollback still moves 'latest' back on purpose: step 11 on a timeline from step 10.
    state = _state(0.0)
    with bcp.CheckpointManager(root, save_every_steps=1, async_save=False) as mgr:
        assert mgr.restore(state, step=10) == 10
        mgr.save(11, _state(11.0))
    assert read_latest(storage, path).step == 11
    assert _loaded(root) == 11.0
    assert _restored(root) == (11, 11.0)


def test_s3_a_pointer_read_while_a_save_replaces_it_is_never_called_corrupt():
    storage, root = open_storage(s3_root("torn"))
    docs = [json.dumps({"checkpoint": name, "step": step, "time": 1.0}).encode()
            for name, step in (("step_9", 9), ("step_1000000", 1000000))]
    storage.write_bytes(f"{root}/{LATEST_FILE}", docs[0])
    stop = threading.Event()

    def replace_it() -> None:  # pointers of two lengths: a read sees one's size, the other's bytes
        i = 0
        while not stop.wait(0.05):  # a save every 50 ms (a read torn twice in a row needs two)
            i += 1
            doc = dict(json.loads(docs[i % 2]), time=float(i))  # a save's pointer is never the same
            storage.write_bytes(f"{root}/{LATEST_FILE}", json.dumps(doc).encode())

    writer = threading.Thread(target=replace_it)
    writer.start()
    seen, reads = set(), 0
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            seen.add(read_latest(storage, root).name)  # raised CorruptCheckpointError before
            reads += 1
    finally:
        stop.set()
        writer.join()
    assert seen <= {"step_9", "step_1000000"} and reads > 20

    # A damaged pointer still is refused: it reads the same bytes again.
    storage.write_bytes(f"{root}/{LATEST_FILE}", docs[1][:-3])
    with pytest.raises(CorruptCheckpointError, match="unreadable latest pointer"):
        read_latest(storage, root)


def test_s3_paths_s3_cannot_hold_are_refused_by_name_at_once():
    state = _state(0.0)
    for url in (f"s3://{S3_BUCKET}/run//step_1", f"s3://{S3_BUCKET}//run/step_1"):
        with pytest.raises(InvalidStorageURLError, match="no empty parts"):
            bcp.load(url, state)  # was pyarrow's ArrowInvalid inside a RankFailedError
        with pytest.raises(InvalidStorageURLError, match="no empty parts"):
            bcp.save(url, _state(1.0))
    t = time.monotonic()
    with pytest.raises(NotACheckpointError, match="whole bucket"):
        bcp.save(f"s3://{S3_BUCKET}", _state(1.0))  # was 6 retries, then "storage unreachable"
    assert time.monotonic() - t < 5


def test_s3_an_interrupted_metadata_upload_leaves_the_committed_metadata_in_place():
    storage, path = open_storage(s3_root("marker"))
    meta = f"{path}/ckpt/{METADATA_FILE}"
    storage.write_bytes(meta, b"the committed metadata")
    backend = S3Storage(transfer=TransferSettings(part_bytes=MIN_PART_BYTES, threads=2))
    writer = backend.open_writer(meta)  # an overwrite's new metadata, over one part long
    writer.write(os.urandom(MIN_PART_BYTES + 100))
    writer.abort()  # a KeyboardInterrupt here: pyarrow completed the parts sent, 5 MiB of it
    assert bytes(storage.read(meta)) == b"the committed metadata"
    data = f"{path}/ckpt/model-00000.safetensors"  # data files still stream, and still abort
    writer = backend.open_writer(data)
    writer.write(os.urandom(100))
    writer.abort()
    assert not storage.exists(data)
