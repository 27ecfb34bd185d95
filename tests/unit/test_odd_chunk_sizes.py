"""A checksum chunk size that is not a multiple of the element size still loads exact bytes.

A load that needs part of a saved box widens its byte range to whole checksum chunks. With
``chunk_bytes=100`` and float64 that range began inside an element, and the copies, which
count whole elements from its start, took bytes shifted by the remainder: wrong values, no
error, the checksums all passing (they cover the file's bytes, not the copy).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bytecheckpoint as bcp
from bytecheckpoint.runtime import devices
from bytecheckpoint.state.tensor_shard import TensorShard

DTYPES = [torch.float64, torch.complex128, torch.float32, torch.bfloat16, torch.int8, torch.int16]


def values(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    flat = torch.arange(1, n + 1, dtype=torch.float64)
    if dtype.is_complex:
        return torch.complex(flat, -flat).to(dtype).reshape(shape)
    return (flat % 120 if dtype in (torch.int8, torch.bfloat16) else flat).to(dtype).reshape(shape)


def save_in_pieces(path: str, full: torch.Tensor, cuts: list[int], chunk_bytes: int) -> None:
    """``full`` saved as boxes of rows ``[cuts[i], cuts[i + 1])``, one process."""
    pieces = [TensorShard(full[a:b].clone(), tuple(full.shape), (a,) + (0,) * (full.dim() - 1))
              for a, b in zip(cuts, cuts[1:]) if b > a]
    bcp.save(path, {"model": {"w": pieces if len(pieces) > 1 else pieces[0]}}, chunk_bytes=chunk_bytes)


def load_rows(path: str, full: torch.Tensor, start: int, stop: int, verify: bool = True) -> torch.Tensor:
    into = torch.zeros_like(full[start:stop])
    bcp.load(path, {"model": {"w": TensorShard(into, tuple(full.shape), (start,) + (0,) * (full.dim() - 1))}},
             verify=verify)
    return into


@pytest.mark.parametrize("chunk_bytes", [3, 7, 12, 100, 1000, 4104])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_part_of_a_box_loads_exactly_whatever_the_chunk_size(tmp_path, chunk_bytes, dtype):
    full = values((200, 3), dtype)
    path = str(tmp_path / "ckpt")
    save_in_pieces(path, full, [0, 200], chunk_bytes)
    for start, stop in [(13, 26), (1, 2), (199, 200), (0, 200), (57, 131)]:
        want = full[start:stop].contiguous().view(torch.uint8)
        assert torch.equal(load_rows(path, full, start, stop).view(torch.uint8), want), (start, stop)


@pytest.mark.parametrize("pretend_cuda", [False, True], ids=["host-buffers", "pinned-window"])
def test_pieces_across_several_boxes_load_exactly_on_every_landing_path(tmp_path, pretend_cuda):
    """Boxes read into a staging buffer (as for CUDA targets) as well as into host buffers."""
    full = values((90, 5), torch.float64)
    path = str(tmp_path / "ckpt")
    save_in_pieces(path, full, [0, 17, 40, 90], chunk_bytes=100)
    devices.PRETEND_CUDA_TARGETS = pretend_cuda
    try:
        for start, stop in [(3, 88), (16, 18), (39, 41), (0, 90)]:
            assert torch.equal(load_rows(path, full, start, stop), full[start:stop])
            assert torch.equal(load_rows(path, full, start, stop, verify=False), full[start:stop])
    finally:
        devices.PRETEND_CUDA_TARGETS = False


@settings(max_examples=40, deadline=None)
@given(chunk_bytes=st.integers(1, 300), dtype=st.sampled_from(DTYPES), rows=st.integers(1, 40),
       cols=st.integers(1, 4), data=st.data())
def test_any_chunk_size_any_rows(tmp_path_factory, chunk_bytes, dtype, rows, cols, data):
    full = values((rows, cols), dtype)
    cut = data.draw(st.integers(0, rows))
    start = data.draw(st.integers(0, rows - 1))
    stop = data.draw(st.integers(start + 1, rows))
    path = str(tmp_path_factory.mktemp("odd") / "ckpt")
    save_in_pieces(path, full, [0, cut, rows], chunk_bytes)
    got = load_rows(path, full, start, stop)
    assert torch.equal(got.view(torch.uint8), full[start:stop].contiguous().view(torch.uint8))
