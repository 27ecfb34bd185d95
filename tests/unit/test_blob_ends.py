"""``torch_zip.BlobEnds``: the heads and zip directories of a DCP file's blobs read in a few
coalesced requests. Every byte it hands out is the file's, a failed request falls back to the
blob's own reads, and a translation made with it equals one made blob by blob. And a fuzzer
over every byte of a DCP blob that is not tensor data: exact values or a named error."""

from __future__ import annotations

import io
import os
import shutil
import warnings
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import bytecheckpoint as bcp
from bytecheckpoint.errors import CheckpointError
from bytecheckpoint.interop import dcp_load
from bytecheckpoint.interop.dcp_metadata import parse_dcp_metadata
from bytecheckpoint.interop.torch_zip import BlobEnds, TorchBlobError, locate_tensor
from bytecheckpoint.storage.local import LocalStorage
from tests.fuzz.strategies import fuzz_settings


class CountingStorage(LocalStorage):
    def __init__(self) -> None:
        super().__init__(fsync=False)
        self.reads = 0

    def read_into(self, path, offset, buffer):  # type: ignore[no-untyped-def]
        self.reads += 1
        return super().read_into(path, offset, buffer)


def _many_small_tensors(root: str) -> None:
    state = {f"layer{i}.w{j}": torch.randn(40, 40) for i in range(40) for j in range(3)}
    state["big"] = torch.randn(512, 512)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=root, no_dist=True)


def _chunks(root: str):
    with open(os.path.join(root, ".metadata"), "rb") as f:
        meta = parse_dcp_metadata(f.read(), source=root)
    return meta, [c for t in meta.tensors.values() for c in t.chunks]


def test_a_file_of_small_blobs_is_read_in_a_few_requests_with_the_same_translation(tmp_path):
    root = str(tmp_path / "dcp")
    _many_small_tensors(root)
    meta, chunks = _chunks(root)
    storage = CountingStorage()
    blob_by_blob = [locate_tensor(storage, os.path.join(root, c.file), c.offset, c.length, source="x")
                    for c in chunks]
    alone = storage.reads
    assert alone >= 2 * len(chunks)  # a head and a directory each

    storage.reads = 0
    ends = {f: BlobEnds(storage, os.path.join(root, f), [(c.offset, c.length) for c in chunks if c.file == f])
            for f in {c.file for c in chunks}}
    together = [locate_tensor(storage, os.path.join(root, c.file), c.offset, c.length, source="x",
                              ends=ends[c.file]) for c in chunks]
    assert together == blob_by_blob
    # 121 blobs: the small ones' ends are one request, the large one's head and directory two
    assert storage.reads <= 4, storage.reads

    class NoEnds(BlobEnds):
        def get(self, offset: int, n: int) -> bytes | None:
            return None

    translated = dcp_load.translate(storage, root, meta, source=root)[0]
    try:  # the same metadata, byte for byte, as a translation whose blobs read their own ends
        dcp_load.BlobEnds = NoEnds  # type: ignore[misc]
        assert dcp_load.translate(storage, root, meta, source=root)[0].to_bytes() == translated.to_bytes()
    finally:
        dcp_load.BlobEnds = BlobEnds  # type: ignore[misc]


def test_a_request_that_fails_falls_back_to_the_blobs_own_reads(tmp_path):
    root = str(tmp_path / "dcp")
    _many_small_tensors(root)
    _, chunks = _chunks(root)
    name = chunks[0].file
    path = os.path.join(root, name)
    size = os.path.getsize(path)
    mine = [(c.offset, c.length) for c in chunks if c.file == name]
    storage = CountingStorage()
    # a blob claimed past the end of the file, next to the real ones: their shared request fails
    ends = BlobEnds(storage, path, mine + [(size - 100, 10_000)])
    assert ends.get(size - 100, 10) is None
    for c in chunks:
        if c.file == name:
            assert locate_tensor(storage, path, c.offset, c.length, source="x", ends=ends) == \
                locate_tensor(storage, path, c.offset, c.length, source="x")


def test_only_the_ends_are_held(tmp_path):
    """Blobs of 40 KiB, read in merged requests: what stays in memory is their ends (at most
    three 4 KiB blocks a blob), not the bytes between them."""
    path = str(tmp_path / "f")
    data = os.urandom(200 * 40_960)
    with open(path, "wb") as f:
        f.write(data)
    blobs = [(i * 40_960, 40_960) for i in range(200)]
    storage = CountingStorage()
    ends = BlobEnds(storage, path, blobs)
    assert storage.reads <= 2  # 8 MB of blobs, at most 8 MiB a request
    assert ends.held_bytes <= 3 * 4096 * len(blobs) < len(data) // 3
    for start, length in blobs:
        assert ends.get(start, 4096) == data[start : start + 4096]
        assert ends.get(start + length - 8192, 8192) == data[start + length - 8192 : start + length]
        assert ends.get(start + 4096, 8192) is None  # the middle was read, and let go


@settings(max_examples=60, deadline=None)
@given(blobs=st.lists(st.tuples(st.integers(0, 40_000), st.integers(1, 20_000)), min_size=1, max_size=12),
       queries=st.lists(st.tuples(st.integers(0, 70_000), st.integers(1, 9_000)), min_size=1, max_size=20),
       gap=st.sampled_from([0, 512, 64 << 10]))
def test_every_byte_handed_out_is_the_files(tmp_path_factory, blobs, queries, gap):
    path = str(tmp_path_factory.mktemp("ends") / "f")
    data = os.urandom(50_000)  # shorter than some blobs claim: their requests fail
    with open(path, "wb") as f:
        f.write(data)
    ends = BlobEnds(LocalStorage(fsync=False), path, blobs, gap=gap, max_read=16_384)
    for offset, n in queries:
        got = ends.get(offset, n)
        assert got is None or got == data[offset : offset + n]


@pytest.fixture(scope="module")
def small_dcp(tmp_path_factory):
    """A DCP checkpoint of a small model, and every byte of its blobs that is no tensor data
    (zip headers, pickles, directories): bytes a flip there must be caught in, or harmless."""
    root = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 24), nn.Linear(24, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict()}, checkpoint_id=root, no_dist=True)
    _, chunks = _chunks(root)
    storage = LocalStorage(fsync=False)
    outside: list[tuple[str, int]] = []
    for c in chunks:
        loc = locate_tensor(storage, os.path.join(root, c.file), c.offset, c.length, source="x")
        outside += [(c.file, i) for i in range(c.offset, c.offset + c.length)
                    if not loc.offset <= i < loc.offset + loc.length]
    return root, {k: v.clone() for k, v in model.state_dict().items()}, outside


@fuzz_settings(80)  # BCP_FUZZ_PROFILE=long: 5,000
@given(pick=st.integers(0, 2**31), mask=st.integers(1, 255))
def test_a_flipped_byte_outside_the_tensor_data_loads_exactly_or_is_refused_by_name(
        small_dcp, tmp_path_factory, pick, mask):
    """DCP stores no checksums, so a flipped tensor byte cannot be caught by anyone; every
    other byte of a blob is structure, read through the coalesced ends: a flip there gives the
    saved values exactly or a named error, never other values or a raw exception."""
    root, saved, outside = small_dcp
    copy = str(tmp_path_factory.mktemp("flip") / "ckpt")
    shutil.copytree(root, copy)
    name, at = outside[pick % len(outside)]
    with open(os.path.join(copy, name), "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ mask]))
    model = nn.Sequential(nn.Linear(24, 24), nn.Linear(24, 8))
    try:
        bcp.load(copy, {"model": model})
    except CheckpointError:
        return
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in saved.items()), f"byte {at} of {name}: other values"


@pytest.mark.parametrize("mask", [0x01, 0x40, 0xC0])
def test_a_flipped_extra_field_length_is_refused_not_read_from_a_shifted_place(small_dcp, tmp_path, mask):
    """The local header's extra-field length places a record's bytes. Flipped by a multiple of
    64 it keeps torch.save's alignment, and the tensor would be read shifted, with no checksum
    to notice (found by the fuzzer above: a flip at byte 28 of a data record's header)."""
    root, _, _ = small_dcp
    copy = str(tmp_path / "ckpt")
    shutil.copytree(root, copy)
    _, chunks = _chunks(copy)
    c = chunks[0]
    path = os.path.join(copy, c.file)
    with open(path, "rb") as f:
        f.seek(c.offset)
        blob = f.read(c.length)
    header = next(i.header_offset for i in zipfile.ZipFile(io.BytesIO(blob)).infolist()
                  if i.filename.endswith("/data/0"))
    with open(path, "r+b") as f:
        f.seek(c.offset + header + 28)  # the low byte of the extra field's length
        byte = f.read(1)[0]
        f.seek(c.offset + header + 28)
        f.write(bytes([byte ^ mask]))
    with pytest.raises(TorchBlobError, match="malformed extra field"):
        bcp.load(copy, {"model": nn.Sequential(nn.Linear(24, 24), nn.Linear(24, 8))})
