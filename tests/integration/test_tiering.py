"""Storage tiering (issue 9): the policy, the mover and its journal, crash safety.

Checkpoints are real: saved by FSDP2 on 2 gloo ranks or by one process, loaded back bit for
bit through their original paths after cooling. The clock is the files' mtimes (set with
``os.utime``) against ``now``; nothing sleeps.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import bytecheckpoint as bcp
import telemetry
from bytecheckpoint.commit.leases import is_being_read, lease_prefix, pin, read_lease
from bytecheckpoint.manage.catalog import hot_bytes, scan
from bytecheckpoint.manage.journal import JOURNAL_FILE, Journal
from bytecheckpoint.storage import faults
from bytecheckpoint.storage.local import LocalStorage
from storage_tiering import ConfigError, load_config, run_once
from storage_tiering.__main__ import main as cli
from storage_tiering.mover import recover
from storage_tiering.service import LOCK_FILE
from telemetry.alerts import FailedOps, evaluate
from telemetry.alerts.engine import RuleSet
from telemetry.sinks import read_spool
from telemetry.store import connect, ensure_schema, insert_events
from tests.support import workloads as w
from tests.support.helpers import assert_same_state

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DAY = 86400.0
NOW = time.time()


def _age(path: str, days: float) -> None:
    """Make every file of a checkpoint look last modified ``days`` ago."""
    t = NOW - days * DAY
    for n in os.listdir(path):
        os.utime(os.path.join(path, n), (t, t))


def _save_single(root: str, step: int) -> dict:
    model, optim = w.make_plain(seed=step)
    w.train_step(model, optim, step, 0)
    bcp.save(f"{root}/step_{step}", {"model": model, "optimizer": optim}, step=step)
    return w.full_state(model, optim)


def _load_single(path: str) -> dict:
    model, optim = w.make_plain(seed=1234, lr=1e-4)
    bcp.load(path, {"model": model, "optimizer": optim})
    return w.full_state(model, optim)


def _tiers(tmp_path) -> tuple[str, str]:
    hot, cold = str(tmp_path / "ssd"), str(tmp_path / "hdd")
    os.makedirs(hot), os.makedirs(cold)
    return hot, cold


def _snapshot(root: str) -> dict[str, tuple]:
    """Every entry under ``root``: kind, size, mtime, link target (what a pass could change)."""
    out = {}
    for d, dirs, names in os.walk(root):
        for n in dirs + names:
            p = os.path.join(d, n)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_size, st.st_mtime_ns,
                                             os.readlink(p) if os.path.islink(p) else None)
    return out


def _assert_no_orphans(hot: str, cold: str) -> None:
    """Every cold file is the target of a hot link; no scratch or temporary file is left."""
    targets = set()
    for d, _, names in os.walk(hot):
        for n in names:
            p = os.path.join(d, n)
            assert ".tiering" not in p, f"leftover {p}"
            if os.path.islink(p):
                targets.add(os.readlink(p))
                assert os.path.exists(os.readlink(p)), f"{p} points nowhere"
    for d, _, names in os.walk(cold):
        for n in names:
            p = os.path.join(d, n)
            if n not in (JOURNAL_FILE, LOCK_FILE):
                assert p in targets, f"orphan cold file {p}"


@pytest.fixture(scope="module")
def fsdp2_run(world, tmp_path_factory):
    """6 committed FSDP2 checkpoints of one run, saved by 2 ranks, with their full states."""
    root = str(tmp_path_factory.mktemp("fsdp2-run") / "ssd" / "job" / "run1")
    refs = {}
    pool = world(2)
    for steps in range(1, 7):
        refs[steps] = pool.run(w.fsdp2_train_save, root, steps)[0]["ref"]
    return root, refs


def test_six_checkpoints_four_old_keep_two_cools_exactly_the_four_oldest(world, fsdp2_run, tmp_path):
    root, refs = fsdp2_run
    hot, cold = os.path.dirname(os.path.dirname(root)), str(tmp_path / "hdd")
    os.makedirs(cold)
    for steps in range(1, 7):
        _age(f"{root}/step_{steps}", 30 if steps <= 4 else 0.01)
    sizes = {s: sum(os.path.getsize(os.path.join(root, f"step_{s}", n))
                    for n in os.listdir(f"{root}/step_{s}")) for s in range(1, 7)}
    before = hot_bytes(hot)

    report = run_once(load_config(hot=hot, cold=cold, cool_after="7d", keep_newest=2), now=NOW)

    assert sorted(os.path.basename(r.checkpoint) for r in report.cooled) == [f"step_{s}" for s in range(1, 5)]
    assert not report.failed
    states = {c.name: c.state for c in scan(hot, cold)}
    assert states == {"step_1": "cold", "step_2": "cold", "step_3": "cold", "step_4": "cold",
                      "step_5": "hot", "step_6": "hot"}
    # The hot tier gave back exactly the cooled checkpoints' bytes (less the links' own few).
    assert before - hot_bytes(hot) == sum(sizes[s] for s in range(1, 5))
    for s in range(1, 5):
        assert bcp.verify(f"{root}/step_{s}") == []
        assert_same_state(refs[s], _load_single(f"{root}/step_{s}"))  # 2 ranks -> 1 process
    got = world(2).run(w.fsdp2_load, f"{root}/step_3")  # FSDP2 2 ranks, through the links
    assert_same_state(refs[3], got[0]["state"])
    _assert_no_orphans(hot, cold)


@pytest.fixture
def small_run(tmp_path):
    hot, cold = _tiers(tmp_path)
    run = f"{hot}/run"
    refs = {s: _save_single(run, s) for s in (1, 2)}
    return hot, cold, run, refs


@pytest.mark.parametrize("step", ["copy", "copied", "verified", "remap", "remapped", "free"])
def test_mover_killed_at_each_step_leaves_every_checkpoint_loadable(small_run, step):
    hot, cold, run, refs = small_run
    _age(f"{run}/step_1", 30), _age(f"{run}/step_2", 30)
    proc = subprocess.run([sys.executable, "-m", "tests.support.tiering_worker", "move", hot, cold, step],
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert Journal(cold).unfinished(), "the kill left no unfinished move"
    # Right after the crash, before any recovery: still loadable, bit for bit.
    for s in (1, 2):
        assert bcp.verify(f"{run}/step_{s}") == []
        assert_same_state(refs[s], _load_single(f"{run}/step_{s}"))

    # Recovery alone: unremapped copies rolled back, remapped files kept, nothing orphaned.
    assert recover(hot, cold, Journal(cold)) == 1
    assert not Journal(cold).unfinished()
    _assert_no_orphans(hot, cold)
    report = run_once(load_config(hot=hot, cold=cold, cool_after=0, keep_newest=0), now=NOW)
    assert report.recovered == 0 and not report.failed
    # step_2 is named by latest and stays hot; step_1 ends fully cold.
    assert {c.name: c.state for c in scan(hot, cold)} == {"step_1": "cold", "step_2": "hot"}
    for s in (1, 2):
        assert bcp.verify(f"{run}/step_{s}") == []
        assert_same_state(refs[s], _load_single(f"{run}/step_{s}"))
    _assert_no_orphans(hot, cold)


def test_load_in_another_process_during_the_move_is_bit_exact(small_run, tmp_path):
    hot, cold, run, refs = small_run
    _age(f"{run}/step_1", 30)
    out = str(tmp_path / "loaded.pt")
    loader: list[subprocess.Popen] = []

    def start_loader_mid_move(name: str) -> None:
        if name != "verified":
            return
        # A reader whose lease has lapsed (a 1 ms TTL: an older client, or another tool) starts
        # reading, slowed per read, and the remap and free happen while it is in the middle.
        env = dict(os.environ, PYTHONPATH=REPO, BCP_LEASE_TTL_S="0.001",
                   BCP_STORAGE_FAULTS="latency_s=0.05;ops=read_into")
        loader.append(subprocess.Popen([sys.executable, "-m", "tests.support.tiering_worker", "load",
                                        f"{run}/step_1", out], cwd=REPO, env=env))
        deadline = time.time() + 60
        while not any(".lease-" in n for n in os.listdir(run)):  # its load has begun
            assert time.time() < deadline and loader[0].poll() is None
            time.sleep(0.01)
        time.sleep(0.3)

    report = run_once(load_config(hot=hot, cold=cold, cool_after="1d", keep_newest=1), now=NOW,
                      on_step=start_loader_mid_move)
    assert [os.path.basename(r.checkpoint) for r in report.cooled] == ["step_1"]
    assert loader[0].poll() is None, "the load ended before the remap; nothing was tested"
    assert loader[0].wait(120) == 0
    assert_same_state(refs[1], torch.load(out, weights_only=False))
    assert all(os.path.islink(f"{run}/step_1/{n}") for n in os.listdir(f"{run}/step_1"))


def test_a_lease_taken_during_the_copy_keeps_the_checkpoint_hot(small_run):
    hot, cold, run, _ = small_run
    _age(f"{run}/step_1", 30)
    held = []

    def reader_arrives(name: str) -> None:
        if name == "copied":
            held.append(read_lease(LocalStorage(fsync=False), f"{run}/step_1"))
            held[0].__enter__()

    report = run_once(load_config(hot=hot, cold=cold, cool_after="1d", keep_newest=0), now=NOW,
                      on_step=reader_arrives)
    held[0].__exit__(None, None, None)
    assert not report.cooled and "being read" in report.failed[f"{run}/step_1"]
    assert {c.name: c.state for c in scan(hot, cold)}["step_1"] == "hot"
    _assert_no_orphans(hot, cold)


def test_uncommitted_pinned_read_latest_and_newest_are_never_touched(tmp_path):
    hot, cold = _tiers(tmp_path)
    run = f"{hot}/run"
    for s in range(1, 7):
        _save_single(run, s)
    # A save that never committed (its staging directory) and a directory without metadata.
    os.makedirs(f"{run}/.step_7.staging-abc")
    os.makedirs(f"{run}/step_8")
    with open(f"{run}/step_8/model-00000.safetensors", "wb") as f:
        f.write(b"x" * 1000)
    for s in range(1, 9):
        if os.path.isdir(f"{run}/step_{s}"):
            _age(f"{run}/step_{s}", 365)
    pin(f"{run}/step_2", "a paper's result")
    # latest names step_4 (a rollback), so step_6 and step_5 are newest but step_4 is latest.
    with open(f"{run}/latest", "w") as f:
        json.dump({"checkpoint": "step_4", "step": 4}, f)
    before = _snapshot(hot)
    with read_lease(LocalStorage(fsync=False), f"{run}/step_3"):
        report = run_once(load_config(hot=hot, cold=cold, cool_after="1d", keep_newest=2), now=NOW)
    assert [os.path.basename(r.checkpoint) for r in report.cooled] == ["step_1"]
    reasons = {d.checkpoint.name: d.reason for d in report.decisions}
    assert reasons == {"step_1": "older than cool_after", "step_2": "pinned", "step_3": "being read (lease)",
                       "step_4": "named by latest", "step_5": "among the newest of its run",
                       "step_6": "among the newest of its run", "step_8": "uncommitted"}
    after = _snapshot(hot)
    # Everything but step_1 and the run directory's own mtime (the mover's scratch) is as it was.
    untouched = [k for k in before if k != "run" and not k.startswith("run/step_1")]
    assert {k: before[k] for k in untouched} == {k: after.get(k) for k in untouched}


def test_second_pass_changes_nothing(small_run):
    hot, cold, run, _ = small_run
    _age(f"{run}/step_1", 30), _age(f"{run}/step_2", 30)
    config = load_config(hot=hot, cold=cold, cool_after="1d", keep_newest=1)
    first = run_once(config, now=NOW)
    assert len(first.cooled) == 1
    hot_before, cold_before = _snapshot(hot), _snapshot(cold)
    journal_before = os.path.getsize(os.path.join(cold, JOURNAL_FILE))
    second = run_once(config, now=NOW)
    assert not second.changed and not second.failed
    assert _snapshot(hot) == hot_before
    assert {k: v for k, v in _snapshot(cold).items() if k != JOURNAL_FILE} == \
        {k: v for k, v in cold_before.items() if k != JOURNAL_FILE}
    assert os.path.getsize(os.path.join(cold, JOURNAL_FILE)) == journal_before


def test_a_corrupt_cold_copy_aborts_the_move_and_keeps_the_hot_copy(small_run, tmp_path, chdb_dsn):
    hot, cold, run, refs = small_run
    _age(f"{run}/step_1", 30)
    spool = tmp_path / "spool"
    telemetry.configure(spool_dir=spool, enabled=True)
    before = _snapshot(f"{run}/step_1")
    faults.install(f"truncate_bytes=100;ops=write;path={cold}/run/step_1/.optim")
    try:
        report = run_once(load_config(hot=hot, cold=cold, cool_after="1d", keep_newest=1), now=NOW)
    finally:
        faults.install(None)
    assert not report.cooled and "move aborted, hot copy kept" in report.failed[f"{run}/step_1"]
    assert _snapshot(f"{run}/step_1") == before
    assert [n for n in os.listdir(cold) if n not in (JOURNAL_FILE, LOCK_FILE)] == ["run"]
    assert not any(files for _, _, files in os.walk(f"{cold}/run"))
    assert_same_state(refs[1], _load_single(f"{run}/step_1"))
    assert telemetry.flush(timeout=5.0)
    moves = [e for e in read_spool(spool) if e["name"] == "tiering.move"]
    assert [m["outcome"] for m in moves] == ["error"] and moves[0]["checkpoint"] == f"{run}/step_1"
    # The failed move raises an alert once its events reach the store.
    store = connect(chdb_dsn)
    try:
        ensure_schema(store)
        insert_events(store, list(read_spool(spool)))
        alerts = [a for a in evaluate(store, RuleSet(FailedOps())) if a.phase == "tiering.move"]
    finally:
        store.close()
    assert len(alerts) == 1 and alerts[0].severity == "error" and "step_1" in alerts[0].checkpoint
    # Without the fault the next pass moves it.
    again = run_once(load_config(hot=hot, cold=cold, cool_after="1d", keep_newest=1), now=NOW)
    assert [os.path.basename(r.checkpoint) for r in again.cooled] == ["step_1"]
    assert_same_state(refs[1], _load_single(f"{run}/step_1"))


def test_retention_deletes_old_checkpoints_but_every_kth_step(tmp_path):
    hot, cold = _tiers(tmp_path)
    run = f"{hot}/run"
    for s in range(1, 7):
        _save_single(run, s)
        _age(f"{run}/step_{s}", 100)
    run_once(load_config(hot=hot, cold=cold, cool_after="1d", keep_newest=2), now=NOW)
    report = run_once(load_config(hot=hot, cold=cold, cool_after="1d", keep_newest=2,
                                  delete_after="30d", keep_every=2), now=NOW)
    assert sorted(os.path.basename(p) for p in report.deleted) == ["step_1", "step_3"]
    assert sorted(n for n in os.listdir(run) if not n.startswith(".")) == ["latest", "step_2", "step_4",
                                                                           "step_5", "step_6"]
    assert not os.path.exists(f"{cold}/run/step_1") and not os.path.exists(f"{cold}/run/step_3")
    _assert_no_orphans(hot, cold)
    # A cooled checkpoint removed by hand leaves cold files: reported, not deleted.
    shutil.rmtree(f"{run}/step_2")
    report = run_once(load_config(hot=hot, cold=cold, cool_after="1d", keep_newest=2), now=NOW)
    assert report.orphans and all(p.startswith(f"{cold}/run/step_2/") for p in report.orphans)
    assert all(os.path.exists(p) for p in report.orphans)


def test_dry_run_lists_and_changes_nothing(small_run, capsys):
    hot, cold, run, _ = small_run
    _age(f"{run}/step_1", 30)
    before = _snapshot(hot)
    assert cli(["--once", "--dry-run", "--hot", hot, "--cold", cold, "--cool-after", "7d",
                "--keep-newest", "0"]) == 0
    out = capsys.readouterr().out
    assert "would cool" in out and "run/step_1" in out and "named by latest" in out
    assert _snapshot(hot) == before and not os.path.exists(os.path.join(cold, JOURNAL_FILE))


def test_settings_from_file_env_and_flags_and_clear_errors(tmp_path):
    path = tmp_path / "tiering.toml"
    path.write_text('[tiering]\nhot = "/ssd/x"\ncold = "/hdd/x"\ncool_after = "12h"\nkeep_newest = 3\n')
    cfg = load_config(str(path), env={"BCP_TIERING_KEEP_NEWEST": "5"}, delete_after="30d")
    assert (cfg.cool_after, cfg.keep_newest, cfg.delete_after) == (12 * 3600, 5, 30 * DAY)
    with pytest.raises(ConfigError, match="cool_after .*not a duration"):
        load_config(str(path), env={"BCP_TIERING_COOL_AFTER": "soon"})
    with pytest.raises(ConfigError, match="no cold tier"):
        load_config(env={"BCP_TIERING_HOT": "/ssd"})
    with pytest.raises(ConfigError, match="must not contain each other"):
        load_config(env={}, hot="/ssd", cold="/ssd/cold")
    with pytest.raises(ConfigError, match="cold tier must be a local directory"):
        load_config(env={}, hot="/ssd", cold="s3://bucket/cold")
    assert cli(["--once", "--hot", str(tmp_path)]) == 2
    assert cli(["--once", "--hot", str(tmp_path), "--cold", str(tmp_path / "unmounted")]) == 2


def test_load_holds_a_lease_and_releases_it_and_stale_leases_do_not_count(small_run):
    hot, cold, run, refs = small_run
    storage = LocalStorage(fsync=False)
    assert_same_state(refs[2], _load_single(run))  # through latest
    assert not any(".lease-" in n for n in os.listdir(run))
    with read_lease(storage, f"{run}/step_1") as lease:
        assert lease is not None and is_being_read(storage, f"{run}/step_1")
        assert not is_being_read(storage, f"{run}/step_2")
    assert not is_being_read(storage, f"{run}/step_1")
    # A lease whose process is gone, and one past its expiry, are ignored.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    with open(f"{lease_prefix(f'{run}/step_1')}dead", "w") as f:
        json.dump({"host": os.uname().nodename, "pid": int(gone), "expires": time.time() + 3600}, f)
    with open(f"{lease_prefix(f'{run}/step_1')}expired", "w") as f:
        json.dump({"host": "elsewhere", "pid": 1, "expires": time.time() - 1}, f)
    assert not is_being_read(storage, f"{run}/step_1")


def test_digest_checks_chunks_that_span_read_blocks(monkeypatch):
    import random

    import xxhash

    from storage_tiering import verify

    monkeypatch.setattr(verify, "BLOCK_BYTES", 1000)
    rng = random.Random(0)
    data = bytearray(rng.randbytes(10_000))
    checks, pos = [], 17
    while pos < 9_000:  # chunks of odd sizes with gaps, some inside a block, some across several
        n = rng.randint(1, min(2500, len(data) - pos))
        checks.append(verify.ChunkCheck(pos, pos + n, xxhash.xxh3_64_intdigest(data[pos:pos + n]), str(pos)))
        pos += n + rng.randint(0, 300)
    got = verify.digest(lambda o, n: bytes(data[o:o + n]), len(data), checks)
    assert got.bad == () and got.xxh3 == xxhash.xxh3_64_intdigest(data) and got.size == len(data)
    victim = checks[len(checks) // 2]
    data[victim.end - 1] ^= 1
    assert verify.digest(lambda o, n: bytes(data[o:o + n]), len(data), checks).bad == (victim.label,)
    assert verify.digest(lambda o, n: bytes(data[o:o + n]), 5_000, checks).bad[-1] == checks[-1].label


def test_a_checkpoint_saved_over_during_its_move_keeps_the_new_save(small_run):
    hot, cold, run, _ = small_run
    _age(f"{run}/step_1", 30)
    new = {}

    def save_over(name: str) -> None:
        if name == "verified":  # copies verified, remap next: the path now holds another save
            model, optim = w.make_plain(seed=77)
            bcp.save(f"{run}/step_1", {"model": model, "optimizer": optim}, step=1, overwrite=True)
            new.update(w.full_state(model, optim))

    config = load_config(hot=hot, cold=cold, cool_after="1d", keep_newest=1)
    report = run_once(config, now=NOW, on_step=save_over)
    assert f"{run}/step_1" in report.failed
    assert not any(os.path.islink(f"{run}/step_1/{n}") for n in os.listdir(f"{run}/step_1"))
    assert_same_state(new, _load_single(f"{run}/step_1"))
    again = run_once(config, now=NOW + 2 * DAY)  # resolves the interrupted move, then cools the new one
    assert again.recovered == 1 and not again.failed
    assert_same_state(new, _load_single(f"{run}/step_1"))
    _assert_no_orphans(hot, cold)
