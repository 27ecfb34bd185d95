"""A synchronous save on 4 ranks of one host with one write slot: the ranks' large files go to
the disk one at a time, and every byte loads back. With 4 slots, each rank holds one at a time."""

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


def test_four_ranks_with_four_slots_each_hold_one_at_a_time(world, tmp_path):
    """Each rank writes two large files (model, optim); with 4 slots for 4 ranks, none holds two
    at once: first come, first served, a rank could take two while another's files both
    waited, and the save lasted until that rank's late writes were done."""
    slots = tmp_path / "slots"
    slots.mkdir()
    out = world(4).run(sw.save_taking_turns, str(tmp_path / "ckpt"), str(slots), 4, True)
    assert all(r["exact"] for r in out)
    for rank, r in enumerate(out):
        held = sorted(r["held"])
        assert len(held) == 2, f"rank {rank} held {held}"  # both of its large files took a slot
        (_, end), (start, _) = held
        assert start >= end, f"rank {rank} held two slots at once: {held}"

