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
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..metadata import BoxTable, ByteMeta, CheckpointMetadata, FileMeta, ObjectMeta, TensorMeta
from ..planning import GlobalSavePlan
from ..sharding import Box


@dataclass(frozen=True)
class RankWrite:
    """What one rank wrote: its files, and where each of its boxes and objects landed."""

    files: list[FileMeta]
    boxes: list[tuple[str, Box, ByteMeta]]
    objects: list[ObjectMeta]


@dataclass(frozen=True)
class MetadataTemplate:
    tensors: list[TensorMeta]
    order: list[tuple[int, int]]  # row -> (rank, index into that rank's boxes)
    tensor: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    dim_start: np.ndarray


def metadata_template(plan: GlobalSavePlan, writes: list[RankWrite]) -> MetadataTemplate:
    keys = sorted(plan.tensors)
    index = {k: i for i, k in enumerate(keys)}
    tensors = [TensorMeta(k, plan.tensors[k][0], tuple(plan.tensors[k][1])) for k in keys]
    rows = sorted(((index[k], box, r, j) for r, w in enumerate(writes)
                   for j, (k, box, _) in enumerate(w.boxes)), key=lambda row: (row[0], row[1]))
    nd = np.array([box.ndim for _, box, _, _ in rows], dtype=np.int64)
    return MetadataTemplate(
        tensors=tensors,
        order=[(r, j) for _, _, r, j in rows],
        tensor=np.array([row[0] for row in rows], dtype=np.int32),
        offsets=np.array([o for _, box, _, _ in rows for o in box.offsets], dtype=np.int64),
        lengths=np.array([n for _, box, _, _ in rows for n in box.lengths], dtype=np.int64),
        dim_start=np.concatenate([[0], np.cumsum(nd)[:-1]]).astype(np.int64) if rows else nd,
    )


def build_metadata(
    template: MetadataTemplate, writes: list[RankWrite], *, framework: str, world_size: int,
    layout: dict[str, Any], step: int | None, user_metadata: dict[str, Any], chunk_bytes: int,
) -> CheckpointMetadata:
    files = [f for w in writes for f in w.files]
    file_index = {f.name: i for i, f in enumerate(files)}
    rows = [writes[r].boxes[j][2] for r, j in template.order]
    n_chunks = np.array([len(bm.checksums) for bm in rows], dtype=np.int64)
    table = BoxTable(
        tensor=template.tensor,
        offsets=template.offsets,
        lengths=template.lengths,
        dim_start=template.dim_start,
        file=np.array([file_index[bm.file] for bm in rows], dtype=np.int32),
        byte_offset=np.array([bm.byte_offset for bm in rows], dtype=np.int64),
        byte_length=np.array([bm.byte_length for bm in rows], dtype=np.int64),
        checksum_start=np.concatenate([[0], np.cumsum(n_chunks)[:-1]]).astype(np.int64)
        if rows else n_chunks,
        checksums=np.array([c for bm in rows for c in bm.checksums], dtype=np.uint64),
    )
    return CheckpointMetadata(
        framework=framework, world_size=world_size, tensors=template.tensors, boxes=table,
        objects=[o for w in writes for o in w.objects], files=files, chunk_bytes=chunk_bytes,
        layout=layout, step=step, user_metadata=user_metadata, created_at=time.time(),
    )
