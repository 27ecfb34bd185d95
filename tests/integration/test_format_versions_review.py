"""Format versions and compatibility, from a review (2026-11-27): every earlier format's fixture
through resharding and the tools, version fields that are not a version this library reads,
and saves over checkpoints of other formats. Values are compared bit for bit with what
tests/support/make_format_fixture.py wrote into each fixture."""

from __future__ import annotations

import json
import os
import shutil

import msgpack
import pytest
import torch
from safetensors.torch import load_file

import bytecheckpoint as bcp
from bytecheckpoint.cli.app import main as bcp_main
from bytecheckpoint.errors import CorruptCheckpointError, NotACheckpointError
from bytecheckpoint.format.metadata import FORMAT_VERSION, pack_document, unpack_document
from tests.support import format_versions_workloads as w
from tests.support.make_format_fixture import build

VERSIONS = w.VERSIONS
_ABSENT = object()


def _fixture(tmp_path, v: int) -> str:
    root = str(tmp_path / f"v{v}")
    shutil.copytree(os.path.join(w.FIXTURES, f"format_v{v}"), root)
    return root


def _rewrite(ckpt: str, sealed: bool, **fields: object) -> None:
    """Set (or, with _ABSENT, remove) fields of a checkpoint's metadata document."""
    meta = os.path.join(ckpt, "metadata.msgpack")
    with open(meta, "rb") as f:
        doc = unpack_document(f.read())
    for k, v in fields.items():
        if v is _ABSENT:
            doc.pop(k, None)
        else:
            doc[k] = v
    with open(meta, "wb") as f:
        f.write(pack_document(doc) if sealed else msgpack.packb(doc, use_bin_type=True))


def _state() -> dict:
    model, optim, _ = build()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return {"model": model, "optimizer": optim, "extra_state": {}}


# -- 1. every earlier format, resharded and through the tools (guards: these passed already) ----

def test_every_fixture_loads_resharded_onto_two_ranks(world, tmp_path):
    for got in world(2).run(w.load_fixtures_resharded, str(tmp_path)):
        assert got == {f"v{v} verify={b}": [] for v in VERSIONS for b in (True, False)}, got


@pytest.mark.parametrize("v", VERSIONS)
def test_every_fixture_exports_and_converts_bit_exact(tmp_path, v, capsys):
    root = _fixture(tmp_path, v)
    want = load_file(os.path.join(root, "expected.safetensors"))
    assert bcp_main(["verify", "-q", root]) == 0
    capsys.readouterr()
    assert bcp_main(["inspect", "--json", f"{root}/ckpt"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["step"] == 3 and shown["world_size"] == 1 and shown["user_metadata"] == {"fixture": True}
    assert bcp_main(["export", "-q", "--include-optimizer", f"{root}/ckpt", f"{root}/hf"]) == 0
    got: dict[str, torch.Tensor] = {}
    for name in os.listdir(f"{root}/hf"):
        if name.endswith(".safetensors"):
            got.update(load_file(f"{root}/hf/{name}"))
    names = ["0.weight", "0.bias", "1.weight", "1.bias"]
    for k, t in want.items():
        i = k.split(".")[1]
        key = k[len("model."):] if k.startswith("model.") else f"{names[int(i)]}.momentum_buffer"
        assert torch.equal(got[key], t), k
    assert bcp_main(["convert", "-q", "--to", "dcp", f"{root}/ckpt", f"{root}/dcp"]) == 0
    back = _state()
    bcp.load(f"{root}/dcp", {"model": back["model"]})
    for k, t in back["model"].state_dict().items():
        assert torch.equal(t, want[f"model.{k}"]), k


# -- 2. a version field this library does not read ------------------------------------------

@pytest.mark.parametrize("sealed", [True, False])
@pytest.mark.parametrize("version", [0, -1, "4", 4.0, None, True, [4], _ABSENT, -(1 << 63)])
def test_a_version_that_is_not_one_is_refused_by_name(tmp_path, sealed, version):
    root = _fixture(tmp_path, 4)
    _rewrite(f"{root}/ckpt", sealed, version=version)
    with pytest.raises(CorruptCheckpointError, match="malformed metadata: format version"):
        bcp.load(f"{root}/ckpt", _state())


@pytest.mark.parametrize("sealed", [True, False])
@pytest.mark.parametrize("version", [FORMAT_VERSION + 1, 1 << 40, (1 << 64) - 1])
def test_a_newer_version_is_refused_with_upgrade(tmp_path, sealed, version):
    root = _fixture(tmp_path, 4)
    _rewrite(f"{root}/ckpt", sealed, version=version)
    with pytest.raises(CorruptCheckpointError, match=f"version {version} is newer .* upgrade bytecheckpoint"):
        bcp.load(root, _state())  # through latest too


def test_a_later_metadata_envelope_is_refused_with_upgrade(tmp_path):
    # Was: "not a readable metadata file (ExtraData(66, b'CPMETA\x01...<the whole file>))": the
    # magic's first byte read as a msgpack number, nothing said to upgrade.
    root = _fixture(tmp_path, 4)
    meta = f"{root}/ckpt/metadata.msgpack"
    with open(meta, "rb") as f:
        raw = f.read()
    with open(meta, "wb") as f:
        f.write(b"BCPMETA\x01" + raw[8:])
    with pytest.raises(CorruptCheckpointError, match="newer than this library .* upgrade bytecheckpoint"):
        bcp.load(f"{root}/ckpt", _state())
    with pytest.raises(NotACheckpointError, match="a later metadata header, newer .* Upgrade"):
        bcp.save(f"{root}/ckpt", {"model": torch.nn.Linear(2, 2)}, overwrite=True)


def test_unreadable_metadata_is_reported_in_a_short_message(tmp_path):
    # Was: the message held the repr of every byte after the first msgpack value (4 MiB of it
    # for a 1 MiB file).
    root = _fixture(tmp_path, 1)
    with open(f"{root}/ckpt/metadata.msgpack", "wb") as f:
        f.write(b"\x05" + b"x" * (1 << 20))
    with pytest.raises(CorruptCheckpointError, match="not a readable metadata file") as info:
        bcp.load(f"{root}/ckpt", _state())
    assert len(str(info.value)) < 1000


# -- 3. features of one version in a file that claims another --------------------------------

@pytest.mark.parametrize("claimed", [3, 4])
def test_unaligned_pieces_under_a_claimed_later_version_still_load_exactly(tmp_path, claimed):
    """Format 2 pieces (no padding, off the 64-byte boundary) in a file that says 3 or 4:
    alignment is a speed rule, offsets come from the metadata, so the values are exact."""
    root = _fixture(tmp_path, 2)
    _rewrite(f"{root}/ckpt", True, version=claimed)
    want = load_file(os.path.join(root, "expected.safetensors"))
    for verify in (True, False):
        state = _state()
        bcp.load(f"{root}/ckpt", state, verify=verify)
        for k, t in state["model"].state_dict().items():
            assert torch.equal(t, want[f"model.{k}"]), k
    assert bcp.verify(f"{root}/ckpt") == []


def test_padding_in_a_file_that_claims_format_1_is_refused_when_verified(tmp_path):
    root = _fixture(tmp_path, 4)
    _rewrite(f"{root}/ckpt", False, version=1)
    with pytest.raises(CorruptCheckpointError, match="header lists"):
        bcp.load(f"{root}/ckpt", _state(), verify=True)
    assert bcp.verify(f"{root}/ckpt")
    _rewrite(f"{root}/ckpt", False, version=4)  # a format 4 document without its header
    with pytest.raises(CorruptCheckpointError, match="lacks the checksum header"):
        bcp.load(f"{root}/ckpt", _state())


# -- 5. saves over and beside checkpoints of earlier formats ---------------------------------

@pytest.mark.parametrize("v", VERSIONS)
def test_overwrite_replaces_a_damaged_checkpoint_of_every_format(tmp_path, v):
    # Was (formats 2 to 4): NotACheckpointError "metadata.msgpack is not bytecheckpoint metadata,
    # so this is not a checkpoint of ours": the damaged document was read from byte 0, through
    # its magic. Format 1 (no magic) was replaced, as intended.
    root = _fixture(tmp_path, v)
    meta = f"{root}/ckpt/metadata.msgpack"
    with open(meta, "rb") as f:
        raw = bytearray(f.read())
    raw[-3] ^= 0x10
    with open(meta, "wb") as f:
        f.write(raw)
    model = torch.nn.Linear(2, 2)
    bcp.save(f"{root}/ckpt", {"model": model}, step=9, overwrite=True)
    back = torch.nn.Linear(2, 2)
    assert bcp.load(root, {"model": back}).step == 9
    assert torch.equal(back.weight, model.weight)
    assert sorted(os.listdir(f"{root}/ckpt")) == ["metadata.msgpack", "model-00000.safetensors"]


@pytest.mark.parametrize("sealed", [True, False])
def test_overwrite_leaves_a_newer_format_checkpoint_and_says_upgrade(tmp_path, sealed):
    # Was (sealed): "not bytecheckpoint metadata, so this is not a checkpoint of ours".
    root = _fixture(tmp_path, 4)
    _rewrite(f"{root}/ckpt", sealed, version=FORMAT_VERSION + 1)
    before = sorted(os.listdir(f"{root}/ckpt"))
    with pytest.raises(NotACheckpointError, match=f"format version {FORMAT_VERSION + 1}, newer .* Upgrade"):
        bcp.save(f"{root}/ckpt", {"model": torch.nn.Linear(2, 2)}, overwrite=True)
    assert sorted(os.listdir(f"{root}/ckpt")) == before


@pytest.mark.parametrize("v", VERSIONS)
def test_overwrite_of_each_format_writes_the_current_one(tmp_path, v):
    root = _fixture(tmp_path, v)
    bcp.save(f"{root}/ckpt", {"model": torch.nn.Linear(2, 2)}, step=9, overwrite=True)
    with open(f"{root}/ckpt/metadata.msgpack", "rb") as f:
        assert unpack_document(f.read())["version"] == FORMAT_VERSION
    with open(f"{root}/latest") as f:
        assert json.load(f)["step"] == 9


def test_manager_restores_and_retains_across_the_format_boundary(tmp_path):
    """A root of format 1, 2 and 3 checkpoints with ``latest`` on the format 3 one: the manager
    restores exactly that one, a new save (current format) becomes ``latest``, and retention
    deletes the oldest of the old ones, whatever their format."""
    from bytecheckpoint.manage.retention import KeepLast
    from bytecheckpoint.manager import CheckpointManager

    root = str(tmp_path / "run")
    for v in (1, 2, 3):
        shutil.copytree(os.path.join(w.FIXTURES, f"format_v{v}", "ckpt"), f"{root}/step_{v}")
        _rewrite(f"{root}/step_{v}", v >= 2, step=v)
    with open(f"{root}/latest", "w") as f:
        json.dump({"checkpoint": "step_3", "step": 3, "time": 1.0}, f)
    want = load_file(os.path.join(w.FIXTURES, "format_v3", "expected.safetensors"))
    with CheckpointManager(root, retention=KeepLast(2), async_save=False) as mgr:
        state = _state()
        assert mgr.restore(state) == 3
        for k, t in state["model"].state_dict().items():
            assert torch.equal(t, want[f"model.{k}"]), k
        assert mgr.save(4, state, force=True)
        assert sorted(os.listdir(root)) == ["latest", "step_3", "step_4"]
        assert mgr.restore(_state(), step=3) == 3
    with open(f"{root}/latest") as f:
        assert json.load(f)["checkpoint"] == "step_4"
