"""Checkpoint roots on every backend a multi-process test can share (pytest plugin).

``storage_root`` is parametrized over local disk, shared memory (``shm://``, the in-memory
flavour that separate rank processes can all see; the single-process ``mem://`` cannot be
reached from another process) and S3 on moto_server.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from bytecheckpoint.storage import open_storage
from tests.support.servers import s3_root

BACKENDS = ["file", "shm", "s3"]


@pytest.fixture(scope="module", params=BACKENDS)
def storage_root(request, tmp_path_factory) -> Iterator[Callable[[str], str]]:
    """``storage_root(name)`` returns a fresh checkpoint root URL on this test's backend."""
    made: list[str] = []

    def make(name: str) -> str:
        if request.param == "file":
            return str(tmp_path_factory.mktemp(name))
        if request.param == "shm":
            url = f"shm://bcp-test-{uuid.uuid4().hex[:8]}/{name}"
            made.append(url)
            return url
        return s3_root(name)

    yield make
    for url in made:
        storage, path = open_storage(url)
        storage.delete(path.split("/", 1)[0])
