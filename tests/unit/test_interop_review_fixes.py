"""DCP interop and export fixes: a shared-reference pickle ends in a named error at once (not an
endless repr or walk), DCP blobs of the dtypes torch writes with ``_rebuild_tensor_v3`` are
read bit for bit, a module's dict extra state and a submodule named ``state`` load back from a
DCP directory, and a complex128 tensor is refused by ``bcp export`` before anything is written.
Single process, tiny tensors."""

from __future__ import annotations

import os
import pickle
import time
import warnings

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.errors import CheckpointError, CorruptCheckpointError
from bytecheckpoint.interop.dcp_metadata import parse_dcp_metadata
from bytecheckpoint.interop.safe_pickle import PlainValueTooLargeError, is_plain, short
from bytecheckpoint.tools import convert
from bytecheckpoint.tools.export import ExportError, export_safetensors

dcp = pytest.importorskip("torch.distributed.checkpoint")


def _dcp_save(state: dict, path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path, no_dist=True)


def _dag(depth: int, make=list):
    x = make([1])
    for _ in range(depth):
        x = make([x, x])
    return x


# -- 2: shared references -------------------------------------------------------------------------

def test_shared_reference_metadata_is_a_quick_named_error(tmp_path):
    data = pickle.dumps(_dag(40), protocol=2)
    assert len(data) < 400
    start = time.monotonic()
    with pytest.raises(CorruptCheckpointError, match="not a DCP Metadata"):
        parse_dcp_metadata(data, source=str(tmp_path))
    assert time.monotonic() - start < 2


def test_is_plain_counts_shared_references():
    start = time.monotonic()
    with pytest.raises(PlainValueTooLargeError, match="shared references"):
        is_plain(_dag(40, tuple))
    assert time.monotonic() - start < 2
    assert is_plain({"a": [1, 2.5, "x", b"y", None, (True,)]})
    assert not is_plain({"a": object()})
    assert len(short(_dag(40))) <= 80


def test_shared_reference_value_in_dcp_is_named_quickly(tmp_path):
    src = str(tmp_path / "dcp")
    _dcp_save({"model": {"w": torch.ones(3)}, "extra": _dag(40, tuple)}, src)
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = convert.from_dcp(src, str(tmp_path / "out"), max_memory=1 << 20)
    assert time.monotonic() - start < 10
    assert len(out.skipped) == 1 and "extra" in out.skipped[0] and "shared references" in out.skipped[0]
    m = torch.nn.Module()
    m.register_buffer("w", torch.zeros(3))
    bcp.load(str(tmp_path / "out"), {"model": m}, framework="single")
    assert torch.equal(m.w, torch.ones(3))


# -- 3: _rebuild_tensor_v3 dtypes -------------------------------------------------------------------

V3_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64]


def _raw(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    g = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8,
                        generator=g)
    return raw.view(dtype).reshape(shape).clone()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", V3_DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_v3_dtypes_round_trip_bit_for_bit(tmp_path, dtype):
    t = _raw(dtype, (2, 3))
    m = torch.nn.Module()
    m.register_buffer("w", t.clone())
    bcp.save(str(tmp_path / "bcp"), {"model": m}, framework="single")
    convert.to_dcp(str(tmp_path / "bcp"), str(tmp_path / "dcp"), max_memory=1 << 20)
    convert.from_dcp(str(tmp_path / "dcp"), str(tmp_path / "back"), max_memory=1 << 20)
    for path in ("dcp", "back"):  # read in place, and converted
        m2 = torch.nn.Module()
        m2.register_buffer("w", torch.zeros_like(t))
        bcp.load(str(tmp_path / path), {"model": m2}, framework="single")
        assert m2.w.dtype == dtype and torch.equal(_bytes(m2.w), _bytes(t))


def test_v3_offset_view_is_read_at_its_offset(tmp_path):
    base = _raw(torch.uint16, (8,))
    _dcp_save({"model": {"w": base[3:]}}, str(tmp_path / "dcp"))
    m = torch.nn.Module()
    m.register_buffer("w", torch.zeros(5, dtype=torch.uint16))
    bcp.load(str(tmp_path / "dcp"), {"model": m}, framework="single")
    assert torch.equal(_bytes(m.w), _bytes(base[3:]))


# -- 4 and 5: extra state, a submodule named "state" ---------------------------------------------

class _Extra(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 2)
        self.x = {"scale": 1.5, "hist": [1, 2], "name": "fp8", "t": (1, "z")}

    def get_extra_state(self):
        return self.x

    def set_extra_state(self, s):
        self.x = s


def test_dict_extra_state_loads_from_dcp(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    src = _Extra()
    opt = torch.optim.AdamW(src.parameters(), lr=0.01)
    src.a(torch.randn(4, 3)).sum().backward()
    opt.step()
    src.x = {"scale": 2.25, "hist": [4, 5], "name": "e5m2", "t": (7, "q")}
    msd, osd = get_state_dict(src, opt)
    _dcp_save({"model": msd, "optim": osd}, str(tmp_path / "dcp"))
    convert.from_dcp(str(tmp_path / "dcp"), str(tmp_path / "conv"), max_memory=1 << 20)
    for path in ("dcp", "conv"):
        dst = _Extra()
        dst_opt = torch.optim.AdamW(dst.parameters(), lr=0.5)
        bcp.load(str(tmp_path / path), {"model": dst, "optim": dst_opt})
        assert dst.x == src.x
        assert torch.equal(dst.a.weight, src.a.weight)
        assert dst_opt.param_groups[0]["lr"] == 0.01
        s1, s2 = opt.state_dict()["state"], dst_opt.state_dict()["state"]
        assert all(torch.equal(s1[p][n], s2[p][n]) for p in s1 for n in s1[p])


def test_dict_extra_state_loads_into_a_state_dict_target(tmp_path):
    """DCP's own idiom, a load into ``model.state_dict()``: the module's dict extra state is
    one entry there (``_extra_state``), as in a checkpoint saved from the module or by DCP."""
    torch.manual_seed(0)
    src = _Extra()
    src.x = {"scale": 2.25, "hist": [4, 5], "name": "e5m2"}
    _dcp_save({"model": src.state_dict()}, str(tmp_path / "dcp"))
    bcp.save(str(tmp_path / "bcp"), {"model": src})
    for path in ("dcp", "bcp"):
        dst = _Extra()
        target = dst.state_dict()
        bcp.load(str(tmp_path / path), {"model": target})
        assert target["_extra_state"] == src.x, path
        assert torch.equal(dst.a.weight, src.a.weight), path  # filled in place


class _StateNamed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.state = torch.nn.Sequential(torch.nn.Linear(3, 2))
        self.head = torch.nn.Linear(2, 2)


def test_submodule_named_state_loads_from_dcp(tmp_path):
    torch.manual_seed(0)
    src = _StateNamed()
    _dcp_save({"model": src.state_dict()}, str(tmp_path / "dcp"))
    dst = _StateNamed()
    bcp.load(str(tmp_path / "dcp"), {"model": dst})
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k


# -- 6: export of a dtype safetensors lacks ------------------------------------------------------

def test_export_complex128_is_refused_before_writing(tmp_path):
    m = torch.nn.Module()
    m.register_buffer("a", torch.ones(2))
    m.register_buffer("w", torch.randn(5, dtype=torch.complex128))
    bcp.save(str(tmp_path / "ck"), {"model": m}, framework="single")
    with pytest.raises(ExportError, match=r"model/w .*complex128"):
        export_safetensors(str(tmp_path / "ck"), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")
    assert isinstance(ExportError("x"), CheckpointError)
