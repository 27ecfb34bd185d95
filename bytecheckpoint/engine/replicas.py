"""Sampled digests of the replicated boxes a rank offers, for the coordinator's replica check.

A box several ranks offer (DDP parameters, ``Replicate`` DTensors, plain tensors next to
shards) is written once. Replicas that disagree (data-parallel ranks out of sync, pipeline
stages that name different layers alike, a per-rank buffer) would be saved as one rank's
values, or a mix of row pieces from several, silently. Each holder therefore hashes a few
elements of each such box (all of a small one) at ``save()`` time and the coordinator compares
the digests (:func:`~bytecheckpoint.planning.global_plan.check_replicas`). Sampling keeps the
cost to one small gather per box; it catches replicas that differ throughout, not a single
element of a large tensor.

The samples are copied at ``save()`` time (on a GPU: kernels queued on the current stream, no
wait), and turned into bytes and digests in the write, off the training's path.
``BCP_DIFFERING_REPLICAS`` says what differing replicas do: ``refuse`` (the default),
``warn`` (save the one copy and log the keys), ``off`` (take no samples).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from ..errors import InvalidSettingError
from ..planning.global_plan import REPLICA_BUCKETS, ReplicaRows

MODE_ENV = "BCP_DIFFERING_REPLICAS"
MODES = ("refuse", "warn", "off")


def mode() -> str:
    """What replicas that differ between ranks do (``BCP_DIFFERING_REPLICAS``)."""
    value = os.environ.get(MODE_ENV, "").strip().lower() or "refuse"
    if value not in MODES:
        raise InvalidSettingError(f"{MODE_ENV}={os.environ[MODE_ENV]!r}: expected one of {', '.join(MODES)}")
    return value

SAMPLES = 64  # elements hashed per box; a box of at most this many is hashed whole


def _step(numel: int) -> int:
    return max(1, (numel - 1) // (SAMPLES - 1))


@functools.lru_cache(maxsize=4096)
def _positions(shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """The sampled elements of a tensor of ``shape`` as indices: every ``_step``-th in
    row-major order, the same logical elements whatever the memory layout."""
    numel = 1
    for s in shape:
        numel *= s
    return tuple(torch.unravel_index(torch.arange(0, numel, _step(numel)), shape))


def _pick(view: torch.Tensor) -> torch.Tensor:
    """About ``SAMPLES`` of the elements of ``view`` (more than that many) as a 1-D tensor on its
    device, possibly a view of it (``take_samples`` copies it with the others of its dtype)."""
    numel = view.numel()
    if view.is_contiguous():  # a strided view: no indexing kernel
        return view.view(-1)[:: _step(numel)]
    return view[_positions(tuple(view.shape))]


@dataclass
class Samples:
    """Copies of this rank's replicated boxes' samples, taken at ``save()`` time: per device
    and dtype, one tensor holding the samples of its rows one after another."""

    replica_rows: ReplicaRows
    # (samples, [(row, how many of them are its)]) in the order they lie in the tensor
    blobs: list[tuple[torch.Tensor, list[tuple[int, int]]]]
    # (device, CUDA event recorded there after the copies)
    ready: list[tuple[torch.device, Any]] = field(default_factory=list)


def take_samples(views: list[torch.Tensor | None], replica_rows: ReplicaRows) -> Samples | None:
    """Sample this rank's replicated boxes now, while they hold this save()'s values.
    ``views[row]`` is the data of row ``row`` of this rank's local plan. No host copy here: on a
    GPU the sampling kernels are queued on the current stream, and an event marks their end."""
    if not replica_rows or mode() == "off":
        return None
    # Small boxes (optimizer step counters: one per parameter) are stacked whole, one stack per
    # device, dtype and shape; per-box tensor calls cost more than copying them.
    small: dict[tuple[torch.device, torch.dtype, torch.Size], tuple[list[torch.Tensor], list[int]]] = {}
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[tuple[int, int]]]] = {}
    with torch.no_grad():
        for _, held in replica_rows:
            for row in held:
                view = views[row]
                assert view is not None
                if view.is_conj() or view.is_neg():  # lazily conjugated views: their values
                    view = view.resolve_conj().resolve_neg()
                if view.numel() <= SAMPLES:
                    alike, rows = small.setdefault((view.device, view.dtype, view.shape), ([], []))
                    alike.append(view)
                    rows.append(row)
                    continue
                picks, where = groups.setdefault((view.device, view.dtype), ([], []))
                pick = _pick(view)
                picks.append(pick)
                where.append((row, pick.numel()))
        for (device, dtype, shape), (alike, rows) in small.items():
            picks, where = groups.setdefault((device, dtype), ([], []))
            picks.append(torch.stack(alike).view(-1))
            where.extend((row, shape.numel()) for row in rows)
        # One concatenation per device and dtype: a copy, so the samples keep save() time's
        # values whatever the training does next.
        blobs = [(torch.cat(picks), where) for picks, where in groups.values()]
    ready = []
    for device in {blob.device for blob, _ in blobs if blob.is_cuda}:
        event = torch.cuda.Event(blocking=True)  # synchronize() sleeps instead of spinning a core
        event.record(torch.cuda.current_stream(device))
        ready.append((device, event))
    return Samples(replica_rows, blobs, ready)


def replica_digests(samples: Samples | None) -> dict[int, tuple[int, ...]]:
    """Per replica set this rank holds: one xxh3 digest per bucket of its boxes' samples."""
    if samples is None:
        return {}
    for device, event in samples.ready:
        # On the event's device: the save's thread may be current on another one (a worker
        # thread starts on cuda:0), where an event call would create a CUDA context.
        with torch.cuda.device(device):
            event.synchronize()  # the copies were queued on the training's stream
    raw: dict[int, bytes] = {}
    for blob, where in samples.blobs:
        data = blob.view(torch.uint8).cpu().numpy().tobytes()  # one host copy per blob
        size, offset = blob.element_size(), 0
        for row, numel in where:
            raw[row] = data[offset:offset + numel * size]
            offset += numel * size
    out: dict[int, tuple[int, ...]] = {}
    for set_id, held in samples.replica_rows:
        hashes = [xxhash.xxh3_64() for _ in range(min(REPLICA_BUCKETS, len(held)))]
        for i, row in enumerate(held):
            hashes[i % len(hashes)].update(raw[row])
        out[set_id] = tuple(h.intdigest() for h in hashes)
    return out
