"""Redundant-read elimination on load: every needed byte is read by exactly one rank and sent
to the others. The read plan is tested as a pure function; a DDP load on 4 ranks (every rank
needs every byte) is tested end to end against the checkpoint's own size."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bytecheckpoint.commit.integrity import read_metadata, resolve
from bytecheckpoint.engine.read_plan import Need, plan_reads, windows
from tests.support import workloads as w
from tests.support.helpers import assert_same_state, file_payload, payload_bytes


@st.composite
def _needs(draw):
    world = draw(st.integers(1, 5))
    boxes = draw(st.lists(st.integers(1, 64), min_size=1, max_size=4))  # box lengths
    per_rank = []
    for _ in range(world):
        needs = []
        for b, length in enumerate(boxes):
            if draw(st.booleans()):
                start = draw(st.integers(0, length - 1))
                stop = draw(st.integers(start + 1, length))
                needs.append(Need(0, b * 1000, length, start, stop))
        per_rank.append(needs)
    return per_rank


@settings(max_examples=200, deadline=None)
@given(_needs())
def test_every_needed_byte_is_read_once_by_a_rank_that_needs_it(per_rank):
    units = plan_reads(per_rank)
    reads: dict[tuple[int, int], int] = {}
    got: dict[int, set[tuple[int, int]]] = {r: set() for r in range(len(per_rank))}
    for u in units:
        for byte in range(u.start, u.stop):
            key = (u.box_offset, byte)
            assert key not in reads, f"byte {key} read twice"
            reads[key] = u.reader
            for r in (u.reader, *u.receivers):
                got[r].add(key)
        assert u.reader not in u.receivers
    for rank, needs in enumerate(per_rank):
        wanted = {(n.box_offset, b) for n in needs for b in range(n.start, n.stop)}
        # A rank receives exactly the bytes it needs: no more, no less.
        assert got[rank] == wanted
        for key in wanted:
            assert reads[key] == rank or rank in next(
                u.receivers for u in units if u.box_offset == key[0] and u.start <= key[1] < u.stop)
    # The same input gives the same plan (every rank computes it on its own).
    assert plan_reads(per_rank) == units


def test_replicated_needs_are_balanced_across_ranks():
    per_rank = [[Need(0, i * 100, 100, 0, 100) for i in range(40)] for _ in range(4)]
    units = plan_reads(per_rank)
    assert len(units) == 40
    load = [sum(u.nbytes for u in units if u.reader == r) for r in range(4)]
    assert load == [1000] * 4


def test_windows_never_split_a_box():
    per_rank = [[Need(0, 0, 100, 0, 60), Need(0, 100, 50, 0, 50)], [Need(0, 0, 100, 40, 100)]]
    units = plan_reads(per_rank)
    assert [(u.start, u.stop, u.reader, u.receivers) for u in units if u.box_offset == 0] == [
        (0, 40, 0, ()), (40, 60, 1, (0,)), (60, 100, 1, ())]  # rank 0 already reads box 100
    groups = windows(units, limit=10)
    assert [[u.box_offset for u in g] for g in groups] == [[0, 0, 0], [100]]


def test_ddp_load_on_4_ranks_reads_the_checkpoint_once_each_rank_its_own_files(world, tmp_path):
    root = str(tmp_path / "ddp")
    saved = world(4).run(w.ddp_train_save, root, 2)
    storage, path = resolve(root)
    meta = read_metadata(storage, path)
    loaded = world(4).run(w.ddp_load, root)
    for r in loaded:
        assert_same_state(saved[0]["ref"], r["state"])
    per_rank = [r["bytes_read"] for r in loaded]
    # Every rank needs all of it; together they read it once (DCP would read it 4 times).
    assert sum(per_rank) == payload_bytes(path)
    assert sum(per_rank) <= meta.total_bytes
    assert max(per_rank) <= 1.3 * sum(per_rank) / 4, per_rank
    # Early reads (load_pipeline.Prefetch): each rank reads exactly the files it wrote.
    own = [sum(file_payload(path, f.name)[1] for f in meta.files if f.rank == rank) for rank in range(4)]
    assert per_rank == own
