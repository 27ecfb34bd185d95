"""Metadata size and decode time for large box counts.

    .venv/bin/python bench/metadata_scale.py [--boxes 1000000] [--repeats 5]

Builds a synthetic checkpoint's metadata (2-D tensors, each cut into 8 row boxes spread over
files), encodes it, and times decoding plus one tensor's box lookup. Prints medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bytecheckpoint.format.metadata import BoxTable, CheckpointMetadata, FileMeta, TensorMeta


def synthetic(n_boxes: int, boxes_per_tensor: int = 8, ranks: int = 1024) -> CheckpointMetadata:
    n_tensors = n_boxes // boxes_per_tensor
    rows, cols = 4096, 1024
    tensors = [TensorMeta(f"model/layers.{i // 8}.w{i % 8}", "bfloat16", (rows, cols))
               for i in range(n_tensors)]
    files = [FileMeta(f"model-{r:05d}.safetensors", 1 << 40, r, "model") for r in range(ranks)]
    step = rows // boxes_per_tensor
    tensor = np.repeat(np.arange(n_tensors, dtype=np.int32), boxes_per_tensor)
    row_off = np.tile(np.arange(boxes_per_tensor, dtype=np.int64) * step, n_tensors)
    offsets = np.stack([row_off, np.zeros_like(row_off)], axis=1).reshape(-1)
    lengths = np.tile(np.array([step, cols], dtype=np.int64), n_boxes)
    nbytes = step * cols * 2
    n_chunks = -(-nbytes // (4 << 20))
    table = BoxTable(
        tensor=tensor, offsets=offsets, lengths=lengths,
        dim_start=np.arange(n_boxes, dtype=np.int64) * 2,
        file=(np.arange(n_boxes) % ranks).astype(np.int32),
        byte_offset=(np.arange(n_boxes, dtype=np.int64) // ranks) * nbytes,
        byte_length=np.full(n_boxes, nbytes, dtype=np.int64),
        checksum_start=np.arange(n_boxes, dtype=np.int64) * n_chunks,
        checksums=np.arange(n_boxes * n_chunks, dtype=np.uint64),
    )
    return CheckpointMetadata(framework="fsdp2", world_size=ranks, tensors=tensors, boxes=table,
                              objects=[], files=files, chunk_bytes=4 << 20)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--boxes", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    meta = synthetic(args.boxes)
    raw = meta.to_bytes()
    decode, lookup = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        back = CheckpointMetadata.from_bytes(raw)
        decode.append(time.perf_counter() - t)
        t = time.perf_counter()
        boxes = back.boxes_of(meta.tensors[len(meta.tensors) // 2].key)
        lookup.append(time.perf_counter() - t)
        assert len(boxes) == 8
    print(f"boxes={args.boxes:,} tensors={len(meta.tensors):,} metadata={len(raw) / 2**20:.1f} MiB")
    print(f"decode+validate median {statistics.median(decode) * 1e3:.1f} ms "
          f"(min {min(decode) * 1e3:.1f}); one tensor's boxes {statistics.median(lookup) * 1e6:.0f} us")


if __name__ == "__main__":
    main()
