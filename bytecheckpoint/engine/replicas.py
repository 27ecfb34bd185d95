"""Sampled digests of the replicated boxes a rank offers, for the coordinator's replica check.

A box several ranks offer (DDP parameters, ``Replicate`` DTensors, plain tensors next to
shards) is written once. Replicas that disagree (data-parallel ranks out of sync, pipeline
stages that name different layers alike, a per-rank buffer) would be saved as one rank's
values, or a mix of row pieces from several, silently. Each holder therefore hashes a few
elements of each such box (all of a small one) at ``save()`` time and the coordinator compares
the digests (:func:`~bytecheckpoint.planning.global_plan.check_replicas`). Sampling keeps the
cost to one small gather per box; it catches replicas that differ throughout, not a single
element of a large tensor.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch
import xxhash

from ..planning.global_plan import REPLICA_BUCKETS, ReplicaRows

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
    return picked.resolve_conj().resolve_neg().contiguous().reshape(-1)


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


def replica_digests(views: list[torch.Tensor | None], replica_rows: ReplicaRows
                    ) -> dict[int, tuple[int, ...]]:
    """Per replica set this rank holds: one xxh3 digest per bucket of its boxes' samples.
    ``views[row]`` is the data of row ``row`` of this rank's local plan."""
    if not replica_rows:
        return {}
    rows = [row for _, held in replica_rows for row in held]
    raw = dict(zip(rows, _bytes([_sample(views[row]) for row in rows])))  # type: ignore[arg-type]
    out: dict[int, tuple[int, ...]] = {}
    for set_id, held in replica_rows:
        hashes = [xxhash.xxh3_64() for _ in range(min(REPLICA_BUCKETS, len(held)))]
        for i, row in enumerate(held):
            hashes[i % len(hashes)].update(raw[row])
        out[set_id] = tuple(h.intdigest() for h in hashes)
    return out
