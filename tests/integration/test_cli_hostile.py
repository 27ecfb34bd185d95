"""``bcp`` run as an unlucky operator or an attacker would, each case in a real subprocess:
the answer is a one-line message and a documented exit code, never a traceback, a hang or a
leaked password."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

import bytecheckpoint as bcp
from bytecheckpoint.cli import app as cli
from bytecheckpoint.format.metadata import METADATA_FILE, pack_document, unpack_document

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bcp_cli(*argv: str, timeout: float = 60,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    full_env.pop("BCP_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "bytecheckpoint.cli", *argv], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("hostile")
    for s in (1, 2):
        bcp.save(f"{base}/run/step_{s}", {"model": {"w": torch.arange(256.0) + s}}, step=s)
    return str(base / "run")


@pytest.fixture
def ckpt(root, tmp_path) -> str:
    """A private copy of one committed checkpoint, free to damage."""
    dst = str(tmp_path / "run" / "step_1")
    shutil.copytree(f"{root}/step_1", dst)
    return dst


def _data_file(ckpt: str) -> str:
    return os.path.join(ckpt, next(n for n in sorted(os.listdir(ckpt)) if n.endswith(".safetensors")))


@pytest.mark.parametrize("target", ["file", "/dev/null"])
def test_verify_of_a_file_is_not_a_checkpoint(tmp_path, target):
    if target == "file":
        target = str(tmp_path / "notes.txt")
        with open(target, "w") as f:
            f.write("hello")
    proc = bcp_cli("verify", target)
    assert proc.returncode == cli.EXIT_NOT_A_CHECKPOINT, proc.stderr
    assert "not a checkpoint" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["verify", "{root}", "--threads", "0"],
                                  ["inspect", "{root}", "--max-rows", "-1"],
                                  ["gc", "/", "--keep-last", "1"]])
def test_bad_option_values_are_usage_errors(root, argv):
    proc = bcp_cli(*[a.format(root=root) for a in argv])
    assert proc.returncode == cli.EXIT_USAGE, proc.stderr


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_data_file_replaced_by_a_directory_or_fifo_is_named_never_waited_on(ckpt, kind):
    data = _data_file(ckpt)
    os.unlink(data)
    if kind == "directory":
        os.mkdir(data)
    else:
        os.mkfifo(data)
    proc = bcp_cli("verify", ckpt, timeout=60)
    assert proc.returncode in (cli.EXIT_FAILED, cli.EXIT_CORRUPT, cli.EXIT_STORAGE), proc.stderr
    assert os.path.basename(data) in proc.stdout + proc.stderr
    # The library's load answers with a named error too, and never opens the FIFO.
    code = ("import sys, torch, bytecheckpoint as bcp\n"
            "try:\n"
            f"    bcp.load({ckpt!r}, {{'model': {{'w': torch.zeros(256)}}}})\n"
            "except bcp.CheckpointError as e:\n"
            "    print(type(e).__name__, e); sys.exit(3)\n")
    load = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert load.returncode == 3 and "Traceback" not in load.stderr, load.stderr


def test_inspect_with_a_created_at_beyond_any_date(ckpt):
    path = os.path.join(ckpt, METADATA_FILE)
    with open(path, "rb") as f:
        doc = unpack_document(f.read())
    doc["created_at"] = 1e20
    with open(path, "wb") as f:
        f.write(pack_document(doc))
    proc = bcp_cli("inspect", ckpt)
    assert proc.returncode in (cli.EXIT_OK, cli.EXIT_CORRUPT), proc.stderr


def test_ls_into_a_closed_pipe_exits_quietly(root):
    proc = subprocess.Popen([sys.executable, "-m", "bytecheckpoint.cli", "ls", root, "--json"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader (head) is gone before a byte is written
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == cli.EXIT_BROKEN_PIPE
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize("url", ["s3://", "s3://AKIA:secret@bucket/x"])
def test_an_s3_url_without_a_bucket_is_a_usage_error_at_once(url):
    started = time.monotonic()
    proc = bcp_cli("inspect", url, timeout=30)
    assert proc.returncode == cli.EXIT_USAGE, proc.stderr
    assert time.monotonic() - started < 20 and "bucket" in proc.stderr
    assert "secret" not in proc.stderr


def _hf_model(tmp_path) -> str:
    src = tmp_path / "hf"
    src.mkdir()
    save_file({"w": torch.arange(4096.0)}, str(src / "model.safetensors"))
    return str(src)


def test_a_full_disk_names_the_path_and_the_errno(tmp_path):
    dst = str(tmp_path / "ckpt" / "step_0")
    proc = bcp_cli("import", _hf_model(tmp_path), dst, "-q",
                   env={"BCP_STORAGE_FAULTS": "errno=ENOSPC;fail_call=1;ops=write"})
    assert proc.returncode == cli.EXIT_STORAGE, proc.stderr
    assert "ENOSPC" in proc.stderr and str(tmp_path / "ckpt") in proc.stderr and "write" in proc.stderr
    assert not os.path.exists(dst)


def test_a_dsn_error_never_shows_the_password(tmp_path):
    proc = bcp_cli("ingest", "--spool", str(tmp_path), "--once", "--dsn", "mysql://bob:hunter2@db:3306/bcp")
    assert proc.returncode != 0
    assert "hunter2" not in proc.stdout + proc.stderr and "mysql://bob:***@db" in proc.stderr


def test_export_into_or_over_the_checkpoint_is_refused(ckpt):
    before = sorted(os.listdir(ckpt))
    for out in (ckpt, os.path.join(ckpt, "hf"), os.path.join(ckpt, "..", os.path.basename(ckpt)),
                os.path.dirname(ckpt)):
        proc = bcp_cli("export", ckpt, out, "--overwrite", "-q")
        assert proc.returncode == cli.EXIT_USAGE, (out, proc.stderr)
    assert sorted(os.listdir(ckpt)) == before
    bcp.load(ckpt, {"model": {"w": torch.zeros(256)}})


def test_an_unexpected_error_is_one_line_and_a_traceback_only_with_debug(monkeypatch, capsys, root):
    def broken(args):
        raise RuntimeError("something the code did not foresee")

    from bytecheckpoint.cli import ls as ls_command

    monkeypatch.setattr(ls_command, "cmd_ls", broken)
    monkeypatch.delenv("BCP_DEBUG", raising=False)
    assert cli.main(["ls", root]) == cli.EXIT_INTERNAL
    err = capsys.readouterr().err
    assert "Traceback" not in err and "something the code did not foresee" in err and "--debug" in err
    assert cli.main(["--debug", "ls", root]) == cli.EXIT_INTERNAL
    assert "Traceback" in capsys.readouterr().err


def test_gc_json_and_ls_survive_every_hostile_entry_at_once(tmp_path, root):
    """A root holding a file named like a checkpoint, a symlinked run, a FIFO latest and a
    checkpoint whose metadata is garbage: ls and gc answer, and delete nothing they cannot
    classify."""
    hot = tmp_path / "hot"
    shutil.copytree(root, hot / "run")
    (hot / "step_9").write_text("not a directory")
    os.symlink(str(hot / "run"), str(hot / "alias"))
    os.makedirs(hot / "junk" / "step_3")
    (hot / "junk" / "step_3" / METADATA_FILE).write_bytes(b"\x00garbage")
    os.mkfifo(hot / "junk" / "latest")
    assert bcp_cli("ls", str(hot)).returncode == 0
    proc = bcp_cli("gc", str(hot), "--keep-last", "1", "--yes", "--json")
    assert proc.returncode == 0, proc.stderr
    deleted = [c["path"] for c in json.loads(proc.stdout)["checkpoints"] if c["deleted"]]
    assert deleted == [str(hot / "run" / "step_1")]
    assert (hot / "junk" / "step_3").is_dir() and (hot / "alias").is_symlink()


def test_a_tier_url_with_a_password_is_masked(capsys, tmp_path):
    code = cli.main(["tier", "--once", "--hot", "s3://bob:hunter2@bucket/ckpt", "--cold", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "hunter2" not in err and "s3://bob:***@bucket" in err
