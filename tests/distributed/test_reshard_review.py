"""Load targets a resharding review found wrong or refused (2026-11-27): keys sharing memory
as different views, meta and expanded targets, and tensor-parallel shards with no columns.
Every value is compared bit for bit with the saved one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import bytecheckpoint as bcp
from bytecheckpoint.errors import StateMismatchError
from tests.support import reshard_review_workloads as w


@pytest.fixture(scope="module")
def tied_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("tied")
    bcp.save(str(root / "tied"), {"model": w.tied_module(fill=True, tied=True)})
    bcp.save(str(root / "untied"), {"model": w.tied_module(fill=True, tied=False)})
    return str(root)


@pytest.mark.parametrize("verify", [True, False])
def test_untied_checkpoint_into_weights_tied_through_a_view_is_refused(tied_root, verify):
    # Was: loaded without an error, enc silently holding dec's values (transposed); the
    # overlapping slices got "the file is corrupt: restore it" of an intact file.
    target = w.tied_module(fill=False, tied=True)
    with pytest.raises(StateMismatchError, match="share memory"):
        bcp.load(f"{tied_root}/untied", {"model": target}, verify=verify)
    # The same model loads the checkpoint it saved tied, exactly, views and all.
    target = w.tied_module(fill=False, tied=True)
    bcp.load(f"{tied_root}/tied", {"model": target}, verify=verify)
    ref = w.tied_module(fill=True, tied=True)
    for key in ("enc", "dec", "a", "b"):
        assert torch.equal(getattr(target, key), getattr(ref, key)), key
    assert target.dec.data_ptr() == target.enc.data_ptr()


def test_shared_memory_on_two_ranks(world, tied_root):
    for got in world(2).run(w.load_shared_memory, tied_root):
        assert got == {"tied verify=True": [], "tied verify=False": [],
                       "untied verify=True": "StateMismatchError",
                       "untied verify=False": "StateMismatchError"}, got


def test_meta_and_expanded_targets_are_refused_by_name(tmp_path):
    bcp.save(str(tmp_path / "c"), {"model": nn.Linear(3, 4)})
    with torch.device("meta"):
        meta = nn.Linear(3, 4)
    # Was: success, 64 bytes read, nothing filled.
    with pytest.raises(StateMismatchError, match="meta device"):
        bcp.load(str(tmp_path / "c"), {"model": meta})
    expanded = {"weight": torch.zeros(1, 3).expand(4, 3), "bias": torch.zeros(4)}
    # Was: RankFailedError wrapping torch's bare RuntimeError, after reading.
    with pytest.raises(StateMismatchError, match="expand"):
        bcp.load(str(tmp_path / "c"), {"model": expanded})


@pytest.mark.parametrize("save,load", [((1, 4), (2, 2)), ((2, 2), (1, 4))])
def test_tensor_parallel_shards_of_no_columns(world, tmp_path, save, load):
    # 3 columns over 4 TP ranks: FSDP2 gives the last rank a (0, 0) local tensor for a (2, 0)
    # box. Was: UnsupportedStateError, refusing the save and the load of a legal layout.
    root = str(tmp_path / "tp")
    assert world(4).run(w.tp_empty_shards, root, save, load) == [[]] * 4
