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
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from ..errors import InvalidArgumentError
from ..planning.global_plan import REPLICA_BUCKETS, ReplicaRows

MODE_ENV = "BCP_DIFFERING_REPLICAS"
MODES = ("refuse", "warn", "off")


def mode() -> str:
    """What replicas that differ between ranks do (``BCP_DIFFERING_REPLICAS``)."""
    value = os.environ.get(MODE_ENV, "").strip().lower() or "refuse"
    if value not in MODES:
        raise InvalidArgumentError(f"{MODE_ENV}={os.environ[MODE_ENV]!r}: expected one of {', '.join(MODES)}")
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


def _sample(view: torch.Tensor) -> torch.Tensor:
    """About ``SAMPLES`` of ``view``'s elements, as a contiguous 1-D tensor on its device."""
    view = view.detach()
    numel = view.numel()
    if numel <= SAMPLES:
        picked = view.reshape(-1)
    elif view.is_contiguous():  # a strided view, then one small copy (cheaper than indexing)
        picked = view.view(-1)[:: _step(numel)]
    else:
        picked = view[_positions(tuple(view.shape))]
    out = picked.resolve_conj().resolve_neg().contiguous().reshape(-1)
    if out.numel() and out.untyped_storage().data_ptr() == view.untyped_storage().data_ptr():
        out = out.clone()  # still the live tensor's memory: digested later, so copy it now
    return out


def _bytes(samples: list[torch.Tensor]) -> list[bytes]:
    """Each sample's bytes, from one concatenation (and one host copy) per device."""
    out = [b""] * len(samples)
    by_device: dict[torch.device, list[int]] = defaultdict(list)
    for i, sample in enumerate(samples):
        by_device[sample.device].append(i)
    for idx in by_device.values():
        raw = [samples[i].view(torch.uint8) for i in idx]
        data = torch.cat(raw).cpu().numpy().tobytes()
        start = 0
        for i, r in zip(idx, raw):
            out[i] = data[start:start + r.numel()]
            start += r.numel()
    return out


@dataclass
class Samples:
    """Copies of this rank's replicated boxes' samples, taken at ``save()`` time."""

    replica_rows: ReplicaRows
    rows: dict[int, torch.Tensor]
    # (device, CUDA event recorded there after the copies)
    ready: list[tuple[torch.device, Any]] = field(default_factory=list)


def take_samples(views: list[torch.Tensor | None], replica_rows: ReplicaRows) -> Samples | None:
    """Sample this rank's replicated boxes now, while they hold this save()'s values.
    ``views[row]`` is the data of row ``row`` of this rank's local plan. No host copy here: on a
    GPU the sampling kernels are queued on the current stream, and an event marks their end."""
    if not replica_rows or mode() == "off":
        return None
    rows: dict[int, torch.Tensor] = {}
    alike: dict[tuple[Any, ...], list[tuple[int, torch.Tensor]]] = defaultdict(list)
    for _, held in replica_rows:
        for row in held:
            view = views[row]
            assert view is not None
            if view.numel() <= SAMPLES and not view.is_complex():  # complex: conj views, below
                alike[(view.device, view.dtype, tuple(view.shape))].append((row, view))
            else:
                rows[row] = _sample(view)
    with torch.no_grad():
        for group in alike.values():
            # Small boxes alike (optimizer step counters: one per parameter) whole, stacked in one
            # copy: per-box tensor calls cost more than the copy.
            blob = torch.stack([v for _, v in group]).reshape(len(group), -1).view(torch.uint8)
            for i, (row, _) in enumerate(group):
                rows[row] = blob[i]
    ready = []
    for device in {t.device for t in rows.values() if t.is_cuda}:
        event = torch.cuda.Event(blocking=True)  # synchronize() sleeps instead of spinning a core
        event.record(torch.cuda.current_stream(device))
        ready.append((device, event))
    return Samples(replica_rows, rows, ready)


def replica_digests(samples: Samples | None) -> dict[int, tuple[int, ...]]:
    """Per replica set this rank holds: one xxh3 digest per bucket of its boxes' samples."""
    if samples is None:
        return {}
    for device, event in samples.ready:
        # On the event's device: the save's thread may be current on another one (a worker
        # thread starts on cuda:0), where an event call would create a CUDA context.
        with torch.cuda.device(device):
            event.synchronize()  # the copies were queued on the training's stream
    rows = list(samples.rows)
    raw = dict(zip(rows, _bytes([samples.rows[row] for row in rows])))
    out: dict[int, tuple[int, ...]] = {}
    for set_id, held in samples.replica_rows:
        hashes = [xxhash.xxh3_64() for _ in range(min(REPLICA_BUCKETS, len(held)))]
        for i, row in enumerate(held):
            hashes[i % len(hashes)].update(raw[row])
        out[set_id] = tuple(h.intdigest() for h in hashes)
    return out
