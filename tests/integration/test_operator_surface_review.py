"""The operator's surface under hostile input: ``bcp gc`` over a directory holding both tiers,
an empty path from an unset shell variable, malformed tiering and storage config files, and the
ingester's and dashboard's option values. Each answer is a named error and a documented exit
code, never a deleted committed checkpoint, a hang, a traceback or a silently changed policy."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.cli import app as cli
from bytecheckpoint.commit.leases import pin
from bytecheckpoint.errors import StorageError
from bytecheckpoint.storage import config as storage_config
from storage_tiering import load_config, run_once
from storage_tiering.__main__ import main as tier_main
from storage_tiering.config import ConfigError
from telemetry import config as telemetry_config
from telemetry.ingest.__main__ import parse_args as ingest_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DAY = 86400.0


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(32, dtype=torch.float32) * step}


def _loads_as(path: str, step: int) -> None:
    target = {"model": {"w": torch.zeros(32)}}
    bcp.load(path, target)
    assert torch.equal(target["model"]["w"], _state(step)["w"])


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def tiers(tmp_path, monkeypatch) -> str:
    """tmp/hot/run with steps 1-3, steps 1 and 2 cooled into tmp/cold, step 1 pinned: one
    directory holding both tiers, as /data/hot and /data/cold often are."""
    monkeypatch.delenv("BCP_TIERING_COLD", raising=False)
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    os.makedirs(cold)
    for s in (1, 2, 3):
        bcp.save(f"{hot}/run/step_{s}", {"model": _state(s)}, step=s)
    report = run_once(load_config(hot=hot, cold=cold, cool_after="1d", keep_newest=1),
                      now=time.time() + 2 * DAY)
    assert len(report.cooled) == 2 and not report.failed, report.failed
    pin(f"{hot}/run/step_1", "a paper result")
    return str(tmp_path)


def test_gc_over_both_tiers_never_deletes_the_cold_copies_hot_checkpoints_link_to(capsys, tiers):
    code, out, _ = _cli(capsys, "gc", tiers, "--keep-last", "1", "--yes", "-q")
    assert os.path.isdir(f"{tiers}/cold/run/step_1")
    _loads_as(f"{tiers}/hot/run/step_1", 1)  # pinned: its bytes are the cold copy
    _loads_as(f"{tiers}/hot/run/step_2", 2)
    assert "a copy in the cold tier" in out
    assert code == cli.EXIT_FAILED  # the cooled, unpinned step_2 is refused without --cold


@pytest.mark.parametrize("argv", [["gc", "{t}/cold", "--keep-last", "1", "--yes"],
                                  ["gc", "{t}/cold/run", "--keep-last", "1", "--yes"],
                                  ["gc", "{t}", "--cold", "{t}/cold", "--keep-last", "1", "--yes"],
                                  ["gc", "{t}/hot", "--cold", "{t}/hot", "--keep-last", "1", "--yes"],
                                  ["gc", "{t}/hot/run", "--cold", "{t}/hot", "--keep-last", "1", "--yes"]])
def test_gc_refuses_a_cold_tier_as_root_and_a_cold_root_overlapping_the_root(capsys, tiers, argv):
    code, _, err = _cli(capsys, *[a.format(t=tiers) for a in argv])
    assert code == cli.EXIT_USAGE, err
    assert "cold tier" in err or "must not contain each other" in err
    for s in (1, 2):
        assert os.path.isdir(f"{tiers}/cold/run/step_{s}")
        _loads_as(f"{tiers}/hot/run/step_{s}", s)


@pytest.mark.parametrize("command", [["gc", "", "--keep-last", "1", "--yes"], ["ls", ""], ["verify", ""],
                                     ["inspect", ""], ["export", "", "out"],
                                     ["convert", "--from", "dcp", "x", ""]])
def test_an_empty_path_is_a_usage_error_not_the_current_directory(capsys, tmp_path, monkeypatch, command):
    for s in (1, 2):
        bcp.save(f"{tmp_path}/run/step_{s}", {"model": _state(s)}, step=s)
    monkeypatch.chdir(tmp_path / "run")  # `bcp gc "$UNSET" --yes` run from a checkpoint directory
    code, _, err = _cli(capsys, *command)
    assert code == cli.EXIT_USAGE and "empty path" in err, err
    assert sorted(os.listdir(tmp_path / "run")) == ["latest", "step_1", "step_2"]


@pytest.mark.parametrize("body,match", [
    ("tiering = 5\n", "must be a table"),
    ('[tiering]\nhot = "h"\ncold = "c"\nkeep_newest = true\n', "keep_newest.*not an integer"),
    ('[tiering]\nhot = "h"\ncold = "c"\nkeep_every = 2.7\n', "keep_every.*not an integer"),
    ('[tiering]\nhot = "h"\ncold = "c"\ncool_after = nan\n', "cool_after.*not a finite"),
    ('[tiering]\nhot = ["a", "b"]\ncold = "c"\n', "hot.*not a string"),
])
def test_a_malformed_tiering_file_is_a_named_error_not_a_coerced_policy(tmp_path, body, match):
    path = tmp_path / "tiering.toml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=match):
        load_config(str(path), env={})


@pytest.mark.parametrize("hot", [os.sep, "~"])
def test_tiering_refuses_the_filesystem_root_and_home_as_hot_tier(tmp_path, hot):
    with pytest.raises(ConfigError, match="file system root or the home directory"):
        load_config(env={}, hot=os.path.expanduser(hot), cold=str(tmp_path / "cold"))


def test_tiering_pin_of_a_missing_directory_is_one_line_exit_1(capsys, tmp_path):
    assert tier_main(["--pin", str(tmp_path / "no" / "such")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and "No such file" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["--idle-s", "nan"], ["--idle-s", "-1"], ["--batch-events", "0"],
                                  ["--linger-s", "inf"], ["--alerts-every", "0"], ["--retry-for", "nan"]])
def test_ingest_refuses_option_values_that_hang_or_ingest_nothing(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        ingest_args(["--spool", "x", "--once", *argv])
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--port", "99999"], ["--port", "-1"], ["--host", "256.1.1.1"]])
def test_dashboard_bad_address_is_a_usage_error_not_a_streamlit_traceback(tmp_path, argv):
    proc = subprocess.run([sys.executable, "-m", "dashboard", "--dsn", f"chdb://{tmp_path}/store", *argv],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert argv[0] in proc.stderr


@pytest.mark.parametrize("body,match", [
    ("[transfer]\nthreadz = 2\n", r"unknown setting\(s\) \['threadz'\] in \[transfer\]"),
    ("[transferr]\nthreads = 2\n", r"unknown section \[transferr\]"),
    ("transfer = 3\n", r"\[transfer\] must be a table"),
])
def test_a_typo_in_the_storage_config_file_is_refused_not_ignored(tmp_path, monkeypatch, body, match):
    path = tmp_path / "storage.toml"
    path.write_text(body)
    monkeypatch.setenv(storage_config.CONFIG_ENV, str(path))
    with pytest.raises(StorageError, match=match):
        storage_config.settings()


def test_a_nan_storage_setting_is_refused(monkeypatch):
    monkeypatch.setenv("BCP_STORAGE_RETRY_DEADLINE_S", "nan")
    with pytest.raises(StorageError, match="BCP_STORAGE_RETRY_DEADLINE_S"):
        storage_config.settings()


@pytest.mark.parametrize("name,value", [("BCP_TELEMETRY_QUEUE", "12k-review"),
                                        ("BCP_TELEMETRY_SINK", "kafak-review"),
                                        ("BCP_TELEMETRY_FSYNC", "sometimes-review")])
def test_a_bad_telemetry_variable_keeps_training_up_but_is_named(monkeypatch, caplog, name, value):
    monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING, logger="telemetry.config"):
        telemetry_config._settings_from_env()
    assert any(name in r.getMessage() and value in r.getMessage() for r in caplog.records), caplog.text
