"""Review of what listing a root costs on an object store (moto S3): every ``bcp.load(root)``,
the manager and ``bcp ls``/``gc`` list it. Each checkpoint's metadata size was asked twice
(the catalog, then the reader) before it was read: 3 requests per checkpoint, now 2. The
size the catalog got is checked as before: a file that grew or shrank since is refused."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.errors import CorruptCheckpointError
from bytecheckpoint.format.metadata_file import read_metadata_bytes
from bytecheckpoint.manage.catalog import RootListing
from bytecheckpoint.storage import open_storage
from bytecheckpoint.storage.local import LocalStorage
from bytecheckpoint.storage.managed import ManagedStorage

STEPS = 6


def _counted(fn: Any) -> tuple[Any, dict[str, int]]:
    counts: collections.Counter[str] = collections.Counter()
    real = ManagedStorage._call

    def counting(self: ManagedStorage, op: str, path: str, call: Any, *args: Any, **kw: Any) -> Any:
        counts[op] += 1
        return real(self, op, path, call, *args, **kw)

    ManagedStorage._call = counting  # type: ignore[method-assign]
    try:
        return fn(), dict(counts)
    finally:
        ManagedStorage._call = real  # type: ignore[method-assign]


def test_s3_listing_a_root_costs_at_most_two_requests_per_checkpoint():
    from tests.support.servers import s3_root

    root = s3_root("listing-cost")
    for step in range(1, STEPS + 1):
        bcp.save(f"{root}/step_{step}", {"w": torch.full((4,), float(step))}, step=step)
    storage, path = open_storage(root)
    found, counts = _counted(lambda: RootListing(storage, path).list(details=False))
    assert [c.step for c in found] == list(range(1, STEPS + 1))
    # One listing and the latest pointer, then a size and a read per checkpoint (was 3).
    assert counts.get("size", 0) == STEPS, counts
    assert sum(counts.values()) <= 2 * STEPS + 2, counts


@pytest.mark.parametrize("actual", [b"x" * 9, b"x" * 11, b""])
def test_a_metadata_file_that_changed_size_since_it_was_asked_is_refused(tmp_path, actual):
    meta = tmp_path / "metadata.msgpack"
    meta.write_bytes(actual)
    with pytest.raises(CorruptCheckpointError, match="while it was read"):
        read_metadata_bytes(LocalStorage(fsync=False), str(meta), 10)


def test_the_size_given_is_held_to_the_metadata_limit(tmp_path, monkeypatch):
    meta = tmp_path / "metadata.msgpack"
    meta.write_bytes(b"x" * 10)
    storage = LocalStorage(fsync=False)
    assert read_metadata_bytes(storage, str(meta), 10) == b"x" * 10
    assert read_metadata_bytes(storage, str(meta)) == b"x" * 10
    monkeypatch.setenv("BCP_METADATA_MAX_BYTES", "5")
    with pytest.raises(CorruptCheckpointError, match="over the limit"):
        read_metadata_bytes(storage, str(meta), 10)
