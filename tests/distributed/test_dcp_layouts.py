"""A DCP checkpoint (FSDP2 + AdamW on 4 ranks, written by ``dcp.save(get_state_dict(...))``)
loads with ``bcp.load`` into the layouts ``tests/distributed/test_dcp_interop.py`` does not cover:
DDP, FSDP v1 flat parameters (ragged 1-D shards) and a pipeline split; every tensor, the
optimizer state included, equal to the reference gathered by the saving framework itself."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support import dcp_workloads as w

STEPS = 2


@pytest.fixture(scope="module")
def dcp_fsdp2(world, tmp_path_factory) -> tuple[str, dict[str, Any]]:
    path = str(tmp_path_factory.mktemp("dcp") / "fsdp2")
    return path, world(4).run(w.dcp_fsdp2_save, path, STEPS)[0]


def assert_equal(ref: dict[str, Any], got: dict[str, Any]) -> None:
    assert sorted(ref) == sorted(got)
    assert any(k.startswith("optimizer/state/") for k in ref)
    for k, v in ref.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == got[k].dtype and torch.equal(v, got[k]), k
        else:
            assert v == got[k], k


def test_dcp_loads_into_ddp(world, dcp_fsdp2):
    path, ref = dcp_fsdp2
    for got in world(2).run(w.bcp_ddp_load, path):
        assert_equal(ref, got)


def test_dcp_loads_into_fsdp1_flat_shards(world, dcp_fsdp2):
    path, ref = dcp_fsdp2
    for got in world(2).run(w.bcp_fsdp1_load, path):
        assert_equal(ref, got)


def test_dcp_loads_into_a_pipeline_split(world, dcp_fsdp2):
    path, ref = dcp_fsdp2
    for got in world(4).run(w.bcp_pp_load, path, 2, 2):  # 2 stages, FSDP2 over 2 ranks in each
        assert_equal(ref, got)
