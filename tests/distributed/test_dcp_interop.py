"""Interoperability with PyTorch DCP: a DCP directory loads with ``bcp.load`` as it is, into any
layout, bit for bit; its pickled ``.metadata`` and values never run code here."""

from __future__ import annotations

import logging
import os
import pickle
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import bytecheckpoint as bcp
from bytecheckpoint.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from bytecheckpoint.interop.safe_pickle import UnsafePickleError
from tests.support import dcp_workloads as w
from tests.support.helpers import assert_same_state as assert_same
from tests.support.helpers import same_bits

STEPS = 2
EXTRA = {"step": STEPS, "name": "run-7", "sizes": [1, 2.5]}


@pytest.fixture(scope="module")
def dcp_fsdp2(world, tmp_path_factory) -> tuple[str, dict[str, Any]]:
    """FSDP2 + AdamW on 4 gloo ranks, saved by dcp.save(get_state_dict(...)) plus extra state."""
    path = str(tmp_path_factory.mktemp("dcp") / "fsdp2")
    ref = world(4).run(w.dcp_fsdp2_save, path, STEPS, EXTRA)[0]
    return path, ref


def test_dcp_fsdp2_loads_into_one_process(dcp_fsdp2):
    path, ref = dcp_fsdp2
    assert sorted(os.listdir(path)) == [".metadata", *(f"__{r}_0.distcp" for r in range(4))]
    got = w.bcp_plain_load(path, extra=True)
    assert_same(ref, got["canonical"])  # model, optimizer state and hyperparameters
    assert got["extra"] == EXTRA


def test_dcp_fsdp2_loads_into_fsdp2_on_3_ranks(world, dcp_fsdp2):
    path, ref = dcp_fsdp2
    for got in world(3).run(w.bcp_fsdp2_load, path):
        assert_same(ref, got)


def test_dcp_fsdp2_loads_into_tp2(world, dcp_fsdp2):
    path, ref = dcp_fsdp2
    for got in world(2).run(w.bcp_tp_load, path, 2):
        assert_same(ref, got)


# -- hostile input -------------------------------------------------------------------------------

class _WritesMarker:
    """Under the standard unpickler, creates ``path`` (stands for any code an attacker runs)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.makedirs, (self.path,))


def test_crafted_metadata_runs_no_code(tmp_path):
    ckpt, marker = tmp_path / "ckpt", str(tmp_path / "marker")
    ckpt.mkdir()
    raw = pickle.dumps(_WritesMarker(marker))
    (ckpt / ".metadata").write_bytes(raw)
    (ckpt / "__0_0.distcp").write_bytes(b"\0" * 64)
    with pytest.raises(UnsafePickleError, match=r"os\.makedirs.*refusing"):
        bcp.load(str(ckpt), {"model": nn.Linear(2, 2)})
    assert not os.path.exists(marker)
    pickle.loads(raw)  # the same bytes do run code under the standard unpickler
    assert os.path.exists(marker)


def test_code_inside_valid_metadata_is_refused(tmp_path):
    """The payload hidden in a field of an otherwise real DCP Metadata (planner_data)."""
    ckpt, marker = tmp_path / "ckpt", str(tmp_path / "marker")
    dcp.save({"model": nn.Linear(2, 2).state_dict()}, checkpoint_id=str(ckpt))
    meta = pickle.loads((ckpt / ".metadata").read_bytes())  # our own file: trusted here
    meta.planner_data["model.weight"] = _WritesMarker(marker)
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(UnsafePickleError, match=r"os\.makedirs"):
        bcp.load(str(ckpt), {"model": nn.Linear(2, 2)})
    assert not os.path.exists(marker)


def test_value_that_runs_code_is_skipped_by_name(tmp_path, caplog):
    ckpt, marker = tmp_path / "ckpt", str(tmp_path / "marker")
    src = nn.Linear(3, 2)
    dcp.save({"model": src.state_dict(), "extra": {"evil": _WritesMarker(marker), "ok": 5}},
             checkpoint_id=str(ckpt))
    model, extra = nn.Linear(3, 2), {}
    with caplog.at_level(logging.WARNING, logger="bytecheckpoint.interop"):
        bcp.load(str(ckpt), {"model": model, "extra": extra})
    assert not os.path.exists(marker)
    assert extra == {"ok": 5}
    assert "extra.evil" in caplog.text and "os.makedirs" in caplog.text
    assert same_bits(model.weight.detach(), src.weight.detach())


def _edit_metadata(ckpt: Any, edit: Any) -> None:
    meta = pickle.loads((ckpt / ".metadata").read_bytes())  # written by this test: trusted
    for index, info in meta.storage_data.items():
        if index.fqn == "model.weight":
            edit(info)
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))


@pytest.mark.parametrize("edit, error, message", [
    (lambda i: setattr(i, "relative_path", "../outside.distcp"), UnsafeCheckpointError, "not a plain file"),
    (lambda i: setattr(i, "offset", 1 << 40), CorruptCheckpointError, "outside __0_0.distcp"),
    (lambda i: setattr(i, "length", i.length - 100), CorruptCheckpointError, "not a torch.save zip"),
    (lambda i: setattr(i, "relative_path", "__9_0.distcp"), CorruptCheckpointError, "missing"),
    (lambda i: setattr(i, "offset", i.offset + 1), CorruptCheckpointError, "bad local header"),
    (lambda i: setattr(i, "transform_descriptors", ["zstd"]), CorruptCheckpointError, "transforms"),
])
def test_bad_storage_data_is_refused_by_name(tmp_path, edit, error, message):
    ckpt = tmp_path / "ckpt"
    (tmp_path / "outside.distcp").write_bytes(b"\0" * 4096)
    dcp.save({"model": nn.Linear(4, 4).state_dict()}, checkpoint_id=str(ckpt))
    _edit_metadata(ckpt, edit)
    model = nn.Linear(4, 4)
    before = model.weight.detach().clone()
    with pytest.raises(error, match=message):
        bcp.load(str(ckpt), {"model": model})
    assert same_bits(model.weight.detach(), before)  # nothing half-loaded


def test_overlapping_chunks_are_refused(tmp_path):
    """Two chunks claiming the same elements: the library's own tiling check refuses them."""
    ckpt = tmp_path / "ckpt"
    dcp.save({"model": nn.Linear(4, 4).state_dict()}, checkpoint_id=str(ckpt))
    meta = pickle.loads((ckpt / ".metadata").read_bytes())
    chunk = meta.state_dict_metadata["model.weight"].chunks[0]
    chunk.sizes = torch.Size([2, 4])  # the blob still holds 4x4: named as a mismatch
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointError, match="declares"):
        bcp.load(str(ckpt), {"model": nn.Linear(4, 4)})


def test_flattened_optimizer_and_bare_model_layouts(tmp_path):
    """torchtitan's layouts: flatten_optimizer_state_dict=True, and a model-only state dict
    with model keys at the top level."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from tests.support.frameworks import canonical
    from tests.support.workloads import make_plain, train_step

    model, optim = make_plain(seed=0)
    train_step(model, optim, 0, 0)
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True))
    assert any(k.startswith("param_groups.") for k in osd)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "flat"))
    dcp.save(dict(model.state_dict()), checkpoint_id=str(tmp_path / "bare"))
    ref = canonical(model, optim)

    got_model, got_optim = make_plain(seed=1, lr=5e-4)
    bcp.load(str(tmp_path / "flat"), {"model": got_model, "optimizer": got_optim})
    assert_same(ref, canonical(got_model, got_optim))
    bare = make_plain(seed=2)[0]
    bcp.load(str(tmp_path / "bare"), {"model": bare})
    for name, t in model.state_dict().items():
        assert same_bits(t, bare.state_dict()[name]), name


def test_verify_of_a_dcp_directory_says_why_it_cannot(tmp_path):
    from bytecheckpoint.commit.integrity import verify
    from bytecheckpoint.errors import NotACheckpointError

    dcp.save({"model": nn.Linear(2, 2).state_dict()}, checkpoint_id=str(tmp_path / "ckpt"))
    with pytest.raises(NotACheckpointError, match="DCP checkpoint, which stores no checksums"):
        verify(str(tmp_path / "ckpt"))
