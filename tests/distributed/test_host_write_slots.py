"""A synchronous save on 4 ranks of one host with one write slot: the ranks' large files go to
the disk one at a time, and every byte loads back."""

from __future__ import annotations

from tests.support import storage_workloads as sw


def test_four_ranks_with_one_slot_write_one_file_at_a_time(world, tmp_path):
    slots = tmp_path / "slots"
    slots.mkdir()
    out = world(4).run(sw.save_taking_turns, str(tmp_path / "ckpt"), str(slots))
    assert all(r["exact"] for r in out)
    held = sorted(iv for r in out for iv in r["held"])
    assert len(held) == 4  # one large file per rank, each took the slot
    for (_, end), (start, _) in zip(held, held[1:]):
        assert start >= end, f"two ranks wrote at once: {held}"
