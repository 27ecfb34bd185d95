"""Review of data loader resumes through real checkpoints (2026-11-27).

- A ``TokenLoader`` whose readers had run dry when it was saved ignored samples appended to
  its sources before the resume (its rotation still marked every reader finished), although
  a grown source is accepted: they were never read, without an error.
- A loader saved after ``close()`` saved the position it started from (with the current
  batch count), so a resume read every batch again: now ``StagingError``, nothing committed.
"""

from __future__ import annotations

import collections
import os

import pytest

from bytecheckpoint.data import TokenSource, write_source
from tests.support import data_review_workloads as rw


def assert_every_token_once(sources: list[str], pieces: list[tuple[int, int, int]]) -> None:
    runs: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    for sid, start, n in pieces:
        runs[sid].append((start, n))
    expected = {(s << 40) | i: src.length(i) for s, path in enumerate(sources)
                for src in [TokenSource(path)] for i in range(len(src)) if src.length(i)}
    assert sorted(set(expected) - set(runs)) == [], "samples never read"
    assert sorted(set(runs) - set(expected)) == [], "samples that do not exist"
    for sid, parts in runs.items():
        covered = [k for start, n in sorted(parts) for k in range(start, start + n)]
        assert covered == list(range(expected[sid])), f"sample {sid}: tokens read {covered}"


@pytest.fixture(scope="module")
def grown(tmp_path_factory) -> tuple[list[str], list[str]]:
    root = str(tmp_path_factory.mktemp("grown"))
    samples = [[1 + i % 200] * (1 + i % 7) for i in range(40)]
    old = [write_source(os.path.join(root, "old"), samples)]
    new = [write_source(os.path.join(root, "new"), samples + [[300 + i] * 4 for i in range(12)])]
    return old, new


def test_a_loader_that_ran_dry_reads_what_was_appended_before_the_resume(world, tmp_path, grown):
    old, new = grown
    path = str(tmp_path / "dry")
    before = [p for r in world(2).run(rw.read_and_save, path, old, None) for p in r]
    assert_every_token_once(old, before)  # read to the end, then saved
    same = [p for r in world(2).run(rw.resume_and_read, path, new) for p in r]
    assert_every_token_once(new, before + same)  # was: the 12 appended samples never read
    resharded = [p for r in world(3).run(rw.resume_and_read, path, new) for p in r]
    assert_every_token_once(new, before + resharded)


def test_a_loader_saved_after_close_is_refused(world, tmp_path, grown):
    old, _ = grown
    path = str(tmp_path / "closed")
    out = world(2).run(rw.save_after_close, path, old)
    assert all(r.startswith("StagingError") and "closed after 2 batches" in r for r in out), out
    assert not os.path.exists(path)  # was: committed with the loader's starting position


def test_a_distributed_sampler_position_is_not_carried_to_another_world_size(world, tmp_path):
    """torchdata's loader over a DistributedSampler saves the same state on every rank (its
    batch count), so the identical-copies check let it load into 3 ranks: each skipped 3
    batches of a part the 2 saving ranks never read, and 6 samples came again."""
    pytest.importorskip("torchdata")
    path = str(tmp_path / "sampler")
    seen = world(2).run(rw.save_sampled_loader, path)
    out = world(3).run(rw.load_sampled_loader, path)
    assert all(r.startswith("StateMismatchError") and "'loader'" in r and "DistributedSampler" in r
               for r in out), out
    rest = world(2).run(rw.load_sampled_loader, path)  # the same world: each its own part
    read = [int(x) for part in seen for x in part] + [int(x) for r in rest for x in r.split()]
    assert sorted(read) == list(range(48))
