"""A load fills every element of every target exactly once, or fails with a named error.

Before, a metadata whose box covered half a tensor loaded "successfully" with the other rows
left as they were; a flipped bit in a byte offset made two reads share a key so a whole weight
was skipped; a flipped per-rank object rank made the extra state be skipped silently. And
checkpoints written by an earlier release (format 1, no metadata checksum) keep loading.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import bytecheckpoint as bcp
from bytecheckpoint.commit.integrity import verify
from bytecheckpoint.errors import CorruptCheckpointError, MissingKeysError
from bytecheckpoint.format.metadata import FORMAT_VERSION
from tests.support.make_format_fixture import build
from tests.unit.test_hostile_metadata import (
    GRID,
    box_rows,
    column,
    dim_start,
    grid_state,
    obj,
    read_doc,
    set_column,
    write_doc,
)

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")


@pytest.fixture
def ckpt(tmp_path) -> str:
    path = str(tmp_path / "ckpt")
    bcp.save(path, grid_state(GRID.clone()), framework="manual", step=3)
    return path


def test_a_box_covering_half_a_tensor_is_refused_not_loaded_half(ckpt):
    doc = read_doc(ckpt)
    _, b = box_rows(doc, "grid/w")
    # The second box now claims rows 2..3 of a (4, 6) tensor but is stored as one row: its
    # bytes and checksums are consistent, row 3 was never saved.
    lengths, blen = column(doc, "lengths"), column(doc, "byte_length")
    lengths[dim_start(doc)[b]] = 1
    blen[b] //= 2
    set_column(doc, "lengths", lengths)
    set_column(doc, "byte_length", blen)
    write_doc(ckpt, doc)
    state = grid_state(torch.full((4, 6), -1.0))
    with pytest.raises(CorruptCheckpointError, match=r"'grid/w' cover 18 of its 24 elements"):
        bcp.load(ckpt, state, framework="manual")
    with pytest.raises(CorruptCheckpointError, match="part of it was never saved"):
        bcp.load(ckpt, state, framework="manual", verify=False)


def test_a_flipped_byte_offset_never_skips_a_weight(ckpt):
    doc = read_doc(ckpt)
    a, b = box_rows(doc, "grid/w")
    off = column(doc, "byte_offset")
    off[b] = off[a]  # the other box's offset (one flipped bit away in the original report)
    set_column(doc, "byte_offset", off)
    write_doc(ckpt, doc)
    for verify_ in (True, False):
        with pytest.raises(CorruptCheckpointError, match="share bytes"):
            bcp.load(ckpt, grid_state(torch.full((4, 6), -1.0)), framework="manual", verify=verify_)


def test_a_flipped_object_rank_is_an_error_not_skipped_state(ckpt):
    doc = read_doc(ckpt)
    obj(doc, "extra_state")[1] = 1  # saved by a world of 1: rank 1 does not exist
    write_doc(ckpt, doc)
    model, optim, extra = build()
    with pytest.raises(CorruptCheckpointError, match="rank of object 'extra_state' is 1"):
        bcp.load(ckpt, {"model": model, "optimizer": optim, "extra_state": extra,
                        "grid": grid_state(GRID.clone())["grid"]}, framework="manual")


def test_per_rank_state_missing_for_the_rank_it_is_taken_from_is_a_missing_key(ckpt):
    """A world of 2 whose only per-rank extra state is rank 1's (only rank 1 saved it): a
    load into 1 rank takes it from rank 0, which has none. Before any check the extra state
    was left as it was, silently; then it was called a damaged checkpoint, though a save
    writes it so. It is a missing key: strict loads refuse it, others report it."""
    doc = read_doc(ckpt)
    doc["world_size"] = 2
    obj(doc, "extra_state")[1] = 1
    write_doc(ckpt, doc)
    model, optim, _ = build()
    extra = {"step": -1}
    state = {"model": model, "optimizer": optim, "extra_state": extra,
             "grid": grid_state(GRID.clone())["grid"]}
    with pytest.raises(MissingKeysError, match="missing from the checkpoint: extra_state"):
        bcp.load(ckpt, state, framework="manual")
    result = bcp.load(ckpt, state, framework="manual", strict=False)
    assert result.missing_keys == ["extra_state"] and extra == {"step": -1}


def test_a_good_checkpoint_still_fills_every_element(ckpt):
    state = grid_state(torch.full((4, 6), -1.0))
    bcp.load(ckpt, state, framework="manual")
    assert torch.equal(torch.cat([s.data for s in state["grid"]["w"]]), GRID)


@pytest.mark.parametrize("fixture, checksummed", [("format_v1", False), ("format_v2", True),
                                                   ("format_v3", True), ("format_v4", True)])
def test_checkpoints_of_earlier_releases_still_load(tmp_path, fixture, checksummed):
    """Fixtures written by ``tests/support/make_format_fixture.py``: ``format_v1`` at 9cf57f0,
    the release before metadata checksums; ``format_v2`` at b1aed9c, the last commit before the
    package moved into layers (``tests/make_format_fixture.py`` then); ``format_v3``, the first
    with padding entries that align the pieces; ``format_v4``, the first to place large pieces
    for direct writes (its header padded to the direct alignment; its pieces are too small to
    be placed). Each loads bit-exactly and verifies clean."""
    src = os.path.join(FIXTURES, fixture)
    root = str(tmp_path / fixture)
    shutil.copytree(src, root)
    with open(os.path.join(root, "ckpt", "metadata.msgpack"), "rb") as f:
        assert f.read(8).startswith(b"BCPMETA") == checksummed  # really that format
    model, optim, _ = build()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.0)
    extra: dict = {}
    result = bcp.load(f"{root}/ckpt", {"model": model, "optimizer": optim, "extra_state": extra})
    want = load_file(os.path.join(root, "expected.safetensors"))
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[f"model.{k}"]), k
    for i, p in enumerate(model.parameters()):
        assert torch.equal(optim.state[p]["momentum_buffer"], want[f"momentum.{i}"])
    with open(os.path.join(root, "expected.json")) as f:
        expected = json.load(f)
    assert {**extra, "ids": list(extra["ids"])} == expected["extra_state"]
    assert result.step == expected["step"] == 3
    assert verify(f"{root}/ckpt") == []
    assert bcp.load(root, {"model": model, "optimizer": optim, "extra_state": {}}).step == 3  # via latest


def test_resaving_a_format_1_checkpoint_writes_the_current_format(tmp_path):
    shutil.copytree(os.path.join(FIXTURES, "format_v1"), tmp_path / "v1")
    model, optim, _ = build()
    extra: dict = {}
    bcp.load(str(tmp_path / "v1" / "ckpt"), {"model": model, "optimizer": optim, "extra_state": extra})
    bcp.save(str(tmp_path / "again"), {"model": model, "optimizer": optim, "extra_state": extra})
    with open(tmp_path / "again" / "metadata.msgpack", "rb") as f:
        assert f.read(8) == b"BCPMETA\x00"
    assert read_doc(str(tmp_path / "again"))["version"] == FORMAT_VERSION == 4
