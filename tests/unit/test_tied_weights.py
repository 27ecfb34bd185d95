"""Tied weights: one tensor under two keys of the state.

Saved tied and loaded tied, both keys hold the same bytes and load exactly. A checkpoint of an
untied model loaded into a tied one put two different values into one memory: the checksum
check of one read saw the other's bytes and called the intact file corrupt ("restore it"),
and with verification off one value won silently. It is now a named mismatch, before any read."""

from __future__ import annotations

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.errors import StateMismatchError


class LM(torch.nn.Module):
    def __init__(self, tie: bool, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(50, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        if tie:
            self.head.weight = self.emb.weight


def test_tied_saved_and_loaded_tied_is_exact(tmp_path):
    saved = LM(tie=True, seed=0)
    bcp.save(str(tmp_path / "c"), {"model": saved})
    fresh = LM(tie=True, seed=1)
    bcp.load(str(tmp_path / "c"), {"model": fresh})
    assert fresh.head.weight is fresh.emb.weight and torch.equal(fresh.emb.weight, saved.emb.weight)


@pytest.mark.parametrize("verify", [True, False])
def test_untied_checkpoint_into_a_tied_model_is_a_named_mismatch(tmp_path, verify):
    bcp.save(str(tmp_path / "c"), {"model": LM(tie=False, seed=0)})
    fresh = LM(tie=True, seed=1)
    before = fresh.emb.weight.clone()
    with pytest.raises(StateMismatchError, match="tied weights"):
        bcp.load(str(tmp_path / "c"), {"model": fresh}, verify=verify)
    assert torch.equal(fresh.emb.weight, before)  # refused before any read
    assert bcp.verify(str(tmp_path / "c")) == []  # the file is fine


def test_untied_checkpoint_into_an_untied_model_still_loads(tmp_path):
    saved = LM(tie=False, seed=0)
    bcp.save(str(tmp_path / "c"), {"model": saved})
    fresh = LM(tie=False, seed=1)
    bcp.load(str(tmp_path / "c"), {"model": fresh})
    assert torch.equal(fresh.head.weight, saved.head.weight)
    assert torch.equal(fresh.emb.weight, saved.emb.weight)
