"""``CheckpointManager.latest_step()`` is not collective: one rank may ask it alone (to log
it) on an object store, where it reads the root itself, without the other ranks."""

from __future__ import annotations

import torch

import bytecheckpoint as bcp
from tests.support import s3_request_workloads as sw
from tests.support.servers import s3_root


def test_s3_latest_step_asked_on_one_rank_alone_answers(world):
    root = s3_root("latest-alone")  # skips when the session started no S3 server
    with bcp.CheckpointManager(root, save_every_steps=1, async_save=False) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, {"w": torch.full((4,), float(step))})
    assert world(2).run(sw.latest_step_on_rank_0_alone, root) == [4, None]
