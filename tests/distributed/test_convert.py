"""``bcp convert``: DCP and torch.save into bytecheckpoint and back, bit for bit, with bounded
memory, through the real command line."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from typing import Any

import pytest
import torch

from bytecheckpoint.cli.app import main
from tests.support import dcp_workloads as w
from tests.support.frameworks import fsdp2_train_save_canonical
from tests.support.helpers import assert_same_state as assert_same
from tests.support.helpers import same_bits

EXTRA = {"step": 2, "name": "run-7", "sizes": [1, 2.5]}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bcp(*argv: str) -> int:
    return main(["convert", *argv])


@pytest.fixture(scope="module")
def dcp_dir(world, tmp_path_factory) -> tuple[str, dict[str, Any]]:
    path = str(tmp_path_factory.mktemp("dcp") / "fsdp2")
    return path, world(4).run(w.dcp_fsdp2_save, path, 2, EXTRA)[0]


def test_from_dcp_loads_on_2_ranks_and_verifies(world, dcp_dir, tmp_path):
    src, ref = dcp_dir
    dst = str(tmp_path / "converted")
    assert bcp("--from", "dcp", src, dst, "--max-memory", "1MiB", "-q") == 0
    assert "metadata.msgpack" in os.listdir(dst)
    assert main(["verify", dst, "-q"]) == 0
    for got in world(2).run(w.bcp_fsdp2_load, dst):
        assert_same(ref, got)
    got = w.bcp_plain_load(dst, extra=True)  # one process, with the extra state DCP stored
    assert_same(ref, got["canonical"])
    assert got["extra"] == EXTRA


def test_to_dcp_loads_with_dcp_into_fsdp2_on_2_ranks(world, tmp_path):
    src, dst = str(tmp_path / "ck"), str(tmp_path / "dcp")
    ref = world(2).run(fsdp2_train_save_canonical, src, 2)[0]
    assert bcp("--to", "dcp", src, dst, "--max-memory", "1MiB", "-q") == 0
    assert ".metadata" in os.listdir(dst)
    assert len([n for n in os.listdir(dst) if n.endswith(".distcp")]) > 1  # several batches
    for got in world(2).run(w.dcp_fsdp2_load, dst):
        assert_same(ref, got)


def test_round_trip_dcp_to_bcp_to_dcp(world, dcp_dir, tmp_path):
    src, ref = dcp_dir
    mid, back = str(tmp_path / "mid"), str(tmp_path / "back")
    assert bcp("--from", "dcp", src, mid, "-q") == 0
    assert bcp("--to", "dcp", mid, back, "-q") == 0
    for got in world(2).run(w.dcp_fsdp2_load, back):
        assert_same(ref, got)


def test_from_torch_full_state_dict(tmp_path):
    sd = {"layer.weight": torch.randn(7, 5), "layer.bias": torch.arange(5, dtype=torch.bfloat16),
          "count": torch.tensor(3, dtype=torch.int64), "t": torch.randn(6, 3).t(),  # strided
          "empty": torch.zeros(0, 4)}
    src, dst = str(tmp_path / "model.pt"), str(tmp_path / "ck")
    torch.save(sd, src)
    assert bcp("--from", "torch", src, dst, "-q") == 0
    assert main(["verify", dst, "-q"]) == 0
    import bytecheckpoint as bcp_lib
    from bytecheckpoint.state.flatten import TensorShard

    target = {k: TensorShard(torch.empty_like(v), tuple(v.shape)) for k, v in sd.items()}
    bcp_lib.load(dst, {"model": target}, framework="manual")
    for k, v in sd.items():
        assert same_bits(v, target[k].data), k


def test_dst_overlapping_src_is_refused(dcp_dir, tmp_path, capsys):
    src, _ = dcp_dir
    before = sorted(os.listdir(src))
    assert bcp("--from", "dcp", src, os.path.join(src, "inside")) == 2
    assert bcp("--to", "dcp", src, src, "--overwrite") == 2
    err = capsys.readouterr().err
    assert "overlaps SRC" in err and "is SRC" in err, err
    assert sorted(os.listdir(src)) == before


class Evil:
    def __reduce__(self):  # would run code under the standard unpickler
        return (os.system, ("touch MARKER",))


def test_from_torch_refuses_what_weights_only_refuses(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = str(tmp_path / "evil.pt")
    torch.save({"w": torch.ones(2), "evil": Evil()}, src)
    code = bcp("--from", "torch", src, str(tmp_path / "ck"))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "refused" in err and "weights_only" in err and len(err.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "MARKER")
    assert not os.path.exists(tmp_path / "ck")


def test_hostile_dcp_metadata_runs_no_code(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "dcp"
    src.mkdir()
    (src / ".metadata").write_bytes(pickle.dumps(Evil()))
    assert bcp("--from", "dcp", str(src), str(tmp_path / "ck")) == 4
    err = capsys.readouterr().err
    assert "posix.system" in err or "system" in err, err
    assert not os.path.exists(tmp_path / "MARKER")
    assert not os.path.exists(tmp_path / "ck")


def test_damaged_object_is_named_on_the_way_back(tmp_path, capsys):
    import bytecheckpoint as bcp_lib
    from bytecheckpoint.commit.integrity import read_metadata, resolve

    src = str(tmp_path / "ck")
    bcp_lib.save(src, {"model": {"w": torch.ones(3)}, "extra": {"note": "x" * 100}})
    storage, path = resolve(src)
    obj = read_metadata(storage, path).objects[0].bytes
    with open(os.path.join(src, obj.file), "r+b") as f:
        f.seek(obj.byte_offset + obj.byte_length - 3)
        f.write(b"zzz")
    assert bcp("--to", "dcp", src, str(tmp_path / "out"), "-q") == 4
    assert "checksum" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["ck", "latest"]  # no output, nothing half-built beside it


def test_not_a_torch_file_is_a_named_error(tmp_path, capsys):
    src = tmp_path / "junk.pt"
    src.write_bytes(b"not a zip at all" * 10)
    assert bcp("--from", "torch", str(src), str(tmp_path / "ck")) == 2
    assert "not a readable torch.save file" in capsys.readouterr().err


def test_existing_dst_refused_unless_overwrite(dcp_dir, tmp_path, capsys):
    src, _ = dcp_dir
    dst, back = str(tmp_path / "ck"), str(tmp_path / "back")
    assert bcp("--from", "dcp", src, dst, "-q") == 0
    assert bcp("--from", "dcp", src, dst, "-q") == 5
    assert "--overwrite" in capsys.readouterr().err
    assert bcp("--from", "dcp", src, dst, "-q", "--overwrite") == 0
    assert bcp("--to", "dcp", dst, back, "-q") == 0
    assert bcp("--to", "dcp", dst, back, "-q") == 5
    assert bcp("--to", "dcp", dst, back, "-q", "--overwrite") == 0
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert bcp("--to", "dcp", dst, str(other), "-q", "--overwrite") == 3  # never replaces a stranger
    assert bcp("--from", "dcp", dst, str(tmp_path / "again"), "-q") == 3  # a bcp checkpoint, not DCP
    assert (other / "keep.txt").read_text() == "mine"


def test_wrong_direction_and_bad_cap_are_usage_errors(dcp_dir, tmp_path, capsys):
    src, _ = dcp_dir
    assert bcp("--from", "dcp", src, str(tmp_path / "a"), "--max-memory", "12") == 2
    assert bcp("--from", "dcp", src, str(tmp_path / "b"), "--max-memory", "lots") == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert bcp("--from", "dcp", str(empty), str(tmp_path / "c")) == 3  # no .metadata there
    assert bcp("--from", "dcp", str(tmp_path / "missing"), str(tmp_path / "d")) == 3
    err = capsys.readouterr().err
    assert "Traceback" not in err


def test_convert_help_does_not_import_torch():
    probe = ("import sys\nfrom bytecheckpoint.cli.app import main\ntry:\n    main(['convert', '--help'])\n"
             "except SystemExit as exc:\n    print(exc.code)\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.split()[-2:] == ["0", "False"], out.stderr
