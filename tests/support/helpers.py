"""Assertions and small utilities shared by the tests."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two tensors have the same dtype, shape and bytes (NaN-safe, -0.0-exact)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def assert_same_state(ref: dict[str, Any], got: dict[str, Any]) -> None:
    assert sorted(ref) == sorted(got), set(ref) ^ set(got)
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            assert same_bits(value, got[key]), f"{key} differs"
        else:
            assert value == got[key], f"{key}: {value!r} != {got[key]!r}"


def file_payload(ckpt_dir: str, name: str) -> tuple[int, int]:
    """(first payload byte, payload bytes) of one safetensors storage file: its size without
    the header and the padding entries, neither of which a load reads into a tensor."""
    with open(os.path.join(ckpt_dir, name), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    padding = sum(v["data_offsets"][1] - v["data_offsets"][0]
                  for k, v in header.items() if k.startswith("__padding__/"))
    return 8 + n, os.path.getsize(os.path.join(ckpt_dir, name)) - 8 - n - padding


def payload_bytes(ckpt_dir: str) -> int:
    """The payload (``file_payload``) of every storage file of a checkpoint."""
    return sum(file_payload(ckpt_dir, name)[1] for name in os.listdir(ckpt_dir)
               if name.endswith(".safetensors"))


@contextmanager
def env_set(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set environment variables for the block (None: unset), then restore what was there."""
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def assert_changed_structure_loads(root: str) -> None:
    """The checkpoint ``save_workloads.structure_changes_on_one_rank`` leaves at ``root/second``
    loads bit for bit, and no staging directory is left behind."""
    import bytecheckpoint as bcp

    w, b = torch.zeros(8, 4), torch.zeros(3)
    target = {"w": bcp.TensorShard(w, (8, 4)), "b": bcp.TensorShard(b, (3,))}
    bcp.load(os.path.join(root, "second"), {"model": target})
    assert torch.equal(b, torch.full((3,), 7.0))
    assert torch.equal(w, torch.cat([torch.arange(8.0).reshape(2, 4) + 10 * r for r in range(4)]))
    assert not [n for n in os.listdir(root) if ".staging-" in n]
