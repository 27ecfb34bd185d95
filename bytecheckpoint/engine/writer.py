"""Writing one rank's share of a save: its storage files, one per kind, written concurrently.

Sources are either live tensor views (a synchronous save of CPU tensors writes straight from
tensor memory, no copy) or pieces staged in the host arena (async saves, device tensors);
see ``staging``. Checksums are computed block by block as the bytes go out.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from telemetry import span

from ..dtypes import safetensors_code
from ..metadata import ByteMeta, FileMeta, ObjectMeta
from ..planning import WriteItem
from ..state import KIND_EXTRA, FlatState
from ..storage import Storage
from .files import Piece, write_file
from .save_metadata import RankWrite, box_columns

KIND_ORDER = ("model", "optim", "extra")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy())


def entry_name(item: WriteItem) -> str:
    return f"{item.key}@{','.join(map(str, item.box.offsets))}"


def write_rank(
    storage: Storage, staging: str, items: list[WriteItem], sources: list[Callable[[], memoryview]],
    flat: FlatState, objects: dict[str, bytes], rank: int, chunk_bytes: int, io_threads: int = 3,
) -> RankWrite:
    """Write this rank's files into ``staging``. ``sources[i]`` yields the bytes of ``items[i]``;
    ``objects`` maps ``shared:<key>`` / ``rank:<key>`` to the packed objects this rank writes."""
    by_kind: dict[str, list[tuple[WriteItem | None, Piece]]] = {k: [] for k in KIND_ORDER}
    for item, source in zip(items, sources):
        piece = Piece(entry_name(item), safetensors_code(item.dtype), item.box.lengths, item.nbytes, source)
        by_kind[flat.kind_of(item.key)].append((item, piece))
    for name, blob in objects.items():
        piece = Piece(f"__object__/{name}", "U8", (len(blob),), len(blob), lambda b=blob: memoryview(b))
        by_kind[KIND_EXTRA].append((None, piece))

    def write_kind(kind: str) -> tuple[FileMeta, list]:
        entries = by_kind[kind]
        fname = f"{kind}-{rank:05d}.safetensors"
        with span("save.write", path=fname, kind=kind) as sp:
            size, written = write_file(
                storage, storage.join(staging, fname), [p for _, p in entries], chunk_bytes,
                {"format": "bytecheckpoint", "rank": str(rank), "kind": kind},
            )
            sp.set(bytes=size)
        return FileMeta(fname, size, rank, kind), written

    kinds = [k for k in KIND_ORDER if by_kind[k]]
    # Files go out concurrently: one file's fsync overlaps another's writes.
    with ThreadPoolExecutor(max(1, min(io_threads, len(kinds)))) as pool:
        results = list(pool.map(write_kind, kinds))

    files, boxes, objs = [], [], []
    for kind, (fmeta, written) in zip(kinds, results):
        files.append(fmeta)
        for (item, piece), w in zip(by_kind[kind], written):
            bm = ByteMeta(fmeta.name, w.byte_offset, w.byte_length, w.checksums)
            if item is not None:
                boxes.append((item.key, item.box, bm))
            else:
                scope, key = piece.name[len("__object__/") :].split(":", 1)
                objs.append(ObjectMeta(key, None if scope == "shared" else rank, bm))
    # The columns are made here, on every rank at once, not on the coordinator.
    return RankWrite(files, boxes, objs, box_columns(boxes))
