"""Writing one rank's share of a save: its storage files, one per kind, written concurrently.

Sources are either live tensor views (a synchronous save of CPU tensors writes straight from
tensor memory, no copy) or pieces staged in the host arena (async saves, device tensors);
see ``staging``. Checksums are computed block by block as the bytes go out.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from telemetry import span

from ..commit.protocol import data_file_name
from ..format.boxes import Box
from ..format.dtypes import byte_view, safetensors_code
from ..format.metadata import ByteMeta, FileMeta, ObjectMeta
from ..planning.global_plan import WriteItem
from ..planning.save_metadata import RankWrite, box_columns
from ..state.flatten import KIND_EXTRA, FlatState
from ..storage import Storage
from .files import Piece, WrittenPiece, write_file

KIND_ORDER = ("model", "optim", "extra")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(byte_view(t).numpy())


class TensorSource:
    """A writer's source for a tensor written as it is (a synchronous save): its bytes, and
    where they lie when that is known up front (a contiguous host tensor)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def __call__(self) -> memoryview:
        return tensor_bytes(self._tensor)

    @property
    def address(self) -> int | None:
        t = self._tensor
        return t.data_ptr() if t.device.type == "cpu" and t.is_contiguous() and t.numel() else None


def entry_name(item: WriteItem) -> str:
    return f"{item.key}@{','.join(map(str, item.box.offsets))}"


@dataclass(frozen=True)
class Entry:
    """One piece of a storage file and what the metadata will say it is: a tensor box
    (``box`` set) or a packed object (``owner``: the rank whose object it is, None when it is
    shared). Plain values, so a host member can send its entries to its leader."""

    kind: str
    name: str  # the safetensors entry name
    code: str  # safetensors dtype code
    shape: tuple[int, ...]
    nbytes: int
    key: str
    box: Box | None = None
    owner: int | None = None


def rank_entries(items: list[WriteItem], sources: list[Callable[[], memoryview]], flat: FlatState,
                 objects: dict[str, bytes], rank: int, *, tag_rank_objects: bool = False
                 ) -> list[tuple[Entry, Callable[[], memoryview]]]:
    """This rank's entries and their byte sources, kind by kind (``KIND_ORDER``), in write
    order. ``tag_rank_objects`` puts the rank in per-rank objects' entry names, which must be
    unique when several ranks share a file."""
    out: list[tuple[Entry, Callable[[], memoryview]]] = []
    for item, source in zip(items, sources):
        entry = Entry(flat.kind_of(item.key), entry_name(item), safetensors_code(item.dtype),
                      item.box.lengths, item.nbytes, item.key, box=item.box)
        out.append((entry, source))
    for name, blob in objects.items():
        scope, key = name.split(":", 1)
        owner = None if scope == "shared" else rank
        label = f"rank{rank}:{key}" if tag_rank_objects and owner is not None else name
        entry = Entry(KIND_EXTRA, f"__object__/{label}", "U8", (len(blob),), len(blob), key, owner=owner)
        out.append((entry, lambda b=blob: memoryview(b)))
    out.sort(key=lambda pair: KIND_ORDER.index(pair[0].kind))  # stable: write order within a kind
    return out


def record(entries: list[Entry], fname: str, written: list[WrittenPiece],
           boxes: list[tuple[str, Box, ByteMeta]], objects: list[ObjectMeta]) -> None:
    """Append where each of ``entries`` landed in ``fname`` to ``boxes`` / ``objects``."""
    for entry, w in zip(entries, written):
        bm = ByteMeta(fname, w.byte_offset, w.byte_length, w.checksums)
        if entry.box is not None:
            boxes.append((entry.key, entry.box, bm))
        else:
            objects.append(ObjectMeta(entry.key, entry.owner, bm))


def pieces_by_kind(pairs: list[tuple[Entry, Callable[[], memoryview]]]
                   ) -> dict[str, list[tuple[Entry, Piece]]]:
    """Entries grouped into their storage file's kind, each with the piece that writes it."""
    by_kind: dict[str, list[tuple[Entry, Piece]]] = {k: [] for k in KIND_ORDER}
    for entry, source in pairs:
        # A source staged through a bounded arena streams its bytes in parts (staging_ring).
        piece = Piece(entry.name, entry.code, entry.shape, entry.nbytes, source,
                      parts=getattr(source, "parts", None), address=getattr(source, "address", None))
        by_kind[entry.kind].append((entry, piece))
    return by_kind


def write_kind_file(storage: Storage, staging: str, fname: str, kind: str, pieces: list[Piece],
                    chunk_bytes: int, header: dict[str, str], rank: int, **span_fields: object
                    ) -> tuple[FileMeta, list[WrittenPiece]]:
    """Write one storage file of ``kind`` (a ``save.write`` span); ``rank`` is its writer."""
    with span("save.write", path=fname, kind=kind, **span_fields) as sp:
        size, written = write_file(storage, storage.join(staging, fname), pieces, chunk_bytes,
                                   {"format": "bytecheckpoint", **header, "kind": kind})
        sp.set(bytes=size)
    return FileMeta(fname, size, rank, kind), written


def write_rank(
    storage: Storage, staging: str, items: list[WriteItem], sources: list[Callable[[], memoryview]],
    flat: FlatState, objects: dict[str, bytes], rank: int, chunk_bytes: int, io_threads: int = 3,
    file_tag: str = "",
) -> RankWrite:
    """Write this rank's files into ``staging``. ``sources[i]`` yields the bytes of ``items[i]``;
    ``objects`` maps ``shared:<key>`` / ``rank:<key>`` to the packed objects this rank writes;
    ``file_tag`` goes into the file names (``commit.data_file_tag``)."""
    by_kind = pieces_by_kind(rank_entries(items, sources, flat, objects, rank))

    def write_kind(kind: str) -> tuple[FileMeta, list[WrittenPiece]]:
        return write_kind_file(storage, staging, data_file_name(kind, f"{rank:05d}", file_tag), kind,
                               [p for _, p in by_kind[kind]], chunk_bytes, {"rank": str(rank)}, rank)

    kinds = [k for k in KIND_ORDER if by_kind[k]]
    # Files go out concurrently: one file's fsync overlaps another's writes.
    with ThreadPoolExecutor(max(1, min(io_threads, len(kinds)))) as pool:
        results = list(pool.map(write_kind, kinds))

    files: list[FileMeta] = []
    boxes: list[tuple[str, Box, ByteMeta]] = []
    objs: list[ObjectMeta] = []
    for kind, (fmeta, written) in zip(kinds, results):
        files.append(fmeta)
        record([e for e, _ in by_kind[kind]], fmeta.name, written, boxes, objs)
    # The columns are made here, on every rank at once, not on the coordinator.
    return RankWrite(files, boxes, objs, box_columns(boxes))
