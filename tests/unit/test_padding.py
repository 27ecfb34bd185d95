"""Padding entries (format version 3): the gaps that align pieces to 64 bytes in a storage file
are checked like the rest of it. A changed padding byte or entry is reported by name; a load
never reads the padding into a tensor."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bytecheckpoint as bcp
from bytecheckpoint.errors import CorruptCheckpointError
from bytecheckpoint.format.file_headers import DATA_ALIGN, PADDING_PREFIX
from bytecheckpoint.format.metadata import FORMAT_VERSION
from tests.fuzz import seal
from tests.support import workloads as w
from tests.support.helpers import assert_same_state


@pytest.fixture()
def saved(tmp_path):
    model, optim = w.make_plain(seed=3)
    w.train_step(model, optim, 0, 0)
    path = str(tmp_path / "c")
    bcp.save(path, {"model": model, "optimizer": optim})
    return path, w.full_state(model, optim)


def header_of(path: str) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def write_header(path: str, header: dict, data_start: int) -> None:
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= data_start - 8  # same length: every offset stays where it was
    raw += b" " * (data_start - 8 - len(raw))
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)


def a_padding(path: str) -> tuple[str, int, int, int]:
    """The optimizer file, the absolute byte range of one of its padding entries, and its data start."""
    f = os.path.join(path, "optim-00000.safetensors")
    start, header = header_of(f)
    name = next(k for k in header if k.startswith(PADDING_PREFIX))
    lo, hi = header[name]["data_offsets"]
    return f, start + lo, start + hi, start


def fresh_load(path: str, **kw) -> dict:
    model, optim = w.make_plain(seed=9, lr=1.0)
    bcp.load(path, {"model": model, "optimizer": optim}, **kw)
    return w.full_state(model, optim)


def test_a_changed_padding_byte_is_reported_by_verify_and_never_loaded(saved):
    path, ref = saved
    f, lo, hi, _ = a_padding(path)
    assert 0 < hi - lo < DATA_ALIGN
    with open(f, "r+b") as fh:
        fh.seek(lo + (hi - lo) // 2)
        fh.write(b"\x01")
    problems = bcp.verify(path)
    assert len(problems) == 1 and "padding" in problems[0] and "not zeros" in problems[0], problems
    assert_same_state(ref, fresh_load(path))  # the padding is no tensor's bytes


@pytest.mark.parametrize("edit, says", [
    (lambda e: e.update(dtype="I8"), "padding entry"),  # same length: offsets stay put
    (lambda e: e.update(shape=[e["shape"][0] + 1]), "padding entry"),
    (lambda e: e.update(data_offsets=[e["data_offsets"][0] - 1, e["data_offsets"][1]],
                        shape=[e["shape"][0] + 1]), "overlaps a piece"),  # still under 64 bytes
])
def test_an_altered_padding_entry_is_refused_by_name(saved, edit, says):
    path, _ = saved
    f, _, _, data_start = a_padding(path)
    _, header = header_of(f)
    name = next(k for k in header if k.startswith(PADDING_PREFIX))
    assert header[name]["shape"][0] < DATA_ALIGN - 1
    edit(header[name])
    write_header(f, header, data_start)
    with pytest.raises(CorruptCheckpointError, match=says):
        fresh_load(path)
    assert any(says in p for p in bcp.verify(path))


def test_a_renamed_padding_entry_is_refused_by_name(saved):
    """Found by the long fuzz run (seed 1126): a flipped bit turned ``__padding__/0`` into
    ``__padding__/8``; the entry still covered the same zeros, and verify passed the file."""
    path, _ = saved
    f, _, _, data_start = a_padding(path)
    _, header = header_of(f)
    first = f"{PADDING_PREFIX}0"
    header = {(f"{PADDING_PREFIX}99" if k == first else k): v for k, v in header.items()}
    write_header(f, header, data_start)
    with pytest.raises(CorruptCheckpointError, match="named '__padding__/99', not '__padding__/0'"):
        fresh_load(path)
    assert any("named '__padding__/99'" in p for p in bcp.verify(path))


def test_padding_in_a_checkpoint_that_says_format_2_is_an_unexpected_entry(saved):
    """Version 2 wrote no padding: there a padding entry is an entry the metadata lacks."""
    path, _ = saved
    meta_file = os.path.join(path, "metadata.msgpack")
    with open(meta_file, "rb") as fh:
        doc = seal.decode_doc(fh.read())
    assert doc["version"] == FORMAT_VERSION
    doc["version"] = 2
    with open(meta_file, "wb") as fh:
        fh.write(seal.encode_doc(doc))
    with pytest.raises(CorruptCheckpointError, match="header lists .* entries"):
        fresh_load(path)
    bcp.load(path, {"model": w.make_plain(seed=9)[0]}, strict=False, verify=False)  # the bytes are fine


class OddThenBig(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("a_odd", torch.arange(3, dtype=torch.uint8))  # 3 bytes
        self.b_big = torch.nn.Parameter(torch.randn(1 << 18))  # 1 MiB


def test_a_big_piece_after_an_odd_one_is_aligned_and_loads_bit_exact(tmp_path):
    model = OddThenBig()
    path = str(tmp_path / "odd")
    bcp.save(path, {"model": model})
    data_start, header = header_of(os.path.join(path, "model-00000.safetensors"))
    entries = sorted((v["data_offsets"], k) for k, v in header.items() if k != "__metadata__")
    assert [k.split("@")[0] for _, k in entries] == ["model/a_odd", f"{PADDING_PREFIX}0", "model/b_big"]
    (_, odd_end), _ = entries[0]
    (big, _), _ = entries[2]
    assert (data_start + odd_end) % DATA_ALIGN == 3 and (data_start + big) % DATA_ALIGN == 0
    back = OddThenBig()
    bcp.load(path, {"model": back})
    assert torch.equal(back.a_odd, model.a_odd) and torch.equal(back.b_big, model.b_big)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 200), st.integers(1000, 5000)), min_size=1, max_size=12),
       st.integers(1, 3).map(lambda k: 64 * k))
def test_any_sizes_give_a_valid_safetensors_file_with_large_pieces_aligned(tmp_path_factory, sizes, chunk):
    """Whatever the piece sizes: safetensors opens the file (no holes, no overlaps), every piece
    reads back exactly, every piece of 64 bytes or more starts on the boundary, padding is
    zeros under 64 bytes, and the header check accepts exactly the pieces written."""
    from safetensors import safe_open

    from bytecheckpoint.engine.files import Piece, write_file
    from bytecheckpoint.format.file_headers import header_problem
    from bytecheckpoint.storage.local import LocalStorage

    path = str(tmp_path_factory.mktemp("pad") / "f.safetensors")
    blobs = [bytes((i * 7 + j) % 251 for j in range(n)) for i, n in enumerate(sizes)]
    pieces = [Piece(f"p{i}", "U8", (len(b),), len(b), lambda b=b: memoryview(b)) for i, b in enumerate(blobs)]
    storage = LocalStorage(fsync=False)
    size, written = write_file(storage, path, pieces, chunk, {"format": "bytecheckpoint"})
    assert size == os.path.getsize(path)
    with open(path, "rb") as fh:
        data = fh.read()
    for piece, b in zip(written, blobs):
        assert data[piece.byte_offset : piece.byte_offset + piece.byte_length] == b
        assert len(b) < DATA_ALIGN or piece.byte_offset % DATA_ALIGN == 0
    with safe_open(path, "pt") as f:
        keys = list(f.keys())
        for k in keys:
            t = f.get_tensor(k)
            if k.startswith(PADDING_PREFIX):
                assert 0 < t.numel() < DATA_ALIGN and not t.any()
            else:
                assert bytes(t.numpy()) == blobs[int(k[1:])]
    assert sorted(k for k in keys if not k.startswith(PADDING_PREFIX)) == sorted(p.name for p in pieces)
    expected = [(at.byte_offset, at.byte_offset + at.byte_length, "U8", (at.byte_length,), (p.name,))
                for at, p in zip(written, pieces)]
    directory, name = os.path.split(path)
    assert header_problem(storage, directory, name, size, expected, 1 << 20) is None
    padded = any(k.startswith(PADDING_PREFIX) for k in keys)
    # as a version 2 file (no padding allowed), exactly the padded files fail
    as_v2 = header_problem(storage, directory, name, size, expected, 1 << 20, padding=0)
    assert (as_v2 is None) != padded


def test_a_hole_longer_than_any_padding_is_reported_without_reading_it():
    """Hostile metadata may place two pieces of a file any distance apart (the file made as
    large): verify names the hole instead of reading gigabytes of it to check for zeros."""
    from bytecheckpoint.commit.integrity import _padding_gaps
    from bytecheckpoint.format.metadata import ByteMeta
    from bytecheckpoint.storage.memory import MemoryStorage

    class NoReads(MemoryStorage):
        def read(self, path, offset, length):  # noqa: ANN001, ANN201
            raise AssertionError(f"read {length} bytes at {offset}")

    pieces = [ByteMeta("f", 0, 64, ()), ByteMeta("f", 64 + (1 << 40), 64, ())]
    before, problems = _padding_gaps(NoReads(), "ckpt", pieces, set(), 4096)
    assert len(problems) == 1 and "longer than any padding" in problems[0].message
    assert before == {}  # and nothing of it is left for the pieces' reads to check


class ManyOdd(torch.nn.Module):
    """Odd-sized buffers between larger ones: a file with many padding gaps."""

    def __init__(self) -> None:
        super().__init__()
        for i in range(12):
            self.register_buffer(f"b{i:02d}_odd", torch.arange(3 + i, dtype=torch.uint8))
            self.register_buffer(f"b{i:02d}_big", torch.full((100 + i,), i, dtype=torch.float32))


def test_verify_reads_each_padding_gap_with_the_piece_after_it(tmp_path, monkeypatch):
    """One storage request per piece, however many gaps a file has (on an object store a
    request per gap is a round trip each), and a changed byte in any gap is still named by its
    exact range."""
    from bytecheckpoint.storage.local import LocalStorage

    path = str(tmp_path / "many")
    bcp.save(path, {"model": ManyOdd()})
    f = os.path.join(path, "model-00000.safetensors")
    data_start, header = header_of(f)
    gaps = sorted(v["data_offsets"] for k, v in header.items() if k.startswith(PADDING_PREFIX))
    pieces = [k for k in header if k != "__metadata__" and not k.startswith(PADDING_PREFIX)]
    assert len(gaps) >= 10

    reads: list[tuple[int, int]] = []
    real_read = LocalStorage.read_into

    def counted(self, p, offset, buffer):  # noqa: ANN001, ANN202
        if p.endswith(".safetensors") and offset >= data_start:
            reads.append((offset, len(buffer)))
        return real_read(self, p, offset, buffer)

    monkeypatch.setattr(LocalStorage, "read_into", counted)
    assert bcp.verify(path) == []
    assert len(reads) == len(pieces), (len(reads), len(pieces))
    covered = sorted((o - data_start, o - data_start + n) for o, n in reads)
    for lo, hi in gaps:  # every gap lies inside a read
        assert any(a <= lo and hi <= b for a, b in covered), (lo, hi)

    lo, hi = gaps[len(gaps) // 2]
    with open(f, "r+b") as fh:
        fh.seek(data_start + hi - 1)
        fh.write(b"\x07")
    problems = bcp.verify(path)
    assert problems == [f"{f}: bytes {data_start + lo}..{data_start + hi} between two pieces (padding) "
                        "are not zeros: the file was altered"], problems


def test_duplicate_and_overlapping_pieces_give_each_gap_to_one_piece():
    """Hostile metadata that lists one piece twice, or pieces that overlap, must not make a
    gap checked (or reported) twice, nor invent a gap inside an overlap."""
    from bytecheckpoint.commit.integrity import _padding_gaps
    from bytecheckpoint.format.metadata import ByteMeta
    from bytecheckpoint.storage.memory import MemoryStorage

    pieces = [ByteMeta("f", 0, 64, ()), ByteMeta("f", 100, 64, ()), ByteMeta("f", 100, 64, ()),
              ByteMeta("f", 150, 64, ()), ByteMeta("g", 0, 10, ()), ByteMeta("g", 0, 0, ())]
    before, holes = _padding_gaps(MemoryStorage(), "ckpt", pieces, set(), 4096)
    assert holes == []
    assert before == {1: 64}  # 64..100 once, read with the first copy; 150 overlaps: no gap
