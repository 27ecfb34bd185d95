"""Rank functions for tests/integration/test_format_versions_review.py: the checkpoints of
every earlier format version (tests/fixtures/format_v*) loaded on two ranks, resharded."""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import bytecheckpoint as bcp
from tests.support.helpers import same_bits
from tests.support.make_format_fixture import build

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")
VERSIONS = (1, 2, 3, 4)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def load_fixtures_resharded(root: str) -> dict[str, list[str]]:
    """Each fixture (saved by one rank) loaded into an FSDP2 model and its SGD state sharded
    over this world (with and without verify); the keys whose values differ from the
    fixture's expected values, by fixture."""
    if dist.get_rank() == 0:
        for v in VERSIONS:
            shutil.copytree(os.path.join(FIXTURES, f"format_v{v}"), os.path.join(root, f"v{v}"))
    dist.barrier()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out: dict[str, list[str]] = {}
    for v in VERSIONS:
        for verify in (True, False):
            want = load_file(os.path.join(root, f"v{v}", "expected.safetensors"))
            model, _, _ = build()
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            fully_shard(model, mesh=mesh)
            optim = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.1)
            extra: dict[str, Any] = {}
            result = bcp.load(os.path.join(root, f"v{v}", "ckpt"),
                              {"model": model, "optimizer": optim, "extra_state": extra}, verify=verify)
            bad = [k for k, t in model.state_dict().items() if not same_bits(_full(t), want[f"model.{k}"])]
            for i, p in enumerate(model.parameters()):
                if not same_bits(_full(optim.state[p]["momentum_buffer"]), want[f"momentum.{i}"]):
                    bad.append(f"momentum.{i}")
            if extra != {"step": 3, "note": "format fixture", "ids": (1, 2, 3)}:
                bad.append(f"extra_state {extra!r}")
            if result.step != 3:
                bad.append(f"step {result.step}")
            if optim.param_groups[0]["lr"] != 0.1 or optim.param_groups[0]["momentum"] != 0.9:
                bad.append(f"param_groups {optim.param_groups[0]['lr']}")
            out[f"v{v} verify={verify}"] = bad
    return out
