"""Write a small checkpoint with this library's current format, for the compatibility tests.

    .venv/bin/python -m tests.support.make_format_fixture tests/fixtures/format_v1

``tests/fixtures/format_v1`` was written by this script at commit 9cf57f0 (format version 1,
before the metadata had a checksum of its own), ``tests/fixtures/format_v2`` at b1aed9c (the
last commit before the package moved into layers), ``tests/fixtures/format_v3`` when storage
files gained padding entries that align their pieces, ``tests/fixtures/format_v4`` when large
pieces were placed for direct writes; ``tests/unit/test_load_coverage.py`` checks
that every later release still loads them bit-exactly. Run it again into a new directory when the
format version changes, and keep the old fixtures.

The directory holds ``ckpt/`` (the checkpoint: a model, its SGD state and per-rank extra state)
and ``expected.safetensors`` / ``expected.json`` (what loading it must give back), written
with the safetensors library and json, not with bytecheckpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

import bytecheckpoint as bcp


def build() -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """A tiny deterministic model after one SGD step (values independent of the RNG)."""
    model = nn.Sequential(nn.Linear(6, 4), nn.LayerNorm(4))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.linspace(-1.0, 1.0, p.numel()).reshape(p.shape) * (i + 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.linspace(0.0, 1.0, 12).reshape(2, 6)).square().sum().backward()
    optim.step()
    extra = {"step": 3, "note": "format fixture", "ids": (1, 2, 3)}
    return model, optim, extra


def expected(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        out[f"momentum.{i}"] = optim.state[p]["momentum_buffer"].clone().contiguous()
    return out


def main(out_dir: str) -> None:
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    model, optim, extra = build()
    bcp.save(os.path.join(out_dir, "ckpt"), {"model": model, "optimizer": optim, "extra_state": extra},
             step=3, user_metadata={"fixture": True})
    save_file(expected(model, optim), os.path.join(out_dir, "expected.safetensors"))
    with open(os.path.join(out_dir, "expected.json"), "w") as f:
        json.dump({"extra_state": {**extra, "ids": list(extra["ids"])}, "step": 3}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/format_v1")
