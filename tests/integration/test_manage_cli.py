"""``bcp ls`` and ``bcp gc`` agree with the tiering service about what is where: a cooled
checkpoint is recognised from its links alone (no --cold), gc never deletes one without its
cold copies (it refuses and names the flag), gc and a tiering pass never work on one cold
tier at once, and both commands work on ``s3://`` roots (moto) through the storage layer."""

from __future__ import annotations

import json
import os
import time

import torch

import bytecheckpoint as bcp
from bytecheckpoint.cli import app as cli
from bytecheckpoint.manage.journal import exclusive
from bytecheckpoint.storage import open_storage
from storage_tiering import load_config, run_once
from tests.support.servers import s3_root

DAY = 86400.0


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(32, dtype=torch.float32) * step}


def _run(root: str, steps: range) -> None:
    for s in steps:
        bcp.save(f"{root}/step_{s}", {"model": _state(s)}, step=s)


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _cooled(tmp_path) -> tuple[str, str]:
    """hot/run with steps 1-4; steps 1 and 2 cooled into cold/."""
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    os.makedirs(cold)
    _run(f"{hot}/run", range(1, 5))
    report = run_once(load_config(hot=hot, cold=cold, cool_after="1d", keep_newest=2),
                      now=time.time() + 2 * DAY)
    assert len(report.cooled) == 2 and not report.failed, report.failed
    return hot, cold


def _loads_as(path: str, step: int) -> None:
    target = {"model": {"w": torch.zeros(32)}}
    bcp.load(path, target)
    assert torch.equal(target["model"]["w"], _state(step)["w"])


def test_ls_without_cold_recognises_a_cooled_checkpoint_from_its_links(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("BCP_TIERING_COLD", raising=False)
    hot, _ = _cooled(tmp_path)
    code, out, _ = _cli(capsys, "ls", hot, "--json")
    assert code == 0
    tiers = {r["step"]: r["tier"] for r in json.loads(out)["checkpoints"]}
    assert tiers == {1: "cold", 2: "cold", 3: "hot", 4: "hot"}
    # One file made hot again by hand: partial, still from the links alone.
    ckpt = f"{hot}/run/step_1"
    name = next(n for n in sorted(os.listdir(ckpt)) if n.endswith(".safetensors"))
    real = os.path.realpath(f"{ckpt}/{name}")
    os.unlink(f"{ckpt}/{name}")
    with open(real, "rb") as src, open(f"{ckpt}/{name}", "wb") as dst:
        dst.write(src.read())
    code, out, _ = _cli(capsys, "ls", hot)
    line = next(x for x in out.splitlines() if "run/step_1" in x)
    assert " partial " in line


def test_gc_without_cold_refuses_a_cooled_checkpoint_and_names_the_flag(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("BCP_TIERING_COLD", raising=False)
    hot, cold = _cooled(tmp_path)
    cold_files = sorted(os.listdir(f"{cold}/run/step_1"))
    code, out, err = _cli(capsys, "gc", hot, "--keep-last", "1", "--yes", "--json")
    assert code == cli.EXIT_FAILED
    doc = json.loads(out)
    refused = doc["failed"]
    assert set(refused) == {f"{hot}/run/step_1", f"{hot}/run/step_2"}
    assert all(f"--cold {cold}" in why for why in refused.values()), refused
    # Nothing of the cooled ones went: they still load through their links.
    assert sorted(os.listdir(f"{cold}/run/step_1")) == cold_files
    _loads_as(f"{hot}/run/step_1", 1)
    # step_3 (hot) went, and only its bytes are counted as freed.
    assert not os.path.exists(f"{hot}/run/step_3")
    sizes = {c["step"]: c["size"] for c in doc["checkpoints"]}
    assert doc["bytes_freed"] == sizes[3]
    # The text output says it too, without claiming the cooled ones' bytes.
    code, out, err = _cli(capsys, "gc", hot, "--keep-last", "1")
    assert "REFUSED" in out and "would delete 0 checkpoint(s), 0 B would be freed" in out
    assert f"--cold {cold}" in err
    # Given the flag, gc deletes them with their cold copies.
    code, out, err = _cli(capsys, "gc", hot, "--keep-last", "1", "--cold", cold, "--yes")
    assert code == 0, err
    assert "deleted 2 checkpoint(s)" in out
    assert not os.path.exists(f"{hot}/run/step_1") and not os.path.exists(f"{cold}/run")
    _loads_as(f"{hot}/run", 4)


def test_gc_dry_run_counts_only_cold_copies_no_other_checkpoint_uses(capsys, tmp_path):
    hot, cold = _cooled(tmp_path)
    os.makedirs(f"{hot}/copy")
    os.system(f"cp -a {hot}/run/step_1 {hot}/copy/step_1")  # shares step_1's cold files
    code, out, _ = _cli(capsys, "gc", f"{hot}/run", "--keep-last", "3", "--cold", cold, "--json")
    doc = json.loads(out)
    assert [c["step"] for c in doc["checkpoints"] if c["action"] == "delete"] == [1]
    links_only = sum(os.lstat(f"{hot}/run/step_1/{n}").st_size for n in os.listdir(f"{hot}/run/step_1")
                     if not os.path.islink(f"{hot}/run/step_1/{n}"))
    assert doc["bytes_freed"] == links_only  # the cold copies stay: the copy uses them
    code, _, err = _cli(capsys, "gc", f"{hot}/run", "--keep-last", "3", "--cold", cold, "--yes")
    assert code == 0, err
    _loads_as(f"{hot}/copy/step_1", 1)


def test_gc_with_cold_waits_for_no_tiering_pass(capsys, tmp_path):
    hot, cold = _cooled(tmp_path)
    with exclusive(cold):  # a tiering pass holds the cold tier
        code, _, err = _cli(capsys, "gc", hot, "--keep-last", "1", "--cold", cold, "--yes")
    assert code == cli.EXIT_FAILED and "holds" in err and ".tiering.lock" in err
    assert sorted(os.listdir(f"{hot}/run")) == ["latest", "step_1", "step_2", "step_3", "step_4"]


def test_ls_and_gc_on_an_s3_root(capsys):
    root = s3_root("runs")
    _run(f"{root}/a", range(1, 4))
    _run(f"{root}/b", range(1, 2))
    code, out, err = _cli(capsys, "ls", root, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["root"] == root
    got = {(r["run"], r["step"]): r for r in doc["checkpoints"]}
    assert sorted(got) == [("a", 1), ("a", 2), ("a", 3), ("b", 1)]
    assert got[("a", 3)]["latest"] and got[("a", 2)]["tier"] == "s3" and got[("a", 2)]["world_size"] == 1
    code, out, _ = _cli(capsys, "ls", f"{root}/a/step_2")  # one checkpoint given directly
    assert code == 0 and "step_2" in out and "step_1" not in out
    code, out, err = _cli(capsys, "gc", f"{root}/a", "--keep-last", "1", "--yes", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert sorted(c["step"] for c in doc["checkpoints"] if c["deleted"]) == [1, 2]
    storage, path = open_storage(f"{root}/a")
    assert sorted(storage.list_dir(path)) == ["latest", "step_3"]
    _loads_as(f"{root}/a", 3)
    code, _, err = _cli(capsys, "gc", root, "--keep-last", "1", "--cold", "/tmp")
    assert code == cli.EXIT_USAGE and "local roots" in err


def test_bcp_tier_help_does_not_import_torch():
    import subprocess
    import sys

    probe = ("import sys\nfrom bytecheckpoint.cli.app import main\ntry:\n    main(['tier', '--help'])\n"
             "except SystemExit:\n    pass\nprint('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", probe], cwd=repo, capture_output=True, text=True,
                          timeout=120)
    assert "usage: python -m storage_tiering" in done.stdout, done.stderr
    assert done.stdout.splitlines()[-1] == "NO-TORCH", done.stdout
