"""Which tensor goes to which file in ``bcp export``: checkpoint order, numbered shards and an
index, and the same split as ``huggingface_hub.split_torch_state_dict_into_shards`` wherever
every tensor fits in a shard (the two differ only for larger tensors; bytecheckpoint/tools/export.py)."""

from __future__ import annotations

import json
import os

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from torch import nn

import bytecheckpoint as bcp
from bytecheckpoint.tools.export import MODEL_INDEX, export_safetensors

# float32 element counts, in checkpoint order (parameter names sort the same way)
SIZES = {"p00": 10, "p01": 30, "p02": 5, "p03": 20, "p04": 8, "p05": 12, "p06": 25, "p07": 3}


class Params(nn.Module):
    def __init__(self, sizes: dict[str, int]) -> None:
        super().__init__()
        for name, n in sizes.items():
            self.register_parameter(name, nn.Parameter(torch.arange(n, dtype=torch.float32) + len(name)))


def _export(tmp_path, sizes: dict[str, int], limit: int) -> tuple[dict[str, str], list[str]]:
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / f"out-{limit}")
    bcp.save(ckpt, {"model": Params(sizes)}, overwrite=True)
    export_safetensors(ckpt, out, max_shard_bytes=limit, tied=())
    with open(os.path.join(out, MODEL_INDEX)) as f:
        weight_map = json.load(f)["weight_map"]
    return weight_map, sorted(os.listdir(out))


def _hf_split(sizes: dict[str, int], limit: int) -> dict[str, str]:
    meta = {name: torch.empty(n, dtype=torch.float32, device="meta") for name, n in sizes.items()}
    split = split_torch_state_dict_into_shards(meta, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=limit)
    return split.tensor_to_filename


def test_split_matches_huggingface_hub_when_every_tensor_fits(tmp_path):
    limit = 4 * 40  # every tensor fits; several shards
    weight_map, files = _export(tmp_path, SIZES, limit)
    assert len(set(weight_map.values())) > 2
    assert weight_map == _hf_split(SIZES, limit)
    assert files == sorted([*set(weight_map.values()), MODEL_INDEX])


def test_a_tensor_larger_than_a_shard_keeps_checkpoint_order(tmp_path):
    limit = 4 * 15  # p01, p03 and p06 are larger than a shard
    weight_map, _ = _export(tmp_path, SIZES, limit)
    order = [weight_map[name] for name in SIZES]
    assert order == sorted(order), "files follow checkpoint order"
    for big in ("p01", "p03", "p06"):
        assert [n for n, f in weight_map.items() if f == weight_map[big]] == [big], "a file of its own"
    hf = _hf_split(SIZES, limit)
    assert [hf[name] for name in SIZES] != sorted(hf[name] for name in SIZES), \
        "huggingface_hub reorders here, which is why export packs shards itself"


def test_a_single_shard_is_numbered_and_indexed(tmp_path):
    weight_map, files = _export(tmp_path, SIZES, 10**6)
    assert set(weight_map.values()) == {"model-00001-of-00001.safetensors"}
    assert files == ["model-00001-of-00001.safetensors", MODEL_INDEX]
