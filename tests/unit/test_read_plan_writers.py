"""The read plan gives every piece a file's writer needs to the writer, so a rank knows before
the plan is agreed which boxes it will read (``load_pipeline.Prefetch`` starts those early);
the rest of the plan keeps its promises: every needed byte read once, by a rank that needs it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bytecheckpoint.engine.read_plan import Need, plan_reads, preferred_readers


@st.composite
def _plan_input(draw):
    world = draw(st.integers(1, 5))
    files = draw(st.integers(1, 3))
    writers = [draw(st.integers(0, 5)) for _ in range(files)]  # a writer may be outside this world
    boxes = [(draw(st.integers(0, files - 1)), b * 1000, draw(st.integers(1, 64)))
             for b in range(draw(st.integers(1, 5)))]
    per_rank = []
    for _ in range(world):
        needs = []
        for file, off, length in boxes:
            if draw(st.booleans()):
                start = draw(st.integers(0, length - 1))
                needs.append(Need(file, off, length, start, draw(st.integers(start + 1, length))))
        per_rank.append(needs)
    return per_rank, writers


@settings(max_examples=300, deadline=None)
@given(_plan_input())
def test_a_writer_reads_all_it_needs_of_its_files_and_every_byte_is_read_once(case):
    per_rank, writers = case
    units = plan_reads(per_rank, writers)
    reader_of: dict[tuple[int, int, int], int] = {}
    for u in units:
        for byte in range(u.start, u.stop):
            key = (u.file, u.box_offset, byte)
            assert key not in reader_of, f"byte {key} read twice"
            reader_of[key] = u.reader
    for rank, needs in enumerate(per_rank):
        for n in needs:
            for byte in range(n.start, n.stop):
                key = (n.file, n.box_offset, byte)
                assert key in reader_of, f"byte {key} needed by rank {rank} is never read"
                if writers[n.file] == rank:  # certain before the plan: the writer reads it
                    assert reader_of[key] == rank, (key, rank, reader_of[key])
    assert plan_reads(per_rank, writers) == units  # every rank derives the same plan


def test_replicated_boxes_go_to_their_writers_not_to_the_least_loaded_rank():
    # Every rank needs both boxes of file 0, written by rank 1: rank 1 reads both, where
    # worst-fit alone would give the second to rank 0.
    per_rank = [[Need(0, 0, 100, 0, 100), Need(0, 100, 100, 0, 100)] for _ in range(2)]
    units = plan_reads(per_rank, [1])
    assert [(u.box_offset, u.reader, u.receivers) for u in units] == [(0, 1, (0,)), (100, 1, (0,))]
    # Without writers the plan is the balanced one it always was.
    assert sorted(u.reader for u in plan_reads(per_rank)) == [0, 1]


def test_a_smaller_world_folds_the_writers_in_blocks_and_a_larger_one_has_none():
    assert preferred_readers([0, 1, 2, 3, 0], saved_world=4, world=4) == [0, 1, 2, 3, 0]
    assert preferred_readers([0, 1, 2, 3], saved_world=4, world=2) == [0, 0, 1, 1]
    assert preferred_readers([0, 1, 2, 3], saved_world=4, world=3) == [0, 0, 1, 2]
    # Hostile metadata naming writers outside the saved world: no preferred readers (the
    # balanced plan), never a reader outside this world.
    assert preferred_readers([0, 1, 2, 3, 9], saved_world=4, world=2) is None
    assert preferred_readers([-1, 0, 1, 2, 3], saved_world=4, world=2) is None
    # Growing 2 -> 4, the writers would take every replicated box and leave ranks 2 and 3 idle.
    assert preferred_readers([0, 1], saved_world=2, world=4) is None


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 3), st.integers(1, 40))
def test_every_rank_of_a_smaller_world_is_some_file_s_reader(saved, world, files_per_rank, rows):
    if world > saved:
        world, saved = saved, world
    file_ranks = [r for r in range(saved) for _ in range(files_per_rank)]
    readers = preferred_readers(file_ranks, saved, world)
    assert readers is not None and set(readers) == set(range(world))


def test_dim0_shards_on_fewer_ranks_are_read_by_their_preferred_readers_alone():
    # A tensor of 4 * 6 rows saved by 4 ranks (one file each, rows r*6 .. r*6+6), loaded by
    # 2 ranks holding 12 rows each: every byte a rank needs lies in a file it is the
    # preferred reader of, so all of it can be read before the plan is agreed.
    row = 16
    saved, world = 4, 2
    writers = preferred_readers(list(range(saved)), saved, world)
    assert writers is not None
    per_rank = []
    for rank in range(world):
        lo, hi = rank * 12, rank * 12 + 12
        needs = []
        for f in range(saved):
            first, end = max(lo, f * 6), min(hi, f * 6 + 6)  # the rows of file f this rank holds
            if first < end:
                needs.append(Need(f, 0, 6 * row, (first - f * 6) * row, (end - f * 6) * row))
        per_rank.append(needs)
    units = plan_reads(per_rank, writers)
    assert units and all(u.reader == writers[u.file] and not u.receivers for u in units)
    assert sum(u.nbytes for u in units) == 24 * row
