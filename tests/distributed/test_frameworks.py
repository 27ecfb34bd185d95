"""Every framework saved and loaded into every other, compared bit for bit.

FSDP v1 (flat parameters, ``use_orig_params`` False and True), tensor parallel with FSDP2 on
a 2-D mesh, pipeline stages with stage-local layer numbers, and a Megatron-style manual
spec with a flattened, DP-sharded distributed optimizer. References are full states
gathered by each framework's own means (see tests/support/frameworks.py).
"""

from __future__ import annotations

import pytest
import torch

from bytecheckpoint.commit.integrity import read_metadata, resolve
from tests.support import frameworks as f
from tests.support.helpers import same_bits

STEPS = 2


def assert_same(ref: dict, got: dict) -> None:
    assert sorted(ref) == sorted(got), sorted(set(ref) ^ set(got))[:10]
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            assert same_bits(value, got[key]), f"{key} differs"
        else:
            assert value == got[key], f"{key}: {value!r} != {got[key]!r}"


@pytest.fixture(scope="module", params=[False, True], ids=["flat_params", "orig_params"])
def fsdp1_ckpt(request, world, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fsdp1") / "ckpt")
    ref = world(4).run(f.fsdp1_train_save, path, STEPS, request.param)[0]
    return path, ref, request.param


def test_fsdp1_flat_shards_become_few_regular_boxes(fsdp1_ckpt):
    path, ref, _ = fsdp1_ckpt
    storage, p = resolve(path)
    meta = read_metadata(storage, p)
    assert meta.framework == "fsdp" and meta.world_size == 4
    assert sorted(meta.bytes_per_rank()) == [0, 1, 2, 3]
    ragged = 0
    for tm in meta.tensors:
        boxes = meta.boxes_of(tm.key)
        full = torch.full(tm.shape, 0, dtype=torch.int32)
        for sb in boxes:
            full[sb.box.slices()] += 1
        assert bool((full == 1).all()), f"{tm.key} not tiled exactly once"
        ragged += sum(1 for sb in boxes if sb.box.ndim == 2 and sb.box.lengths[1] != tm.shape[1])
    assert ragged > 0  # rank boundaries cut rows: the decomposition is exercised
    assert meta.total_bytes > 0 and len(ref) > 100


@pytest.mark.parametrize("target", ["fsdp1_2", "fsdp1_3_other_mode", "fsdp2_2", "plain"])
def test_fsdp1_loads_into_every_layout(world, fsdp1_ckpt, target):
    path, ref, orig = fsdp1_ckpt
    if target == "fsdp1_2":
        got = world(2).run(f.fsdp1_load, path, orig)[0]
    elif target == "fsdp1_3_other_mode":
        got = world(3).run(f.fsdp1_load, path, not orig)[0]
    elif target == "fsdp2_2":
        got = world(2).run(f.fsdp2_load_canonical, path)[0]
    else:
        got = f.plain_load_canonical(path)
    assert_same(ref, got)


def test_fsdp2_and_single_process_checkpoints_load_into_fsdp1(world, tmp_path):
    ref = world(4).run(f.fsdp2_train_save_canonical, str(tmp_path / "fsdp2"), STEPS)[0]
    assert_same(ref, world(3).run(f.fsdp1_load, str(tmp_path / "fsdp2"), False)[0])
    assert_same(ref, world(2).run(f.fsdp1_load, str(tmp_path / "fsdp2"), True)[0])
    ref = f.plain_train_save_canonical(str(tmp_path / "single"), STEPS)
    assert_same(ref, world(4).run(f.fsdp1_load, str(tmp_path / "single"), False)[0])


@pytest.mark.parametrize("orig", [False, True], ids=["flat_params", "orig_params"])
def test_fsdp1_save_communicates_only_to_plan(world, tmp_path, orig):
    counts = world(4).run(f.fsdp1_save_collectives, str(tmp_path / "c"), orig)
    for c in counts:
        # gather local plans, scatter assignments, gather results, broadcast the commit
        assert c["protocol_calls"] == 4
        assert c["other_collectives"] == 0, c
        assert c["full_state_dict_collectives"] > 0  # the counter does see FSDP's all-gathers


@pytest.fixture(scope="module")
def tp_ckpt(world, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tp") / "ckpt")
    return path, world(4).run(f.tp_dp_train_save, path, STEPS, 2, 2)[0]


@pytest.mark.parametrize("target", ["dp4", "tp4", "pp2_dp2", "plain"])
def test_tp2_dp2_loads_into_every_layout(world, tp_ckpt, target):
    path, ref = tp_ckpt
    if target == "dp4":
        got = world(4).run(f.fsdp2_load_canonical, path)[0]
    elif target == "tp4":
        got = world(4).run(f.tp_dp_load, path, 1, 4)[0]
    elif target == "pp2_dp2":
        got = world(4).run(f.pp_dp_load, path, 2, 2)[0]
    else:
        got = f.plain_load_canonical(path)
    assert_same(ref, got)


def test_tp_metadata_records_the_2d_mesh(tp_ckpt):
    storage, p = resolve(tp_ckpt[0])
    meta = read_metadata(storage, p)
    assert meta.framework == "fsdp2" and meta.layout["mesh_shape"] in ([2, 2], [2])
    # the vocab-sharded embedding (251 rows over TP=2 then DP=2) is cut unevenly
    rows = sorted(sb.box.lengths[0] for sb in meta.boxes_of("model/embed.weight"))
    assert sum(rows) == 251 and len(set(rows)) > 1


def test_pipeline_stages_with_local_names_save_and_reshard(world, tmp_path):
    path = str(tmp_path / "pp")
    ref = world(4).run(f.pp_tp_train_save, path, STEPS, 2, 2)[0]
    assert "model/blocks.1.fc.weight" in ref and "model/blocks.0.fc.weight" in ref
    assert_same(ref, f.plain_load_canonical(path))
    assert_same(ref, world(4).run(f.tp_dp_load, path, 2, 2)[0])


def test_megatron_distributed_optimizer_tp2_dp2_to_tp1_dp2_and_one_process(world, tmp_path):
    path = str(tmp_path / "meg")
    world(4).run(f.megatron_save, path, 2, 2)
    storage, p = resolve(path)
    meta = read_metadata(storage, p)
    assert meta.framework == "manual"
    ref = f.megatron_reference()
    for got in (world(2).run(f.megatron_load, path, 1, 2)[0], f.megatron_load(path, 1, 1)):
        assert sorted(got["tensors"]) == sorted(ref)
        for key, value in ref.items():
            assert same_bits(value, got["tensors"][key]), key
        assert got["step"] == 7 and got["param_groups"] == [{"lr": 3e-4, "betas": [0.9, 0.95]}]
