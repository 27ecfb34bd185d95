"""Non-tensor state of a DCP checkpoint: ``Stateful`` entries (a data loader's position) and
extra values load into the matching state entries when they are plain values; what cannot be
mapped is named, with why, on the ``LoadResult`` (``skipped``), and no code runs."""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import bytecheckpoint as bcp
from bytecheckpoint.cli.app import main
from bytecheckpoint.errors import UnsupportedStateError


class Loader:
    """A ``Stateful`` as DCP and bytecheckpoint both take it (state_dict / load_state_dict)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


class Opaque:
    """A value only the full unpickler rebuilds; creates ``marker`` if it ever runs code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.makedirs, (self.marker,))


# torchtitan's data loader keeps its state as pickled bytes per DP rank (a bytes value).
TITAN = {"dp_rank_0": pickle.dumps({"sample": 17, "buffer": [3, 1, 4]}), "world_size": 1}
POSITION = {"epoch": 3, "offsets": [10, 20], "source": "web", "ratio": 0.25}


def _save(path: str, marker: str) -> nn.Linear:
    src = nn.Linear(3, 2)
    dcp.save({"model": src.state_dict(), "dataloader": Loader(TITAN), "position": Loader(POSITION),
              "extra": {"step": 7, "opaque": Opaque(marker)}}, checkpoint_id=path)
    return src


def test_stateful_entries_map_and_the_rest_is_reported(tmp_path):
    path, marker = str(tmp_path / "dcp"), str(tmp_path / "marker")
    src = _save(path, marker)
    model, loader, position, extra = nn.Linear(3, 2), Loader({}), {}, {}
    result = bcp.load(path, {"model": model, "dataloader": loader, "position": position, "extra": extra})
    assert loader.state == TITAN  # bytes values come through (pickle protocol 2 writes them via _codecs)
    assert position == POSITION  # a Stateful's plain state dict into plain extra state
    assert extra == {"step": 7}
    assert torch.equal(model.weight, src.weight) and torch.equal(model.bias, src.bias)
    assert len(result.skipped) == 1, result.skipped
    assert result.skipped[0].startswith("extra.opaque (")
    assert "os.makedirs" in result.skipped[0] and "could run code" in result.skipped[0]
    assert not os.path.exists(marker)


def test_a_plain_load_reports_nothing_skipped(tmp_path):
    path = str(tmp_path / "dcp")
    dcp.save({"model": nn.Linear(3, 2).state_dict(), "position": Loader(POSITION)}, checkpoint_id=path)
    assert bcp.load(path, {"model": nn.Linear(3, 2), "position": {}}).skipped == []


def test_what_convert_left_out_is_reported_on_later_loads(tmp_path):
    src, dst, marker = str(tmp_path / "dcp"), str(tmp_path / "ck"), str(tmp_path / "marker")
    _save(src, marker)
    assert main(["convert", "--from", "dcp", src, dst, "-q"]) == 0
    loader, position = Loader({}), {}
    result = bcp.load(dst, {"model": nn.Linear(3, 2), "dataloader": loader, "position": position})
    assert loader.state == TITAN and position == POSITION
    assert [s.split(" ", 1)[0] for s in result.skipped] == ["extra.opaque"]
    assert not os.path.exists(marker)


class TensorState:
    """A ``Stateful`` whose state dict holds tensors, as a trainer's step counter or a
    scaler's running values: DCP saves those as tensors."""

    def __init__(self, step: int, scale: float) -> None:
        self.step = torch.tensor(step)
        self.scale = torch.full((3,), scale)
        self.name = "train"
        self.loaded = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "scale": self.scale, "name": self.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.scale, self.name = state["step"], state["scale"], state["name"]
        self.loaded += 1


def test_a_stateful_with_tensors_loads_from_its_tensor_group(tmp_path):
    path = str(tmp_path / "dcp")
    saved = TensorState(41, 0.5)
    saved.name = "resumed"
    dcp.save({"model": nn.Linear(3, 2).state_dict(), "train": saved}, checkpoint_id=path)
    target = TensorState(0, 1.0)
    result = bcp.load(path, {"model": nn.Linear(3, 2), "train": target})
    assert target.loaded == 1 and result.skipped == []
    assert torch.equal(target.step, torch.tensor(41)) and torch.equal(target.scale, torch.full((3,), 0.5))
    assert target.name == "resumed"
    # a Stateful whose state_dict() is no dict cannot take a group of tensors: named
    bad = TensorState(0, 1.0)
    bad.state_dict = lambda: [1, 2]  # type: ignore[method-assign]
    try:
        bcp.load(path, {"model": nn.Linear(3, 2), "train": bad})
    except UnsupportedStateError as exc:
        assert "train" in str(exc) and "not a dict" in str(exc)
    else:
        raise AssertionError("a non-dict state_dict() was accepted")
