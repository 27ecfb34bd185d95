"""Review of what a resume costs on an object store (moto S3): ``bcp.load(root)`` checks the
``latest`` pointer against the root's listing (a racing save may have left it on a lower
step), which lists the root and reads every checkpoint's metadata. In a process group the
coordinator alone does it and tells the others; before, every rank did (at 1,000 ranks and
100 checkpoints, ~300k requests per resume). Every test here failed before its fix."""

from __future__ import annotations

import collections
import json
import time
from typing import Any

import torch

import bytecheckpoint as bcp
from bytecheckpoint.commit.protocol import LATEST_FILE
from bytecheckpoint.errors import CheckpointReplacedError
from bytecheckpoint.storage import open_storage
from bytecheckpoint.storage.managed import ManagedStorage

STEPS = 8  # checkpoints under the root: a rank that reads them all makes ~3 requests each


def _counted_load(url: str) -> tuple[float, dict[str, int]]:
    """Load ``url`` and count this rank's storage operations (one per request on S3)."""
    counts: collections.Counter[str] = collections.Counter()
    real = ManagedStorage._call

    def counting(self: ManagedStorage, op: str, path: str, fn: Any, nbytes: int | None = None) -> Any:
        counts[op] += 1
        return real(self, op, path, fn, nbytes)

    state = {"w": torch.zeros(4)}
    ManagedStorage._call = counting  # type: ignore[method-assign]
    try:
        bcp.load(url, state)
    finally:
        ManagedStorage._call = real  # type: ignore[method-assign]
    return float(state["w"][0]), dict(counts)


def resume_on_two_ranks(root: str) -> dict[str, Any]:
    """Rank body: a root whose 'latest' lags, the same root's newest checkpoint loaded by its
    path, and ranks given different paths (a mistake, still named)."""
    import torch.distributed as dist

    out: dict[str, Any] = {}
    out["root"] = _counted_load(root)
    out["direct"] = _counted_load(f"{root}/step_{STEPS}")
    mine = root if dist.get_rank() == 0 else f"{root}/step_1"
    try:
        bcp.load(mine, {"w": torch.zeros(4)})
        out["mixed"] = "loaded"
    except CheckpointReplacedError as exc:
        out["mixed"] = str(exc)
    return out


def _root_with_lagging_latest(name: str) -> str:
    from tests.support.servers import s3_root

    root = s3_root(name)
    for step in range(1, STEPS + 1):
        bcp.save(f"{root}/step_{step}", {"w": torch.full((4,), float(step))}, step=step)
    # Two saves committed at once; step 1's pointer landed last.
    storage, path = open_storage(root)
    stale = {"checkpoint": "step_1", "step": 1, "time": time.time()}
    storage.write_bytes(f"{path}/{LATEST_FILE}", json.dumps(stale).encode())
    return root


def test_s3_a_resume_in_a_process_group_reads_the_root_on_one_rank_only(world):
    root = _root_with_lagging_latest("resume-cost")
    ranks = world(2).run(resume_on_two_ranks, root)
    for got in ranks:  # both take the newer checkpoint, never the one the pointer names
        assert got["root"][0] == float(STEPS)
        assert got["direct"][0] == float(STEPS)
        assert "found different checkpoints" in got["mixed"]
    lead, other = ranks[0]["root"][1], ranks[1]["root"][1]
    assert lead.get("list_dir", 0) == 1  # the coordinator lists the root once
    assert other.get("list_dir", 0) == 0  # was 1, and every checkpoint's metadata read
    # The other rank's resume costs what loading the checkpoint by its path costs, plus the
    # pointer: not a request more per checkpoint under the root (was ~3 per checkpoint).
    direct = sum(ranks[1]["direct"][1].values())
    assert sum(other.values()) <= direct + 3, (other, ranks[1]["direct"][1])

