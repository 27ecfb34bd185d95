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


def test_a_rank_that_writes_more_holds_more_slots(world, tmp_path):
    """Slots go in proportion to bytes: rank 0 writes 4 times what each other rank writes (4/7
    of the host's bytes), so of 5 slots it may hold 2 at once and the others 1 each. With an
    equal share rank 0's files went out one after the other once the others were done. The
    second save, served by the plan cache, keeps the shares."""
    slots = tmp_path / "slots"
    slots.mkdir()
    out = world(4).run(sw.save_taking_turns, str(tmp_path / "ckpt"), str(slots), 5, True, 4, True)
    assert all(r["exact"] and r["cached"] for r in out)
    for rank, r in enumerate(out):
        for save in ("held", "held_again"):
            held = sorted(r[save])
            assert len(held) == 2, f"rank {rank} held {held} ({save})"
            (_, end), (start, _) = held
            if rank == 0:
                assert start < end, f"rank 0 wrote its two files one at a time: {held} ({save})"
            else:
                assert start >= end, f"rank {rank} held two slots at once: {held} ({save})"

