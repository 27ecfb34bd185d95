"""Cross-field checks of a decoded metadata: every index checked against the rest.

A checkpoint may come from an untrusted place, and one flipped bit must never turn into
silently wrong data, a crash or a huge allocation. After the fields have their types
(``metadata._decode``), these vectorised checks make sure that:

- every tensor's size in bytes is below ``MAX_BYTES``, every file's size too, and all of them
  together (so no sum below overflows int64);
- every box lies inside its tensor, its byte length is its element count times the item size,
  and its bytes lie inside its storage file;
- the stored pieces of a file (boxes and objects) never share a byte;
- the boxes of each tensor tile it exactly: every element stored once.

They run once when the metadata is decoded, in O(n log n) for n boxes (about 0.2 s for a
million boxes on one core). Every failure is a CorruptCheckpointError naming the tensor or
field and saying the checkpoint is damaged or hostile.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..errors import CorruptCheckpointError
from .boxes import TooIrregularError, overlapping_tensors

MAX_BYTES = 1 << 60  # one tensor, one file, or all files together: far beyond any real checkpoint
MAX_NDIM = 64
DAMAGED = "the checkpoint is damaged or hostile; restore it from a good copy or load another one"


def fail(source: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{source}: {what}; {DAMAGED}")


def tensor_numel(source: str, keys: list[str], ndim: np.ndarray, shape: np.ndarray,
                 shape_start: np.ndarray, itemsize: np.ndarray) -> np.ndarray:
    """Element counts of the tensors, after checking that each holds fewer than MAX_BYTES."""
    if len(ndim) and (ndim.min() < 0 or ndim.max() > MAX_NDIM):
        t = int(np.argmax((ndim < 0) | (ndim > MAX_NDIM)))
        raise fail(source, f"tensor {keys[t]!r} has {int(ndim[t])} dimensions")
    if len(shape) and (shape.min() < 0 or shape.max() > MAX_BYTES):
        t = _owner(shape_start, int(np.argmax((shape < 0) | (shape > MAX_BYTES))))
        raise fail(source, f"tensor {keys[t]!r} has a dimension outside 0..{MAX_BYTES}")
    numel = np.ones(len(ndim), dtype=np.int64)
    has = ndim > 0
    if not has.any():
        return numel
    # The size in log2 first: an int64 product of hostile dimensions would wrap around.
    log = np.log2(np.maximum(shape, 1).astype(np.float64))
    log_size = np.zeros(len(ndim))
    log_size[has] = np.add.reduceat(log, shape_start[has])
    log_size += np.log2(itemsize)
    empty = np.zeros(len(ndim), dtype=bool)
    empty[has] = np.minimum.reduceat(shape, shape_start[has]) == 0
    too_big = (log_size > math.log2(MAX_BYTES)) & ~empty
    if too_big.any():
        t = int(np.argmax(too_big))
        raise fail(source, f"tensor {keys[t]!r} declares {_shape(shape, shape_start, ndim, t)}, over "
                           f"{MAX_BYTES} bytes")
    numel[has] = np.multiply.reduceat(shape, shape_start[has])
    numel[empty] = 0
    return numel


def check_files(source: str, names: list[str], sizes: list[int]) -> None:
    if sum(sizes) > MAX_BYTES:
        raise fail(source, f"its storage files declare {sum(sizes)} bytes in all (over {MAX_BYTES})")


def check_boxes(source: str, keys: list[str], shape: np.ndarray, shape_start: np.ndarray,
                ndim: np.ndarray, numel_t: np.ndarray, itemsize: np.ndarray,
                tensor: np.ndarray, dim_start: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
                file: np.ndarray, byte_offset: np.ndarray, byte_length: np.ndarray,
                file_names: list[str], file_sizes: np.ndarray,
                objects: tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]) -> None:
    """Every box inside its tensor and its file, no two pieces sharing a byte, every tensor
    tiled exactly (see the module docstring). ``objects`` is (file, offset, length, keys)."""
    n = len(tensor)
    dim_owner = np.repeat(np.arange(n), ndim[tensor]) if n else np.zeros(0, dtype=np.int64)
    if len(offsets):
        dim_pos = np.arange(len(offsets)) - dim_start[dim_owner]
        limit = shape[shape_start[tensor[dim_owner]] + dim_pos]
        # Each of offset and length within the dimension first, so their sum cannot wrap.
        outside = (offsets < 0) | (lengths < 0) | (offsets > limit) | (lengths > limit - offsets)
        if outside.any():
            b = int(dim_owner[int(np.argmax(outside))])
            box = _box(offsets, lengths, dim_start, ndim, tensor, b)
            raise fail(source, f"a box of tensor {keys[tensor[b]]!r} ({box}) lies outside its shape "
                               f"{_shape(shape, shape_start, ndim, int(tensor[b]))}")
    numel = np.ones(n, dtype=np.int64)
    has = ndim[tensor] > 0 if n else np.zeros(0, dtype=bool)
    if has.any():
        # Inside the tensor, so no product exceeds its (bounded) element count; a zero length
        # anywhere makes the product 0 exactly.
        numel[has] = np.multiply.reduceat(lengths, dim_start[has])
        zero = np.zeros(n, dtype=bool)
        zero[has] = np.minimum.reduceat(lengths, dim_start[has]) == 0
        numel[zero] = 0
    wrong = numel * itemsize[tensor] != byte_length
    if wrong.any():
        b = int(np.argmax(wrong))
        raise fail(source, f"a box of tensor {keys[tensor[b]]!r} declares {int(byte_length[b])} bytes "
                           f"for {int(numel[b])} elements of {int(itemsize[tensor[b]])} bytes")
    _check_ranges(source, "a box of tensor", file, byte_offset, byte_length, file_names, file_sizes,
                  lambda b: keys[tensor[b]])
    o_file, o_off, o_len, o_keys = objects
    _check_ranges(source, "object", o_file, o_off, o_len, file_names, file_sizes, lambda i: o_keys[i])
    _check_disjoint(source, file, byte_offset, byte_length, o_file, o_off, o_len, file_names, file_sizes)
    _check_tiling(source, keys, shape, shape_start, ndim, numel_t, tensor, dim_start, offsets,
                  lengths, numel, dim_owner)


def _check_ranges(source: str, what: str, file: np.ndarray, off: np.ndarray, length: np.ndarray,
                  file_names: list[str], file_sizes: np.ndarray, name: Callable[[int], str]) -> None:
    if not len(file):
        return
    size = file_sizes[file]
    outside = (off < 0) | (length < 0) | (off > size) | (length > size - off)
    if outside.any():
        i = int(np.argmax(outside))
        raise fail(source, f"{what} {name(i)!r} stores bytes {int(off[i])}+{int(length[i])}, outside "
                           f"its storage file {file_names[int(file[i])]!r} of {int(size[i])} bytes")


def _check_disjoint(source: str, file: np.ndarray, off: np.ndarray, length: np.ndarray,
                    o_file: np.ndarray, o_off: np.ndarray, o_len: np.ndarray,
                    file_names: list[str], file_sizes: np.ndarray) -> None:
    """No two stored pieces of one file share a byte (a piece read for one tensor must not be
    another's). Files are laid end to end (their sizes sum below MAX_BYTES), then sorted."""
    f = np.concatenate([file, o_file]).astype(np.int64)
    start = np.concatenate([off, o_off])
    size = np.concatenate([length, o_len])
    keep = size > 0
    if keep.sum() < 2:
        return
    file_base = np.concatenate([[0], np.cumsum(file_sizes)[:-1]]).astype(np.int64)
    key = file_base[f[keep]] + start[keep]
    end = key + size[keep]
    order = np.argsort(key, kind="stable")
    clash = key[order][1:] < end[order][:-1]
    if clash.any():
        i = int(np.argmax(clash))
        a = int(order[i])
        fname = file_names[int(f[keep][a])]
        raise fail(source, f"two stored pieces share bytes of {fname!r} (at byte "
                           f"{int(start[keep][order[i + 1]])})")


def _check_tiling(source: str, keys: list[str], shape: np.ndarray, shape_start: np.ndarray,
                  ndim: np.ndarray, numel_t: np.ndarray, tensor: np.ndarray, dim_start: np.ndarray,
                  offsets: np.ndarray, lengths: np.ndarray, numel: np.ndarray,
                  dim_owner: np.ndarray) -> None:
    """Every tensor's boxes tile it: as many elements as it has, and no two overlapping."""
    n_t = len(keys)
    covered = np.bincount(tensor, numel, minlength=n_t).astype(np.int64) if len(tensor) else \
        np.zeros(n_t, dtype=np.int64)
    wrong = (covered != numel_t) & (numel_t > 0)
    if wrong.any():
        t = int(np.argmax(wrong))
        raise fail(source, f"the boxes of tensor {keys[t]!r} cover {int(covered[t])} of its "
                           f"{int(numel_t[t])} elements (part of it was never saved)")
    live = np.flatnonzero((numel > 0) & (ndim[tensor] > 0))
    if len(live) < 2:
        return
    dims = int(ndim.max())
    off = np.zeros((len(tensor), dims), dtype=np.int64)
    ln = np.ones((len(tensor), dims), dtype=np.int64)
    dim_pos = np.arange(len(offsets)) - dim_start[dim_owner]
    off[dim_owner, dim_pos] = offsets
    ln[dim_owner, dim_pos] = lengths
    try:
        bad = overlapping_tensors(tensor[live], off[live], ln[live], n_t,
                                  max_pairs=16 * len(live) + (1 << 20))
    except TooIrregularError as exc:
        raise fail(source, f"the boxes of tensor {keys[int(exc.args[0])]!r} are laid out too "
                           "irregularly to check for overlaps (no planner writes such a layout)") from None
    if bad.any():
        t = int(np.argmax(bad))
        raise fail(source, f"two boxes of tensor {keys[t]!r} overlap (some elements stored twice, "
                           "others not at all)")
    # covered == numel and no overlaps: every element is stored exactly once.


def _owner(starts: np.ndarray, pos: int) -> int:
    return int(np.searchsorted(starts, pos, side="right") - 1)


def _shape(shape: np.ndarray, shape_start: np.ndarray, ndim: np.ndarray, t: int) -> tuple[int, ...]:
    s = int(shape_start[t])
    return tuple(shape[s : s + int(ndim[t])].tolist())


def _box(offsets: np.ndarray, lengths: np.ndarray, dim_start: np.ndarray, ndim: np.ndarray,
         tensor: np.ndarray, b: int) -> str:
    s, k = int(dim_start[b]), int(ndim[tensor[b]])
    return f"offsets {tuple(offsets[s : s + k].tolist())}, lengths {tuple(lengths[s : s + k].tolist())}"
