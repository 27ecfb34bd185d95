"""The ``bcp`` command line on real checkpoints: help and exit codes of every subcommand, ls,
inspect, verify (a flipped byte), gc (retention that never touches a save being written),
export options and bounded memory, import of a single-file model, and the service commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import bytecheckpoint as bcp
from bytecheckpoint.cli import app as cli
from bytecheckpoint.commit.integrity import begin_save
from bytecheckpoint.commit.leases import pin, read_lease
from bytecheckpoint.storage import open_storage
from bytecheckpoint.tools import export as bexport
from tests.support.helpers import same_bits

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OWN = ["ls", "inspect", "verify", "export", "import", "gc"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        self.register_buffer("scale", torch.arange(4, dtype=torch.float32))


def save_run(root: str, steps: list[int]) -> nn.Module:
    torch.manual_seed(0)
    model = Net()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in steps:
        model.body(torch.randn(4, 16)).sum().backward()
        optim.step()
        optim.zero_grad()
        bcp.save(f"{root}/step_{step}", {"model": model, "optimizer": optim, "extra_state": {"step": step}},
                 step=step, user_metadata={"note": "cli test"})
    return model


@pytest.fixture
def run_root(tmp_path):
    root = tmp_path / "ckpt" / "run1"
    model = save_run(str(root), [10, 20, 30, 40, 50])
    return root, model


# -- help everywhere -----------------------------------------------------------------------------

def test_top_level_help_lists_commands_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in OWN + list(cli.SERVICES):
        assert name in out
    assert "exit codes:" in out and "3  not a checkpoint" in out


@pytest.mark.parametrize("command", OWN)
def test_every_own_subcommand_has_help(capsys, command):
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: bcp {command}") and "exit codes:" in out


@pytest.mark.parametrize("command", list(cli.SERVICES))
def test_service_help_is_the_services_own(capsys, command):
    code, out, _ = run(capsys, command, "--help")
    assert code == 0
    assert f"usage: python -m {cli.SERVICES[command][0].removesuffix('.__main__')}" in out


def test_installed_bcp_script_runs():
    exe = os.path.join(os.path.dirname(sys.executable), "bcp")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "bytecheckpoint.cli"]
    r = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0 and "bcp (bytecheckpoint)" in r.stdout


def test_bad_usage_exits_2(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        cli.main(["gc", str(tmp_path)])  # --keep-last is required
    assert exc.value.code == 2
    code, _, err = run(capsys, "gc", str(tmp_path), "--keep-last", "0")
    assert code == cli.EXIT_USAGE and "newest committed" in err


# -- ls / inspect ----------------------------------------------------------------------------------

def test_ls_lists_committed_checkpoints_beside_a_save_in_progress(capsys, run_root):
    root, _ = run_root
    storage, path = open_storage(str(root / "step_60"))
    begin_save(storage, path, False, "inflight")  # a save being written: staging dir only
    code, out, _ = run(capsys, "ls", str(root.parent))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["CHECKPOINT", "STEP", "SIZE", "FILES"]
    assert len(lines) == 6
    assert "run1/step_50" in out and "latest" in lines[-1] and "single" in out and "1 rank" in out
    code, out, _ = run(capsys, "ls", str(root.parent), "--json")
    doc = json.loads(out)
    rows = {r["name"]: r for r in doc["checkpoints"]}
    assert sorted(rows) == [f"step_{s}" for s in (10, 20, 30, 40, 50)]
    r = rows["step_30"]
    assert r["step"] == 30 and r["committed"] and r["tier"] == "hot" and r["framework"] == "single"
    assert r["world_size"] == 1 and r["files"] == 3 and r["size"] > 0 and r["age_s"] >= 0
    assert rows["step_50"]["latest"] and not rows["step_10"]["latest"]
    # One checkpoint given directly
    code, out, _ = run(capsys, "ls", str(root / "step_20"), "--json")
    assert [r["name"] for r in json.loads(out)["checkpoints"]] == ["step_20"]


def test_ls_of_a_missing_root_exits_3(capsys, tmp_path):
    code, _, err = run(capsys, "ls", str(tmp_path / "nope"))
    assert code == cli.EXIT_NOT_A_CHECKPOINT and "no such directory" in err


def test_inspect_summarizes_tensors_layout_and_extra_state(capsys, run_root):
    root, _ = run_root
    code, out, _ = run(capsys, "inspect", str(root))  # the root: its latest checkpoint
    assert code == 0
    assert "step_50" in out and "step        50" in out
    assert "model/body.0.weight" in out and "32x16" in out and "float32" in out
    assert "optimizer/state/body.0.weight/exp_avg" in out
    assert "extra state 1 per-rank key(s): extra_state" in out
    assert '"note": "cli test"' in out
    code, out, _ = run(capsys, "inspect", str(root / "step_10"), "--json")
    doc = json.loads(out)
    t = {x["key"]: x for x in doc["tensors"]}
    assert t["model/body.0.weight"] == {"key": "model/body.0.weight", "shape": [32, 16], "dtype": "float32",
                                        "boxes": 1, "bytes": 32 * 16 * 4}
    assert doc["framework"] == "single" and doc["world_size"] == 1 and doc["step"] == 10
    assert doc["user_metadata"] == {"note": "cli test"}
    assert {f["kind"] for f in doc["files"]} == {"model", "optim", "extra"}


def test_inspect_of_a_non_checkpoint_exits_3(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "inspect", str(tmp_path / "empty"))
    assert code == cli.EXIT_NOT_A_CHECKPOINT and "is not a checkpoint" in err


def test_inspect_of_corrupt_metadata_exits_4(capsys, run_root):
    root, _ = run_root
    (root / "step_10" / "metadata.msgpack").write_bytes(b"\x00garbage")
    code, _, err = run(capsys, "inspect", str(root / "step_10"))
    assert code == cli.EXIT_CORRUPT and "metadata" in err


# -- verify ----------------------------------------------------------------------------------------

def test_verify_clean_checkpoint(capsys, run_root):
    root, _ = run_root
    code, out, _ = run(capsys, "verify", str(root / "step_30"))
    assert code == 0 and out.startswith("OK ")


def test_verify_finds_a_flipped_byte_and_names_the_file(capsys, run_root):
    root, _ = run_root
    victim = root / "step_30" / "model-00000.safetensors"
    data = bytearray(victim.read_bytes())
    data[-7] ^= 0x01
    victim.write_bytes(bytes(data))
    code, out, err = run(capsys, "verify", str(root / "step_30"))
    assert code == cli.EXIT_FAILED
    assert "BAD  model-00000.safetensors" in out and "checksum mismatch" in out
    assert "1 bad file(s): model-00000.safetensors" in err
    code, out, _ = run(capsys, "verify", str(root / "step_30"), "--json")
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False and doc["bad_files"] == ["model-00000.safetensors"]
    # the real command line, as a script would run it
    r = subprocess.run([sys.executable, "-m", "bytecheckpoint.cli", "verify", str(root / "step_30")],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 1 and "model-00000.safetensors" in r.stdout


def test_verify_truncated_file_is_named(capsys, run_root):
    root, _ = run_root
    victim = root / "step_20" / "optim-00000.safetensors"
    os.truncate(victim, victim.stat().st_size - 3)
    code, out, _ = run(capsys, "verify", str(root / "step_20"), "--json")
    assert code == 1 and json.loads(out)["bad_files"] == ["optim-00000.safetensors"]


# -- gc --------------------------------------------------------------------------------------------

def names(root) -> list[str]:
    return sorted(os.listdir(root))


def test_gc_dry_run_deletes_nothing_then_keep_last_2_deletes_3(capsys, run_root):
    root, _ = run_root
    storage, path = open_storage(str(root / "step_60"))
    staging = begin_save(storage, path, False, "inflight")  # a save being written now
    with open(os.path.join(staging, "model-00000.safetensors"), "wb") as f:
        f.write(b"partial")
    before = names(root)
    code, out, _ = run(capsys, "gc", str(root), "--keep-last", "2")
    assert code == 0 and names(root) == before
    assert out.count("would delete") == 4  # three lines and the summary
    assert "would delete 3 checkpoint(s)" in out and "pass --yes" in out
    code, out, _ = run(capsys, "gc", str(root), "--keep-last", "2", "--json")
    doc = json.loads(out)
    assert doc["dry_run"]
    assert [c["step"] for c in doc["checkpoints"] if c["action"] == "delete"] == [10, 20, 30]
    sizes = {c["step"]: c["size"] for c in doc["checkpoints"]}
    assert doc["bytes_freed"] == sizes[10] + sizes[20] + sizes[30]
    code, out, _ = run(capsys, "gc", str(root), "--keep-last", "2", "--yes")
    assert code == 0 and "deleted 3 checkpoint(s)" in out
    left = names(root)
    assert [n for n in left if n.startswith("step_")] == ["step_40", "step_50"]
    assert os.path.isdir(staging) and os.path.basename(staging) in left  # the save in progress
    assert not any(".deleting-" in n for n in left)
    bcp.load(str(root), {"model": Net()})  # latest still loads


def test_gc_keeps_every_kth_pinned_and_a_path_being_overwritten(capsys, tmp_path):
    root = tmp_path / "run"
    save_run(str(root), [1, 2, 3, 4, 5, 6])
    pin(str(root / "step_1"))
    storage, path = open_storage(str(root / "step_3"))
    begin_save(storage, path, True, "overwrite")  # a save replacing step_3 is under way
    code, out, _ = run(capsys, "gc", str(root), "--keep-last", "1", "--keep-every", "2", "--json")
    doc = {c["step"]: c for c in json.loads(out)["checkpoints"]}
    assert [s for s, c in doc.items() if c["action"] == "delete"] == [5]
    assert doc[1]["reason"] == "pinned" and doc[3]["reason"] == "a save to this path is under way"
    assert doc[2]["reason"] == "step is a multiple of 2" and doc[6]["reason"] == "named by latest"
    code, _, _ = run(capsys, "gc", str(root), "--keep-last", "1", "--keep-every", "2", "--yes")
    assert code == 0
    kept = [n for n in names(root) if n.startswith("step_")]
    assert kept == ["step_1", "step_2", "step_3", "step_4", "step_6"]


def test_gc_keeps_a_checkpoint_being_read(capsys, tmp_path):
    root = tmp_path / "run"
    save_run(str(root), [1, 2, 3])
    storage, path = open_storage(str(root / "step_1"))
    with read_lease(storage, path):  # a reader holds step_1 (as bcp.load does)
        code, out, _ = run(capsys, "gc", str(root), "--keep-last", "1", "--yes", "--json")
    assert code == 0
    doc = {c["step"]: c for c in json.loads(out)["checkpoints"]}
    assert doc[1]["reason"] == "being read (lease)" and doc[2]["deleted"]
    assert [n for n in names(root) if n.startswith("step_")] == ["step_1", "step_3"]


def test_gc_never_deletes_the_newest_committed_even_if_latest_points_elsewhere(capsys, tmp_path):
    root = tmp_path / "run"
    save_run(str(root), [1, 2, 3])
    (root / "latest").unlink()
    code, out, _ = run(capsys, "gc", str(root), "--keep-last", "1", "--yes", "--json")
    assert code == 0
    assert [n for n in names(root) if n.startswith("step_")] == ["step_3"]


# -- export options, bounded memory, import --------------------------------------------------------

def test_export_streams_one_shard_at_a_time(capsys, monkeypatch, run_root, tmp_path):
    root, model = run_root
    loaded_per_call = []
    real = bexport._load_full

    def spy(url, keys):
        loaded_per_call.append(sum(m.nbytes for _, m in keys))
        return real(url, keys)

    monkeypatch.setattr(bexport, "_load_full", spy)
    out = tmp_path / "hf"
    code, stdout, err = run(capsys, "export", str(root), str(out), "--max-shard-size", "1KiB", "--tied", "",
                            "--strip-prefix", "body.", "--rename", r"^(\d)\.=layer\1.", "--dtype", "bf16")
    assert code == 0, err
    assert "no config.json written" in err
    assert loaded_per_call and max(loaded_per_call) <= 32 * 16 * 4  # one shard (or one big tensor)
    index = json.load(open(out / "model.safetensors.index.json"))
    assert sorted(index["weight_map"]) == ["layer0.bias", "layer0.weight", "layer2.bias", "layer2.weight",
                                           "scale"]
    got = {}
    for f in set(index["weight_map"].values()):
        got.update(load_file(str(out / f)))
    assert got["layer0.weight"].dtype == torch.bfloat16
    assert same_bits(got["layer0.weight"], model.body[0].weight.detach().to(torch.bfloat16))
    assert same_bits(got["scale"], model.scale.to(torch.bfloat16))


def test_export_errors_have_exit_codes(capsys, run_root, tmp_path):
    root, _ = run_root
    out = tmp_path / "hf"
    code, _, err = run(capsys, "export", str(root), str(out), "--rename", "^.*$=same")
    assert code == cli.EXIT_USAGE and "would both be exported as 'same'" in err
    code, _, err = run(capsys, "export", str(root), str(out), "--max-shard-size", "lots")
    assert code == cli.EXIT_USAGE and "size 'lots'" in err
    code, _, err = run(capsys, "export", str(root), str(out), "--dtype", "int4")
    assert code == cli.EXIT_USAGE and "--dtype" in err
    assert run(capsys, "export", str(root), str(out))[0] == 0
    code, _, err = run(capsys, "export", str(root), str(out))
    assert code == cli.EXIT_EXISTS and "--overwrite" in err
    assert run(capsys, "export", str(root), str(out), "--overwrite")[0] == 0
    code, _, err = run(capsys, "export", str(tmp_path / "nothing"), str(tmp_path / "o2"))
    assert code == cli.EXIT_NOT_A_CHECKPOINT


def test_import_single_file_model_reshards_on_load(capsys, tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    torch.manual_seed(1)
    ref = Net()
    save_file({f"body.{k}": v.contiguous() for k, v in ref.body.state_dict().items()} | {"scale": ref.scale},
              str(src / "model.safetensors"))
    code, out, err = run(capsys, "import", str(src), str(tmp_path / "ck" / "step_0"), "--json")
    assert code == 0, err
    assert json.loads(out)["tensors"] == 5
    target = Net()
    bcp.load(str(tmp_path / "ck"), {"model": target})
    for (k, a), (_, b) in zip(ref.state_dict().items(), target.state_dict().items()):
        assert same_bits(a, b), k
    code, _, err = run(capsys, "import", str(tmp_path), str(tmp_path / "ck2"))
    assert code == cli.EXIT_USAGE and "not a Hugging Face model directory" in err
    code, _, err = run(capsys, "import", str(src), str(tmp_path / "ck" / "step_0"))
    assert code == cli.EXIT_EXISTS


def test_import_refuses_an_index_naming_a_file_outside(capsys, tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    index = {"weight_map": {"w": "../evil.safetensors"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    code, _, err = run(capsys, "import", str(src), str(tmp_path / "ck"))
    assert code == cli.EXIT_USAGE and "not a plain file name" in err


# -- services --------------------------------------------------------------------------------------

def test_tier_runs_the_tiering_service(capsys, run_root, tmp_path):
    root, _ = run_root
    cold = tmp_path / "cold"
    cold.mkdir()
    code, out, _ = run(capsys, "tier", "--once", "--dry-run", "--hot", str(root.parent), "--cold", str(cold),
                       "--cool-after", "0", "--keep-newest", "1")
    assert code == 0
    assert "would cool" in out and "run1/step_10" in out
    code, _, _ = run(capsys, "tier", "--once", "--hot", "")  # the service's own bad-setting code
    assert code == 2


def test_ls_shows_cold_checkpoints_and_gc_deletes_their_cold_copies(capsys, run_root, tmp_path):
    root, _ = run_root
    cold = tmp_path / "cold"
    cold.mkdir()
    code, _, _ = run(capsys, "tier", "--once", "--hot", str(root.parent), "--cold", str(cold),
                     "--cool-after", "0", "--keep-newest", "2")
    assert code == 0
    code, out, _ = run(capsys, "ls", str(root.parent), "--cold", str(cold), "--json")
    tiers = {r["step"]: r["tier"] for r in json.loads(out)["checkpoints"]}
    assert tiers == {10: "cold", 20: "cold", 30: "cold", 40: "hot", 50: "hot"}
    cold_copy = cold / "run1" / "step_10"
    assert any(cold_copy.iterdir())
    code, out, _ = run(capsys, "gc", str(root), "--keep-last", "3", "--cold", str(cold), "--yes")
    assert code == 0 and "deleted 2 checkpoint(s)" in out
    assert not (root / "step_10").exists() and not cold_copy.exists()
    assert bcp.verify(str(root / "step_30")) == []  # a cold one kept: still whole through its links
