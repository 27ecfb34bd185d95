"""Races between real processes: two savers, save vs gc, save vs tiering, load vs overwrite,
gc vs a ``cp -a`` copy of a cooled checkpoint.

Each test asserts the two promises of issue 17 at the end of the race: nothing that was
committed (and not asked to be replaced or collected) is lost, every checkpoint left loads
bit for bit, and every failure on the way was a named CheckpointError, never a raw one.
The racing side runs in ``tests/fuzz/race_worker.py`` processes; each test takes seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import bytecheckpoint as bcp
from bytecheckpoint.cli import app as cli
from tests.fuzz.cli import EXIT_CODES
from tests.fuzz.race_worker import state, value_of

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.fuzz.race_worker", *args], cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _results(proc: subprocess.Popen, timeout: float = 180) -> list[dict]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _assert_named(results: list[dict]) -> None:
    raw = [r for r in results if not r["ok"] and not r.get("named", True)]
    assert not raw, f"raw errors: {raw[:3]}"


def _loads_exactly(path: str, value: int) -> None:
    target = state(-1)
    bcp.load(path, target)
    assert value_of(target) == value, f"{path} does not hold save {value}"


def _committed(root: str) -> dict[str, int]:
    """name -> step of every committed checkpoint under ``root``."""
    return {n: int(n.split("_")[1]) for n in os.listdir(root)
            if n.startswith("step_") and os.path.exists(os.path.join(root, n, "metadata.msgpack"))}


def test_two_savers_to_one_path_one_wins_and_the_other_is_refused_by_name(tmp_path):
    for attempt in range(2):
        path = str(tmp_path / f"c{attempt}" / "step_{step}")
        a, b = _start("save", path, "1", "1"), _start("save", path, "1", "1")
        ra, rb = _results(a), _results(b)
        _assert_named(ra + rb)
        assert [r["ok"] for r in ra + rb].count(True) >= 1, (ra, rb)
        _loads_exactly(path.format(step=1), 1)
        leftovers = [n for n in os.listdir(tmp_path / f"c{attempt}") if ".staging-" in n]
        assert not leftovers, leftovers


def test_saves_racing_gc_lose_no_checkpoint_gc_should_keep(tmp_path):
    root = str(tmp_path / "run")
    saver = _start("save", root + "/step_{step}", "1", "8")
    gc = _start("gc", root, "6")
    saves, runs = _results(saver), _results(gc)
    _assert_named(saves)
    assert runs and all(r["code"] in EXIT_CODES for r in runs), runs[:3]
    done = [r["step"] for r in saves if r["ok"]]
    assert done, saves
    # gc keeps the newest two; whatever it kept loads exactly, and the newest save survived.
    left = _committed(root)
    assert max(done) in left.values()
    for name, step in left.items():
        _loads_exactly(os.path.join(root, name), step)
    _loads_exactly(root, max(done))  # latest names the newest


def test_saves_racing_cooling_passes_leave_every_checkpoint_loadable(tmp_path):
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    os.makedirs(cold)
    os.makedirs(hot)
    saver = _start("save", hot + "/run/step_{step}", "1", "6")
    tier = _start("tier", hot, cold, "6")
    saves, passes = _results(saver), _results(tier)
    _assert_named(saves + passes)
    assert all(r["ok"] for r in saves), saves
    left = _committed(os.path.join(hot, "run"))
    assert sorted(left.values()) == list(range(1, 7)), left  # cooling moves, never loses
    for name, step in left.items():
        _loads_exactly(os.path.join(hot, "run", name), step)


@pytest.mark.parametrize("verify", [True, False])
def test_loads_racing_overwrites_return_one_whole_save_or_a_named_error(tmp_path, verify):
    path = str(tmp_path / "c")
    bcp.save(path, state(0), step=0)
    writer = _start("save", path, "1", "12", "overwrite")
    reader = _start("load", path, "5")
    writes, reads = _results(writer), _results(reader)
    _assert_named(writes + reads)
    assert [r for r in reads if r["ok"]], reads
    mixed = [r for r in reads if r["ok"] and r["value"] is None]
    assert not mixed, f"{len(mixed)} loads returned parts of two saves"
    last = max(r["step"] for r in writes if r["ok"])
    _loads_exactly(path, last)


def test_gc_of_a_cooled_checkpoint_keeps_what_a_cp_a_copy_uses(tmp_path):
    from storage_tiering import load_config, run_once

    hot, cold = tmp_path / "hot", tmp_path / "cold"
    cold.mkdir()
    for step in (1, 2, 3):
        bcp.save(f"{hot}/run1/step_{step}", state(step), step=step)
    report = run_once(load_config(hot=str(hot), cold=str(cold), cool_after="1d", keep_newest=1),
                      now=time.time() + 2 * 86400)
    assert report.cooled and not report.failed, report.failed
    cooled = hot / "run1" / "step_1"
    assert any(os.path.islink(cooled / n) for n in os.listdir(cooled)), "step_1 was not cooled"
    os.makedirs(hot / "copy")
    subprocess.run(["cp", "-a", f"{hot}/run1/step_1", f"{hot}/copy/step_1"], check=True)
    # gc and a reader of the copy at the same time.
    reader = _start("load", f"{hot}/copy/step_1", "3")
    code = cli.main(["gc", str(hot / "run1"), "--keep-last", "1", "--cold", str(cold), "--yes", "-q"])
    reads = _results(reader)
    assert code == 0
    _assert_named(reads)
    assert all(r["ok"] and r["value"] == 1 for r in reads), reads[:3]
    assert not os.path.exists(hot / "run1" / "step_1")  # gc did collect it
    _loads_exactly(f"{hot}/copy/step_1", 1)  # the copy still has every byte
    _loads_exactly(f"{hot}/run1/step_3", 3)
