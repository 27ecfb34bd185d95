"""Every bad input gets an error that names the problem (single process, no process group)."""

from __future__ import annotations

import os

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.format.metadata import METADATA_FILE, pack_document, unpack_document
from tests.support import workloads as w


def _tiny(seed: int = 0, width: int = 6, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 3)).to(dtype)


@pytest.fixture
def ckpt(tmp_path):
    model, optim = w.make_plain(seed=0)
    w.train_step(model, optim, 0, 0)
    path = tmp_path / "ckpt" / "step_1"
    bcp.save(str(path), {"model": model, "optimizer": optim}, step=1)
    return path, model, optim


def test_path_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(bcp.NotACheckpointError, match="not a checkpoint"):
        bcp.load(str(tmp_path / "empty"), {"model": _tiny()})
    with pytest.raises(bcp.NotACheckpointError, match="no such checkpoint"):
        bcp.load(str(tmp_path / "nowhere"), {"model": _tiny()})


def test_missing_and_unexpected_keys_strict_and_lenient(tmp_path):
    small = _tiny()
    bcp.save(str(tmp_path / "a"), {"model": small})
    bigger = torch.nn.Sequential(*_tiny(seed=1), torch.nn.Linear(3, 2))
    with pytest.raises(bcp.MissingKeysError) as info:
        bcp.load(str(tmp_path / "a"), {"model": bigger})
    assert info.value.missing_keys == ["model/2.bias", "model/2.weight"]
    assert "strict=False" in str(info.value)
    result = bcp.load(str(tmp_path / "a"), {"model": bigger}, strict=False)
    assert result.missing_keys == ["model/2.bias", "model/2.weight"]
    assert torch.equal(bigger[0].weight, small[0].weight)  # shared keys were loaded

    lesser = torch.nn.Sequential(_tiny(seed=2)[0])
    with pytest.raises(bcp.MissingKeysError) as info:
        bcp.load(str(tmp_path / "a"), {"model": lesser})
    assert info.value.unexpected_keys == ["model/1.bias", "model/1.weight"]


def test_shape_mismatch_names_the_fqn(tmp_path):
    bcp.save(str(tmp_path / "a"), {"model": _tiny(width=6)})
    with pytest.raises(bcp.ShapeMismatchError, match=r"model/0.weight: shape mismatch.*\(6, 4\).*\(5, 4\)"):
        bcp.load(str(tmp_path / "a"), {"model": _tiny(width=5)})


def test_dtype_mismatch_names_the_fqn(tmp_path):
    bcp.save(str(tmp_path / "a"), {"model": _tiny()})
    with pytest.raises(bcp.DtypeMismatchError, match=r"model/0.bias: dtype mismatch.*float32.*float64"):
        bcp.load(str(tmp_path / "a"), {"model": _tiny(dtype=torch.float64)})


def test_truncated_storage_file_is_named(ckpt):
    path, model, optim = ckpt
    victim = path / "model-00000.safetensors"
    os.truncate(victim, victim.stat().st_size - 100)
    with pytest.raises(bcp.CorruptCheckpointError, match="model-00000.safetensors.*truncated"):
        bcp.load(str(path), {"model": model})


def test_flipped_byte_fails_checksum_and_names_the_file(ckpt):
    path, model, optim = ckpt
    victim = path / "optim-00000.safetensors"
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0x40
    victim.write_bytes(bytes(data))
    with pytest.raises(bcp.CorruptCheckpointError, match="optim-00000.safetensors: checksum mismatch"):
        bcp.load(str(path), {"model": model, "optimizer": optim})
    # The model file is intact, so the model alone still loads; verify() names the bad file.
    bcp.load(str(path), {"model": model})
    problems = bcp.verify(str(path))
    assert len(problems) == 1 and "optim-00000.safetensors" in problems[0]


def _rewrite_metadata(path, edit):
    meta_file = path / METADATA_FILE
    doc = unpack_document(meta_file.read_bytes())
    edit(doc)
    meta_file.write_bytes(pack_document(doc))  # resealed: the edit must reach the field checks


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/dir.bin", ".hidden"])
def test_metadata_naming_a_file_outside_the_checkpoint_is_refused(ckpt, name):
    path, model, _ = ckpt
    _rewrite_metadata(path, lambda doc: doc["files"][0].__setitem__(0, name))
    with pytest.raises(bcp.UnsafeCheckpointError, match="not a plain file name"):
        bcp.load(str(path), {"model": model})


def test_garbage_and_future_metadata_are_refused(ckpt):
    path, model, _ = ckpt
    _rewrite_metadata(path, lambda doc: doc.__setitem__("version", 99))
    with pytest.raises(bcp.CorruptCheckpointError, match="newer than this library"):
        bcp.load(str(path), {"model": model})
    (path / METADATA_FILE).write_bytes(b"\x80\x04\x95 definitely a pickle")
    with pytest.raises(bcp.CorruptCheckpointError, match="metadata"):
        bcp.load(str(path), {"model": model})


def test_box_outside_tensor_is_refused(ckpt):
    path, model, _ = ckpt

    def edit(doc):
        import numpy as np
        lengths = np.frombuffer(doc["boxes"]["lengths"], dtype="<i8").copy()
        lengths[0] += 1
        doc["boxes"]["lengths"] = lengths.tobytes()

    _rewrite_metadata(path, edit)
    with pytest.raises(bcp.CorruptCheckpointError, match="outside its (tensor|shape)|byte length"):
        bcp.load(str(path), {"model": model})


def test_existing_checkpoint_needs_overwrite(ckpt):
    path, model, optim = ckpt
    with pytest.raises(bcp.CheckpointExistsError, match="overwrite=True"):
        bcp.save(str(path), {"model": model})
    with torch.no_grad():
        model.head.weight.add_(1.0)
    bcp.save(str(path), {"model": model}, overwrite=True, step=1)
    fresh, _ = w.make_plain(seed=5)
    bcp.load(str(path), {"model": fresh})
    assert torch.equal(fresh.head.weight, model.head.weight)
    assert sorted(p.name for p in path.parent.iterdir()) == ["latest", "step_1"]


def test_uncommitted_staging_directory_is_refused(ckpt, tmp_path):
    path, model, _ = ckpt
    staging = path.parent / ".step_2.staging-abc123"
    staging.mkdir()
    (staging / "model-00000.safetensors").write_bytes(b"partial")
    with pytest.raises(bcp.NotACheckpointError, match="never committed"):
        bcp.load(str(path.parent / "step_2"), {"model": model})
    with pytest.raises(bcp.NotACheckpointError, match="never committed"):
        bcp.load(str(staging), {"model": model})
    bcp.load(str(path.parent), {"model": model})  # latest still names step_1


def test_unsupported_values_and_frameworks_are_named(tmp_path):
    with pytest.raises(bcp.CheckpointError, match="cannot store a value of type"):
        bcp.save(str(tmp_path / "a"), {"model": _tiny(), "extra": {"fn": object()}})
    with pytest.raises(bcp.CheckpointError, match="unknown framework 'megatron2'"):
        bcp.save(str(tmp_path / "b"), {"model": _tiny()}, framework="megatron2")
    with pytest.raises(bcp.CheckpointError, match="state must be a dict"):
        bcp.save(str(tmp_path / "c"), _tiny())
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
