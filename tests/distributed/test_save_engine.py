"""The save engine: plan cache (hits, every invalidation, ranks that disagree), async saves
(snapshot semantics, errors, one save at a time, bounded staging memory, interpreter exit)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.commit.integrity import read_metadata, resolve
from tests.support import save_workloads as sw
from tests.support.helpers import assert_changed_structure_loads, same_bits

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _same_tensors(ref: dict, got: dict) -> None:
    assert sorted(ref) == sorted(got)
    for key, value in ref.items():
        assert same_bits(value, got[key]), key


def test_plan_cache_hits_unchanged_structures_and_misses_changed_ones(world, tmp_path):
    root = str(tmp_path)
    results = world(4).run(sw.plan_cache_hits_and_invalidations, root)
    #                 s1     s2    s3    s4 param s5   s6 shape s7 fw  s8 group s9  s10
    expected = [False, True, True, False, True, False, False, False, True, True]
    for r in results:
        assert r["cached"] == expected
        # A planned save: gather plans, scatter assignments, gather results, broadcast the
        # commit. A cached one: one gather of results and one scatter of the commit.
        assert r["calls"] == [4 if not hit else 2 for hit in expected]
    plan_s = [max(r["plan_s"][i] for r in results) for i in range(len(expected))]
    assert plan_s[1] < plan_s[0] and plan_s[2] < plan_s[0], plan_s
    # Saves served by the cache are complete checkpoints, bit for bit.
    for name, ref in (("s2", "ref2"), ("s3", "ref3")):
        loaded = world(2).run(sw.load_step, root, name)
        for got in loaded:
            _same_tensors(results[0][ref], got["state"])
            assert got["extra"]["step"] == int(name[1:])
    meta = read_metadata(*resolve(f"{root}/s5"))
    assert meta.tensor("model/extra_bias").shape == (6,)
    meta = read_metadata(*resolve(f"{root}/s6"))
    assert meta.tensor("model/extra_bias").shape == (8,)
    for first in (0, 2):
        lin = torch.nn.Linear(4, 4)
        bcp.load(f"{root}/g{first}/s9", {"model": lin})
        assert torch.equal(lin.weight, torch.full((4, 4), float(first)))
    # Each cached save went into its own staging directory, and none is left behind.
    assert not [n for n in os.listdir(root) if ".staging-" in n]


def test_structure_change_on_one_rank_replans_a_sync_save(world, tmp_path):
    results = world(4).run(sw.structure_changes_on_one_rank, str(tmp_path), False)
    for r in results:
        assert r["second"] == ("saved", False)  # planned again, transparently
    meta = read_metadata(*resolve(str(tmp_path / "second")))
    assert meta.tensor("model/b").shape == (3,)
    assert_changed_structure_loads(str(tmp_path))


def test_structure_change_on_one_rank_fails_an_async_save_clearly(world, tmp_path):
    results = world(4).run(sw.structure_changes_on_one_rank, str(tmp_path), True)
    for r in results:
        assert r["second"][0] == "error" and "changed on some ranks" in r["second"][2], r
        assert r["third_cached"] is False  # the next save plans and commits
    assert not (tmp_path / "second").exists()
    assert (tmp_path / "third" / "metadata.msgpack").exists()


def test_async_save_keeps_the_values_of_the_moment_of_the_call(world, tmp_path):
    root = str(tmp_path)
    results = world(4).run(sw.async_snapshot, root, 3)
    for r in results:
        assert r["done"] == [True, True, True]
        assert r["cached"] == [False, True, True]
        # A new save waits for the one in flight.
        assert [i["earlier_done"] for i in r["info"]] == [[], [True], [True, True]]
        # One arena, allocated at most once for three saves, reused by the later ones.
        assert r["arena_allocations"] <= 1
        assert r["arena_bytes"] <= max(r["bytes_written"]) + 64 * 1024
    for step in range(3):
        for got in world(2).run(sw.load_step, root, f"step_{step}"):
            _same_tensors(results[0]["refs"][step], got["state"])


def test_async_save_failure_reaches_every_rank_and_commits_nothing(world, tmp_path):
    results = world(4).run(sw.async_failure, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["done"] and r["error"] is not None
        assert "No space left on device" in r["error"][1] or "rank 1" in r["error"][1], r
        assert r["wait_raises"] == ("StorageIOError" if rank == 1 else "RankFailedError"), r
        assert r["after"] > 0
    assert not (tmp_path / "bad").exists()
    assert resolve(str(tmp_path))[1].endswith("after")


def _run_script(tmp_path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=REPO))


def test_pending_async_save_is_finished_at_interpreter_exit(tmp_path):
    proc = _run_script(tmp_path, f"""
        import torch, bytecheckpoint as bcp
        model = torch.nn.Linear(64, 64)
        torch.nn.init.constant_(model.weight, 3.0)
        bcp.save({str(tmp_path / "ckpt")!r}, {{"model": model}}, async_save=True)
        # exits without waiting
    """)
    assert proc.returncode == 0, proc.stderr
    model = torch.nn.Linear(64, 64)
    bcp.load(str(tmp_path / "ckpt"), {"model": model})
    assert torch.equal(model.weight, torch.full((64, 64), 3.0))


def test_failed_async_save_nobody_waited_for_is_reported_at_exit(tmp_path):
    # The second save reuses the first one's plan, so it only finds out in the background
    # that the path is taken.
    proc = _run_script(tmp_path, f"""
        import torch, bytecheckpoint as bcp
        state = {{"model": torch.nn.Linear(4, 4)}}
        bcp.save({str(tmp_path / "ckpt")!r}, state)
        bcp.save({str(tmp_path / "ckpt")!r}, state, async_save=True)
    """)
    assert proc.returncode == 0
    assert "async save to" in proc.stderr and "overwrite=True" in proc.stderr, proc.stderr


def test_single_process_async_save_and_handle_api(tmp_path):
    model = torch.nn.Linear(32, 32)
    ref = model.weight.detach().clone()
    handle = bcp.save(str(tmp_path / "a"), {"model": model}, async_save=True)
    with torch.no_grad():
        model.weight.zero_()
    result = handle.wait(timeout=60)
    assert handle.done() and handle.exception() is None and "committed" in repr(handle)
    assert result.bytes_written == result.total_bytes > 0
    assert handle.blocking_s <= result.duration_s
    bcp.load(str(tmp_path / "a"), {"model": model})
    assert same_bits(model.weight.detach(), ref)
    with pytest.raises(bcp.CheckpointExistsError):
        bcp.save(str(tmp_path / "a"), {"model": model}, async_save=True).wait()
