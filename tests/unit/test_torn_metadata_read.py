"""A load whose metadata read is torn by an overwrite (an object store serving the metadata in
ranged parts while a save replaces it) reads it again; metadata that is damaged reads the
same bytes again and is refused by name, after a bounded number of reads."""

from __future__ import annotations

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.engine import load as load_module
from bytecheckpoint.errors import CorruptCheckpointError


def test_a_torn_metadata_read_is_read_again(tmp_path, monkeypatch):
    model = torch.nn.Linear(8, 8)
    bcp.save(str(tmp_path / "ckpt"), {"model": model})
    real = load_module.read_metadata_identified
    calls = []

    def torn_once(storage, path):
        calls.append(path)
        if len(calls) == 1:
            raise CorruptCheckpointError("metadata checksum does not match (torn read)")
        return real(storage, path)

    monkeypatch.setattr(load_module, "read_metadata_identified", torn_once)
    fresh = torch.nn.Linear(8, 8)
    bcp.load(str(tmp_path / "ckpt"), {"model": fresh})
    assert torch.equal(fresh.weight, model.weight) and len(calls) == 2


def test_metadata_that_reads_the_same_and_fails_again_is_refused(tmp_path):
    model = torch.nn.Linear(8, 8)
    bcp.save(str(tmp_path / "ckpt"), {"model": model})
    meta = tmp_path / "ckpt" / "metadata.msgpack"
    raw = bytearray(meta.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    meta.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError):
        bcp.load(str(tmp_path / "ckpt"), {"model": torch.nn.Linear(8, 8)})
