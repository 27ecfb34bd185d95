"""Assertions shared by the tests."""

from __future__ import annotations

import json
import os
import struct
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


def payload_bytes(ckpt_dir: str) -> int:
    """Sizes of the storage files without their safetensors headers (never read on load)."""
    total = 0
    for name in os.listdir(ckpt_dir):
        if name.endswith(".safetensors"):
            with open(os.path.join(ckpt_dir, name), "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                json.loads(f.read(n))
            total += os.path.getsize(os.path.join(ckpt_dir, name)) - 8 - n
    return total
