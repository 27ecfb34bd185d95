"""Which rank reads which saved bytes on load, so no byte is read twice.

Every rank says which byte ranges of which saved boxes it needs (``Need``). All ranks
compute the same plan from the same gathered needs: per saved box, the needed ranges are
cut at every rank's boundaries into pieces with one set of needing ranks each (``ReadUnit``);
one of those ranks reads the piece and sends it to the others: the rank that wrote the box's
file when it needs the piece (so a rank knows, before the plan is agreed, that it will read
what it needs of its own files, and can start: ``load_pipeline.Prefetch``), else the
least-loaded needer, largest pieces first. Pure functions, so the plan is tested without
processes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Need:
    """Bytes ``[start, stop)`` of the saved box stored at ``file[box_offset:+box_length]``,
    counted from the box's first byte."""

    file: int  # index into the metadata's file list
    box_offset: int
    box_length: int
    start: int
    stop: int


@dataclass(frozen=True)
class ReadUnit:
    """One range of one saved box, read by ``reader`` and sent to ``receivers``."""

    file: int
    box_offset: int
    box_length: int
    start: int
    stop: int
    reader: int
    receivers: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.stop - self.start

    @property
    def box(self) -> tuple[int, int]:
        return self.file, self.box_offset

    def needed_by(self, rank: int) -> bool:
        return rank == self.reader or rank in self.receivers


def _pieces(needs: list[tuple[int, int, int]]) -> Iterator[tuple[int, int, tuple[int, ...]]]:
    """Cut ``(start, stop, rank)`` ranges at every boundary; merge neighbours with the same
    set of ranks. Yields ``(start, stop, ranks)`` for every byte some rank needs."""
    points = sorted({p for s, e, _ in needs for p in (s, e)})
    open_at: dict[int, list[int]] = defaultdict(list)
    close_at: dict[int, list[int]] = defaultdict(list)
    for s, e, r in needs:
        open_at[s].append(r)
        close_at[e].append(r)
    active: dict[int, int] = defaultdict(int)  # rank -> number of its ranges covering here
    current: tuple[int, int, tuple[int, ...]] | None = None
    for left, right in zip(points, points[1:]):
        for r in close_at.get(left, ()):
            active[r] -= 1
        for r in open_at.get(left, ()):
            active[r] += 1
        ranks = tuple(sorted(r for r, n in active.items() if n > 0))
        if not ranks:
            if current is not None:
                yield current
                current = None
            continue
        if current is not None and current[2] == ranks and current[1] == left:
            current = (current[0], right, ranks)
        else:
            if current is not None:
                yield current
            current = (left, right, ranks)
    if current is not None:
        yield current


def preferred_readers(file_ranks: Sequence[int], saved_world: int, world: int) -> list[int] | None:
    """The rank that reads what it needs of each file first (``plan_reads``' ``writers``): its
    writer, folded onto a smaller world in blocks (writers ``r * world // saved_world``), so
    each rank of the load starts on the files of ``saved_world / world`` consecutive writers.
    Shards cut along one dimension (FSDP's flat shards, FSDP2 and ``Shard(0)`` DTensors) give
    a rank of the smaller world the bytes of consecutive old ranks, so it is the preferred
    reader of the very files it needs. Folded round-robin instead (``r % world``), half of
    what each rank needed of a 4 -> 2 load lay in the other rank's files and waited for the
    plan: 0.54 s against 0.51 s (1.3 GB, medians of 8 alternating). None when some rank of
    the load would be no file's reader: when the world grew (the new ranks would read nothing
    of a replicated checkpoint) or when fewer ranks wrote files (``files_per="host"``: only
    host leaders write), where the balanced rule keeps every rank reading."""
    if world < 1 or saved_world < world:
        return None
    readers = [r * world // saved_world for r in file_ranks]
    return readers if set(readers) == set(range(world)) else None


def plan_reads(needs_per_rank: list[Iterable[Need]], writers: Sequence[int] | None = None) -> list[ReadUnit]:
    """The read units of a load, in file order; identical on every rank for the same input.

    ``writers[f]`` is the rank that wrote file ``f``: every piece that rank needs is its own to
    read (see the module docstring); the other pieces go largest first to the least-loaded
    needer (worst-fit), as the save plan balances writes."""
    by_box: dict[tuple[int, int, int], list[tuple[int, int, int]]] = defaultdict(list)
    for rank, needs in enumerate(needs_per_rank):
        for n in needs:
            if n.stop > n.start:
                by_box[(n.file, n.box_offset, n.box_length)].append((n.start, n.stop, rank))
    raw: list[tuple[int, int, int, int, int, tuple[int, ...]]] = []
    for (file, off, length), needs in by_box.items():
        if len(needs) == 1:  # the common case (one rank needs this box): nothing to cut
            start, stop, rank = needs[0]
            raw.append((file, off, length, start, stop, (rank,)))
            continue
        for start, stop, ranks in _pieces(needs):
            raw.append((file, off, length, start, stop, ranks))
    load = [0] * len(needs_per_rank)
    units: list[ReadUnit] = []
    for file, off, length, start, stop, ranks in sorted(raw, key=lambda u: (u[3] - u[4], u[:4])):
        writer = writers[file] if writers is not None and 0 <= file < len(writers) else -1
        reader = writer if writer in ranks else min(ranks, key=lambda r: (load[r], r))
        load[reader] += stop - start
        units.append(ReadUnit(file, off, length, start, stop, reader,
                              tuple(r for r in ranks if r != reader)))
    units.sort(key=lambda u: (u.file, u.box_offset, u.start))
    return units


def windows(units: list[ReadUnit], limit: int) -> list[list[ReadUnit]]:
    """Consecutive groups of units of about ``limit`` bytes, never splitting a saved box
    (its units complete together, so its copies can run when the window lands)."""
    out: list[list[ReadUnit]] = []
    current: list[ReadUnit] = []
    size = 0
    for i, u in enumerate(units):
        current.append(u)
        size += u.nbytes
        last_of_box = i + 1 == len(units) or units[i + 1].box != u.box
        if last_of_box and size >= limit:
            out.append(current)
            current, size = [], 0
    if current:
        out.append(current)
    return out
