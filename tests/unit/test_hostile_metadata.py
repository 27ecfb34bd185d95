"""Hostile and damaged metadata: each corruption of a real saved checkpoint ends in a named
error (never wrong data, a raw traceback, a crash or a huge allocation).

Mutations re-seal the metadata with a correct checksum, as an attacker (or a buggy tool)
would, so the checks behind the checksum are the ones tested; one test flips bits without
re-sealing. Single process, small files: the whole module runs in seconds.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import xxhash

import bytecheckpoint as bcp
from bytecheckpoint.commit.integrity import verify
from bytecheckpoint.errors import CorruptCheckpointError, UnsafeCheckpointError
from bytecheckpoint.format import codec
from bytecheckpoint.format.metadata import METADATA_FILE, CheckpointMetadata, pack_document, unpack_document
from bytecheckpoint.state.tensor_shard import TensorShard
from bytecheckpoint.tools.export import export_safetensors
from tests.support.helpers import env_set
from tests.support.make_format_fixture import build

GRID = torch.arange(24, dtype=torch.float32).reshape(4, 6)


def grid_state(values: torch.Tensor) -> dict[str, Any]:
    """A (4, 6) tensor saved as two boxes (rows 0-1 and 2-3), beside a small model."""
    model, optim, extra = build()
    halves = [TensorShard(values[:2], (4, 6), (0, 0)), TensorShard(values[2:], (4, 6), (2, 0))]
    return {"model": model, "optimizer": optim, "extra_state": extra, "grid": {"w": halves}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("hostile") / "ckpt")
    bcp.save(path, grid_state(GRID.clone()), framework="manual", step=3)
    return path


@pytest.fixture
def ckpt(saved, tmp_path) -> str:
    path = str(tmp_path / "ckpt")
    shutil.copytree(saved, path)
    return path


def read_doc(path: str) -> dict[str, Any]:
    with open(os.path.join(path, METADATA_FILE), "rb") as f:
        return unpack_document(f.read())


def write_doc(path: str, doc: dict[str, Any]) -> None:
    with open(os.path.join(path, METADATA_FILE), "wb") as f:
        f.write(pack_document(doc))


def load_fresh(path: str, **kwargs: Any) -> dict[str, Any]:
    state = grid_state(torch.full((4, 6), -1.0))
    bcp.load(path, state, framework="manual", **kwargs)
    return state


def column(doc: dict[str, Any], name: str, dtype: str = "<i8") -> np.ndarray:
    return np.frombuffer(doc["boxes"][name], dtype=dtype).copy()


def set_column(doc: dict[str, Any], name: str, values: np.ndarray, dtype: str = "<i8") -> None:
    doc["boxes"][name] = np.ascontiguousarray(values, dtype=dtype).tobytes()


def tensor_index(doc: dict[str, Any], key: str) -> int:
    return doc["tensors"]["key"].index(key)


def box_rows(doc: dict[str, Any], key: str) -> list[int]:
    t = np.frombuffer(doc["boxes"]["tensor"], dtype="<i4")
    return np.flatnonzero(t == tensor_index(doc, key)).tolist()


def dim_start(doc: dict[str, Any]) -> np.ndarray:
    tensor = np.frombuffer(doc["boxes"]["tensor"], dtype="<i4")
    nd = np.frombuffer(doc["tensors"]["ndim"], dtype="<i4")[tensor]
    return np.concatenate([[0], np.cumsum(nd)[:-1]]).astype(np.int64)


def obj(doc: dict[str, Any], key: str) -> list[Any]:
    return next(o for o in doc["objects"] if o[0] == key)


# -- mutations: (id, mutate(doc), pattern the error message must match) --------------------------

def _grid_rows(doc: dict[str, Any]) -> tuple[int, int, np.ndarray]:
    a, b = box_rows(doc, "grid/w")
    return a, b, dim_start(doc)


def half_covered(doc):  # the second box shrinks to one row: one row of the tensor never saved
    _, b, ds = _grid_rows(doc)
    lengths, blen = column(doc, "lengths"), column(doc, "byte_length")
    lengths[ds[b]] = 1
    blen[b] //= 2
    set_column(doc, "lengths", lengths)
    set_column(doc, "byte_length", blen)


def overlapping_boxes(doc):  # rows 0-1 and 1-2: as many elements as the tensor, row 3 missing
    _, b, ds = _grid_rows(doc)
    offsets = column(doc, "offsets")
    offsets[ds[b]] = 1
    set_column(doc, "offsets", offsets)


def shared_byte_offset(doc):  # one flipped bit in byte_offset: two boxes read the same bytes
    a, b, _ = _grid_rows(doc)
    off = column(doc, "byte_offset")
    off[b] = off[a]
    set_column(doc, "byte_offset", off)


def box_outside_shape(doc):
    _, b, ds = _grid_rows(doc)
    offsets = column(doc, "offsets")
    offsets[ds[b]] = 3
    set_column(doc, "offsets", offsets)


def overflowing_offset(doc):
    _, b, ds = _grid_rows(doc)
    offsets = column(doc, "offsets")
    offsets[ds[b]] = 2**63 - 1
    set_column(doc, "offsets", offsets)


def negative_offset(doc):
    _, b, ds = _grid_rows(doc)
    offsets = column(doc, "offsets")
    offsets[ds[b] + 1] = -6
    set_column(doc, "offsets", offsets)


def wrong_byte_length(doc):
    a, _, _ = _grid_rows(doc)
    blen = column(doc, "byte_length")
    blen[a] += 4
    set_column(doc, "byte_length", blen)


def bytes_past_file_end(doc):
    a, _, _ = _grid_rows(doc)
    off = column(doc, "byte_offset")
    off[a] = 2**62
    set_column(doc, "byte_offset", off)


def object_rank_flipped(doc):
    obj(doc, "extra_state")[1] = 1  # world size 1: rank 1 does not exist


def object_negative_length(doc):
    obj(doc, "extra_state")[4] = -5


def object_huge_length(doc):
    entry = obj(doc, "extra_state")
    entry[4] = 1_387_069_440  # the 1.29 GiB that verify used to allocate
    entry[5] = [0] * -(-entry[4] // doc["checksum"]["chunk_bytes"])


def object_no_checksums(doc):
    obj(doc, "extra_state")[5] = []


def object_twice(doc):
    doc["objects"].append(list(obj(doc, "extra_state")))


def unknown_dtype(doc):
    doc["tensors"]["dtype"][tensor_index(doc, "grid/w")] = "float33"


def dtype_not_a_string(doc):
    doc["tensors"]["dtype"][tensor_index(doc, "grid/w")] = ["float32"]


def huge_shape(doc):
    shape = np.frombuffer(doc["tensors"]["shape"], dtype="<i8").copy()
    shape[:] = 2**40
    doc["tensors"]["shape"] = shape.tobytes()


def duplicate_key(doc):
    keys = doc["tensors"]["key"]
    keys[tensor_index(doc, "grid/w")] = keys[-1]


def nan_created_at(doc):
    doc["created_at"] = float("nan")


def str_world_size(doc):
    doc["world_size"] = "1"


def huge_step(doc):
    doc["step"] = 2**64 - 1


def negative_chunk(doc):
    doc["checksum"]["chunk_bytes"] = -1


def file_name_climbs(doc):
    doc["files"][0][0] = "../../etc/passwd"


def file_name_slash(doc):
    doc["files"][0][0] = "sub/model.safetensors"


def file_name_nul(doc):
    doc["files"][0][0] = "model\x00.safetensors"


def file_name_newline(doc):
    doc["files"][0][0] = "model.safetensors\n"


def file_rank_too_big(doc):
    doc["files"][0][2] = 5


def deep_user_metadata(doc):
    nested: Any = 1
    for _ in range(5000):
        nested = [nested]
    doc["user_metadata"] = {"x": nested}


def ndim_too_big(doc):
    doc["tensors"]["ndim"] = np.full(len(doc["tensors"]["key"]), 1000, dtype="<i4").tobytes()


def columns_wrong_type(doc):
    doc["boxes"]["offsets"] = "not bytes"


def objects_not_a_list(doc):
    doc["objects"] = {"a": 1}


MUTATIONS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("half_covered", half_covered, r"'grid/w' cover 18 of its 24 elements"),
    ("overlapping_boxes", overlapping_boxes, r"two boxes of tensor 'grid/w' overlap"),
    ("shared_byte_offset", shared_byte_offset, r"two stored pieces share bytes"),
    ("box_outside_shape", box_outside_shape, r"'grid/w'.*lies outside its shape \(4, 6\)"),
    ("overflowing_offset", overflowing_offset, r"'grid/w'.*lies outside its shape"),
    ("negative_offset", negative_offset, r"'grid/w'.*lies outside its shape"),
    ("wrong_byte_length", wrong_byte_length, r"'grid/w' declares 52 bytes for 12 elements"),
    ("bytes_past_file_end", bytes_past_file_end, r"'grid/w'.*outside its storage file"),
    ("object_rank_flipped", object_rank_flipped, r"rank of object 'extra_state' is 1, not .* 0..0"),
    ("object_negative_length", object_negative_length, r"byte length of object 'extra_state' is -5"),
    ("object_huge_length", object_huge_length, r"object 'extra_state'.*outside its storage file"),
    ("object_no_checksums", object_no_checksums, r"'extra_state' has 0 checksums for 1 chunks"),
    ("object_twice", object_twice, r"'extra_state' is stored twice"),
    ("unknown_dtype", unknown_dtype, r"'grid/w' has unknown dtype 'float33'"),
    ("dtype_not_a_string", dtype_not_a_string, r"'grid/w' has unknown dtype \['float32'\]"),
    ("huge_shape", huge_shape, r"over 1152921504606846976 bytes"),
    ("duplicate_key", duplicate_key, r"is listed twice"),
    ("nan_created_at", nan_created_at, r"created_at is nan"),
    ("str_world_size", str_world_size, r"world_size is '1', not an integer"),
    ("huge_step", huge_step, r"step is 18446744073709551615"),
    ("negative_chunk", negative_chunk, r"checksum chunk size is -1"),
    ("file_name_climbs", file_name_climbs, r"'../../etc/passwd', which is not a plain file name"),
    ("file_name_slash", file_name_slash, r"not a plain file name"),
    ("file_name_nul", file_name_nul, r"not a plain file name"),
    ("file_name_newline", file_name_newline, r"not a plain file name"),
    ("file_rank_too_big", file_rank_too_big, r"rank of file .* is 5"),
    ("deep_user_metadata", deep_user_metadata, r"not a readable metadata file"),
    ("ndim_too_big", ndim_too_big, r"inconsistent sizes|1000 dimensions"),
    ("columns_wrong_type", columns_wrong_type, r"column boxes.offsets is 'not bytes'"),
    ("objects_not_a_list", objects_not_a_list, r"objects is \{'a': 1\}, not a list"),
]


def _pack_deep(doc: dict[str, Any]) -> bytes:
    # msgpack's own packer refuses 5000 levels; write the nesting by hand.
    nested_at = doc["user_metadata"].pop("x", None)
    depth = 0
    while isinstance(nested_at, list):
        nested_at, depth = nested_at[0], depth + 1
    body = msgpack.packb(doc, use_bin_type=True)
    marker = msgpack.packb({})
    assert marker in body
    deep = msgpack.packb({"x": None})[:-1] + b"\x91" * depth + b"\x01"
    body = body.replace(msgpack.packb("user_metadata") + marker, msgpack.packb("user_metadata") + deep, 1)
    return b"BCPMETA\x00" + xxhash.xxh3_128_digest(body) + body


@pytest.mark.parametrize("name,mutate,pattern", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_each_corruption_is_a_named_error_on_decode_load_verify_and_export(ckpt, tmp_path, name, mutate,
                                                                           pattern):
    doc = read_doc(ckpt)
    if name == "deep_user_metadata":
        doc["user_metadata"] = {}
        mutate(doc)
        raw = _pack_deep(doc)
        with open(os.path.join(ckpt, METADATA_FILE), "wb") as f:
            f.write(raw)
    else:
        mutate(doc)
        write_doc(ckpt, doc)
    error = UnsafeCheckpointError if name.startswith("file_name") else CorruptCheckpointError
    with pytest.raises(error, match=pattern):
        load_fresh(ckpt)
    with pytest.raises(error, match=pattern):
        verify(ckpt)
    with pytest.raises(error, match=pattern):
        export_safetensors(ckpt, str(tmp_path / "out"), model_key="model")
    assert not os.path.exists(tmp_path / "out")


def test_damaged_or_hostile_is_said_in_the_message(ckpt):
    doc = read_doc(ckpt)
    half_covered(doc)
    write_doc(ckpt, doc)
    with pytest.raises(CorruptCheckpointError, match="damaged or hostile"):
        load_fresh(ckpt)


def test_any_flipped_bit_in_the_metadata_is_caught(ckpt):
    with open(os.path.join(ckpt, METADATA_FILE), "rb") as f:
        raw = f.read()
    CheckpointMetadata.from_bytes(raw)
    for i in range(len(raw)):
        flipped = bytearray(raw)
        flipped[i] ^= 1 << (i % 8)
        with pytest.raises(CorruptCheckpointError):
            CheckpointMetadata.from_bytes(bytes(flipped))


def test_checksum_header_cannot_be_stripped_or_forged(ckpt):
    with open(os.path.join(ckpt, METADATA_FILE), "rb") as f:
        raw = f.read()
    with pytest.raises(CorruptCheckpointError, match="lacks the checksum header"):
        CheckpointMetadata.from_bytes(raw[24:])  # a version-2 document without its checksum
    with pytest.raises(CorruptCheckpointError, match="checksum does not match"):
        CheckpointMetadata.from_bytes(raw[:8] + bytes(16) + raw[24:])
    with pytest.raises(CorruptCheckpointError, match="checksum does not match"):
        CheckpointMetadata.from_bytes(raw[:20])  # truncated inside the header


def test_a_safetensors_header_edit_fails_load_and_verify(ckpt):
    """F32 -> I32 in a storage file's header keeps its length and every data checksum."""
    name = next(n for n in os.listdir(ckpt) if n.startswith("model-"))
    path = os.path.join(ckpt, name)
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = f.read(n)
        assert b'"F32"' in header
        f.seek(8)
        f.write(header.replace(b'"F32"', b'"I32"', 1))
    with pytest.raises(CorruptCheckpointError, match="header says .* I32"):
        load_fresh(ckpt)
    problems = verify(ckpt)
    assert len(problems) == 1 and "I32" in problems[0] and name in problems[0]
    load_fresh(ckpt, verify=False)  # verify=False skips the checks (docs/guide/quickstart.md says so)


def test_metadata_over_the_size_limit_is_refused_before_it_is_read(ckpt):
    with env_set({"BCP_METADATA_MAX_BYTES": "100"}):
        with pytest.raises(CorruptCheckpointError, match="over the limit of 100"):
            load_fresh(ckpt)


def test_declared_sizes_are_checked_against_real_files_before_allocating(ckpt, tmp_path):
    """A checkpoint of a few hundred bytes that declares a (2^24, 8) float32 tensor (512 MiB)
    stored in a file it says is that large: export and verify refuse it without allocating."""
    doc = read_doc(ckpt)
    t = tensor_index(doc, "model/0.weight")
    (row,) = box_rows(doc, "model/0.weight")
    fidx = int(column(doc, "file", "<i4")[row])
    shape = np.frombuffer(doc["tensors"]["shape"], dtype="<i8").copy()
    starts = np.concatenate([[0], np.cumsum(np.frombuffer(doc["tensors"]["ndim"], dtype="<i4"))[:-1]])
    shape[starts[t] : starts[t] + 2] = (2**24, 8)
    doc["tensors"]["shape"] = shape.tobytes()
    lengths = column(doc, "lengths")
    lengths[dim_start(doc)[row] : dim_start(doc)[row] + 2] = (2**24, 8)
    set_column(doc, "lengths", lengths)
    blen = column(doc, "byte_length")
    blen[row] = 2**24 * 8 * 4
    set_column(doc, "byte_length", blen)
    csum = np.frombuffer(doc["boxes"]["checksums"], dtype="<u8")
    n_before = sum(-(-int(x) // doc["checksum"]["chunk_bytes"]) for x in column(doc, "byte_length")[:row])
    extra = -(-blen[row] // doc["checksum"]["chunk_bytes"]) - 1
    csum = np.concatenate([csum[: n_before + 1], np.zeros(extra, dtype="<u8"), csum[n_before + 1 :]])
    doc["boxes"]["checksums"] = csum.astype("<u8").tobytes()
    # everything in the file moves up: the box is now the file's last piece, far past its end
    off = column(doc, "byte_offset")
    others = [i for i in range(len(off)) if int(column(doc, "file", "<i4")[i]) == fidx and i != row]
    off[row] = max([int(off[i] + column(doc, "byte_length")[i]) for i in others] + [int(off[row])]) + 64
    set_column(doc, "byte_offset", off)
    doc["files"][fidx][1] = int(off[row] + blen[row])
    write_doc(ckpt, doc)
    assert os.path.getsize(os.path.join(ckpt, METADATA_FILE)) < 4096
    with pytest.raises(CorruptCheckpointError, match="storage file is .* bytes but the metadata records"):
        export_safetensors(ckpt, str(tmp_path / "out"), model_key="model")
    problems = verify(ckpt)
    assert any("the metadata records" in p for p in problems)


def _nested_ext(levels: int) -> bytes:
    x = msgpack.packb(None)
    for _ in range(levels):
        x = msgpack.packb(msgpack.ExtType(1, msgpack.packb([msgpack.ExtType(1, x)])))
    return x


def test_deeply_nested_object_state_is_a_named_error_not_a_crash(ckpt):
    blob = _nested_ext(200)  # ~1.7 KB; crashed the process (SIGSEGV) before
    with pytest.raises(CorruptCheckpointError, match="nests deeper than"):
        codec.decode(blob)
    # The same blob as a checkpoint's extra state, its checksum made to match.
    doc = read_doc(ckpt)
    entry = obj(doc, "extra_state")
    fidx = next(i for i, f in enumerate(doc["files"]) if f[0] == entry[2])
    path = os.path.join(ckpt, entry[2])
    with open(path, "ab") as f:
        start = f.tell()
        f.write(blob)
    entry[3:6] = [start, len(blob), [xxhash.xxh3_64_intdigest(blob)]]
    doc["files"][fidx][1] = start + len(blob)
    write_doc(ckpt, doc)
    with pytest.raises(CorruptCheckpointError, match="nests deeper than"):
        load_fresh(ckpt, verify=False)  # past the header check, to reach the decoder


@pytest.mark.parametrize("blob,pattern", [
    (msgpack.packb(msgpack.ExtType(2, msgpack.packb(["float32", [2**40], b""]))), "holds only 0 bytes"),
    (msgpack.packb(msgpack.ExtType(2, msgpack.packb(["float32", [3], b"\x00" * 8]))), "has 8 bytes"),
    (msgpack.packb(msgpack.ExtType(2, msgpack.packb(["float32", "x", b""]))), "malformed shape"),
    (msgpack.packb(msgpack.ExtType(3, msgpack.packb(["O", [1], b"\x00" * 8]))), "dtype 'O'"),
    (msgpack.packb(msgpack.ExtType(3, msgpack.packb(["V8", [1], b"\x00" * 8]))), "dtype 'V8'"),
    (msgpack.packb(msgpack.ExtType(6, b"float33")), "unknown dtype"),
    (b"\x91" * 5000 + b"\xc0", "cannot be decoded"),
])
def test_hostile_object_values_are_named_errors(blob, pattern):
    with pytest.raises(CorruptCheckpointError, match=pattern):
        codec.decode(blob)


def test_untouched_copy_loads_bit_exactly(ckpt):
    state = load_fresh(ckpt)
    got = torch.cat([s.data for s in state["grid"]["w"]])
    assert torch.equal(got, GRID)
    assert verify(ckpt) == []


# -- the overlap check stays near-linear on real layouts and bounded on hostile ones -------------

def test_overlap_check_sweeps_the_dimension_a_layout_is_split_along():
    from bytecheckpoint.format.boxes import overlapping_tensors

    n = 4096  # one (1, n) row split into n column boxes: every box starts at row 0
    off = np.stack([np.zeros(n, dtype=np.int64), np.arange(n, dtype=np.int64)], axis=1)
    ln = np.ones((n, 2), dtype=np.int64)
    tensor = np.zeros(n, dtype=np.int64)
    assert not overlapping_tensors(tensor, off, ln, 1, max_pairs=16 * n).any()
    off[7, 1] = 6  # box 7 now covers column 6 again
    assert overlapping_tensors(tensor, off, ln, 1, max_pairs=16 * n).tolist() == [True]


def test_overlap_check_refuses_layouts_too_irregular_to_check_cheaply():
    from bytecheckpoint.format.boxes import TooIrregularError, overlapping_tensors

    k = 300  # tall strips in one quadrant, wide strips in the other: many candidates both ways
    tall = [((0, i), (k, 1)) for i in range(k)]
    wide = [((k + i, k), (1, k)) for i in range(k)]
    boxes = tall + wide
    off = np.array([b[0] for b in boxes], dtype=np.int64)
    ln = np.array([b[1] for b in boxes], dtype=np.int64)
    with pytest.raises(TooIrregularError):
        overlapping_tensors(np.zeros(len(boxes), dtype=np.int64), off, ln, 1, max_pairs=4 * len(boxes))
