"""``bcp convert`` stays under its memory cap in every direction: the peak RSS of the converting
process (a subprocess running the real command line), above its baseline after imports, is
below ``--max-memory`` for a checkpoint four times the cap, and the result is bit-exact."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CAP = 16 << 20
N, SHAPE = 16, (1024, 1024)  # 16 x 4 MiB = 64 MiB

RSS_PROBE = """
import sys
from bytecheckpoint.cli.app import main
# The baseline includes the code the command runs (imported lazily by it).
import bytecheckpoint.api, bytecheckpoint.tools.convert, bytecheckpoint.interop.dcp_load
import torch.distributed.checkpoint

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
    f.write("5")
base = status("VmRSS")
code = main(sys.argv[1:])
print(code, status("VmHWM") - base)  # the peak RSS growth since the reset
"""


def _growth(*argv: str) -> int:
    out = subprocess.run([sys.executable, "-c", RSS_PROBE, "convert", *argv, "--max-memory", str(CAP), "-q"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    code, growth = map(int, out.stdout.split()[-2:])
    assert code == 0, out.stderr
    return growth


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(SHAPE, generator=gen) for i in range(N)}


def _check_bcp(path: str, reference: dict[str, torch.Tensor]) -> None:
    import bytecheckpoint as bcp
    from bytecheckpoint.state.flatten import TensorShard

    target = {k: TensorShard(torch.empty(SHAPE), SHAPE) for k in reference}
    bcp.load(path, {"model": target}, framework="manual")
    for k, v in reference.items():
        assert torch.equal(target[k].data, v), k


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak RSS from /proc")
def test_every_direction_stays_under_the_cap(tmp_path, reference):
    import torch.distributed.checkpoint as dcp

    src_dcp, src_pt = str(tmp_path / "dcp"), str(tmp_path / "model.pt")
    dcp.save({"model": reference}, checkpoint_id=src_dcp, no_dist=True)
    torch.save(reference, src_pt)

    growth = {"--from dcp": _growth("--from", "dcp", src_dcp, str(tmp_path / "from_dcp")),
              "--from torch": _growth("--from", "torch", src_pt, str(tmp_path / "from_torch")),
              "--to dcp": _growth("--to", "dcp", str(tmp_path / "from_dcp"), str(tmp_path / "back"))}
    print({k: f"{v / 2**20:.1f} MiB" for k, v in growth.items()})
    assert all(v < CAP for v in growth.values()), {k: v >> 20 for k, v in growth.items()}

    _check_bcp(str(tmp_path / "from_dcp"), reference)
    _check_bcp(str(tmp_path / "from_torch"), reference)
    back = {"model": {k: torch.empty(SHAPE) for k in reference}}
    dcp.load(back, checkpoint_id=str(tmp_path / "back"), no_dist=True)
    for k, v in reference.items():
        assert torch.equal(back["model"][k], v), k
