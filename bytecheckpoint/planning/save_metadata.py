"""The coordinator's metadata for a save, split into what a structure fixes and what each
save measures.

A ``MetadataTemplate`` holds the tensor list, the order of the box rows and their geometry
columns (tensor, offsets, lengths), all fixed by the plan. ``build_metadata`` fills in the
per-save facts: files and their sizes, byte offsets, checksums, objects and the step. The
template is built once per plan and kept in the plan cache, so a repeated save does no
sorting or geometry work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from ..format.boxes import Box
from ..format.metadata import BoxTable, ByteMeta, CheckpointMetadata, FileMeta, ObjectMeta, TensorMeta
from ..runtime.gc_pause import gc_paused
from .global_plan import GlobalSavePlan


@dataclass(frozen=True)
class BoxColumns:
    """A rank's ByteMeta as columns, in the order of its ``boxes``: made by the writing rank,
    so the coordinator only concatenates and permutes arrays (no per-box Python work)."""

    file_names: list[str]
    file_ref: np.ndarray  # int32 index into file_names, per box
    byte_offset: np.ndarray
    byte_length: np.ndarray
    n_chunks: np.ndarray
    checksums: np.ndarray  # uint64, concatenated


def box_columns(boxes: list[tuple[str, Box, ByteMeta]]) -> BoxColumns:
    names: dict[str, int] = {}
    file_ref = np.array([names.setdefault(bm.file, len(names)) for _, _, bm in boxes], dtype=np.int32)
    return BoxColumns(
        file_names=list(names),
        file_ref=file_ref,
        byte_offset=np.array([bm.byte_offset for _, _, bm in boxes], dtype=np.int64),
        byte_length=np.array([bm.byte_length for _, _, bm in boxes], dtype=np.int64),
        n_chunks=np.array([len(bm.checksums) for _, _, bm in boxes], dtype=np.int64),
        checksums=np.fromiter(chain.from_iterable(bm.checksums for _, _, bm in boxes), dtype=np.uint64),
    )


@dataclass(frozen=True)
class RankWrite:
    """What one rank wrote: its files, and where each of its boxes and objects landed."""

    files: list[FileMeta]
    boxes: list[tuple[str, Box, ByteMeta]]
    objects: list[ObjectMeta]
    columns: BoxColumns | None = None  # ``boxes``' ByteMeta as columns (see BoxColumns)
    # Sampled digests of this rank's replicated boxes per replica set (engine/replicas.py),
    # compared by the coordinator before it commits.
    replicas: dict[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class MetadataTemplate:
    tensors: list[TensorMeta]
    order: np.ndarray  # row -> position in the ranks' boxes laid end to end (rank order)
    tensor: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    dim_start: np.ndarray


def metadata_template(plan: GlobalSavePlan, writes: list[RankWrite]) -> MetadataTemplate:
    with gc_paused():  # a row tuple per box: see gc_paused
        return _metadata_template(plan, writes)


def _metadata_template(plan: GlobalSavePlan, writes: list[RankWrite]) -> MetadataTemplate:
    keys = sorted(plan.tensors)
    index = {k: i for i, k in enumerate(keys)}
    tensors = [TensorMeta(k, plan.tensors[k][0], tuple(plan.tensors[k][1])) for k in keys]
    # Plain tuples as sort keys: comparing Box dataclasses costs a Python call per compare,
    # which dominated this at hundreds of thousands of boxes.
    rows = sorted((index[k], box.offsets, box.lengths, pos)
                  for pos, (k, box, _) in enumerate(chain.from_iterable(w.boxes for w in writes)))
    nd = np.fromiter((len(row[1]) for row in rows), dtype=np.int64, count=len(rows))
    return MetadataTemplate(
        tensors=tensors,
        order=np.fromiter((row[3] for row in rows), dtype=np.int64, count=len(rows)),
        tensor=np.fromiter((row[0] for row in rows), dtype=np.int32, count=len(rows)),
        offsets=np.fromiter((o for row in rows for o in row[1]), dtype=np.int64),
        lengths=np.fromiter((n for row in rows for n in row[2]), dtype=np.int64),
        dim_start=np.concatenate([[0], np.cumsum(nd)[:-1]]).astype(np.int64) if rows else nd,
    )


def build_metadata(
    template: MetadataTemplate, writes: list[RankWrite], *, framework: str, world_size: int,
    layout: dict[str, Any], step: int | None, user_metadata: dict[str, Any], chunk_bytes: int,
) -> CheckpointMetadata:
    files = [f for w in writes for f in w.files]
    file_index = {f.name: i for i, f in enumerate(files)}
    cols = [w.columns if w.columns is not None else box_columns(w.boxes) for w in writes]
    # Each rank's file references, mapped to the global file list (a few names per rank).
    file_col = np.concatenate(
        [np.array([file_index[n] for n in c.file_names], dtype=np.int32)[c.file_ref] if len(c.file_ref)
         else np.zeros(0, dtype=np.int32) for c in cols]) if cols else np.zeros(0, dtype=np.int32)
    order = template.order
    n_chunks_all = _cat([c.n_chunks for c in cols], np.int64)
    n_chunks = n_chunks_all[order]
    # Checksums: each row's run, taken from the ranks' concatenated runs in row order.
    run_start = np.concatenate([[0], np.cumsum(n_chunks_all)[:-1]]).astype(np.int64)[order]
    checksum_start = np.concatenate([[0], np.cumsum(n_chunks)[:-1]]).astype(np.int64)
    total = int(n_chunks.sum())
    take = np.repeat(run_start - checksum_start, n_chunks) + np.arange(total, dtype=np.int64)
    table = BoxTable(
        tensor=template.tensor,
        offsets=template.offsets,
        lengths=template.lengths,
        dim_start=template.dim_start,
        file=file_col[order],
        byte_offset=_cat([c.byte_offset for c in cols], np.int64)[order],
        byte_length=_cat([c.byte_length for c in cols], np.int64)[order],
        checksum_start=checksum_start[: len(order)],
        checksums=_cat([c.checksums for c in cols], np.uint64)[take],
    )
    return CheckpointMetadata(
        framework=framework, world_size=world_size, tensors=template.tensors, boxes=table,
        objects=[o for w in writes for o in w.objects], files=files, chunk_bytes=chunk_bytes,
        layout=layout, step=step, user_metadata=user_metadata, created_at=time.time(),
    )


def _cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)
