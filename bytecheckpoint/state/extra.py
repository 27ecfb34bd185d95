"""Extra training state that is per rank by nature: random number generators.

``state["rng"] = bcp.RNGState()`` saves Python's, NumPy's and torch's CPU generator (and
every CUDA device's, when CUDA is initialised) for each rank, and restores them exactly
(CUDA devices that the loading process lacks are skipped, with a warning).
When the world size changes, rank ``r`` takes saved rank ``r``'s state if there was one;
ranks beyond the old world size get fresh generators seeded from saved rank 0's state and
their rank, so they differ from each other and are reproducible.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import CorruptCheckpointError, StateMismatchError


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def capture_rng() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": np.array(internal, dtype=np.uint64), "gauss": gauss},
        "numpy": {"kind": kind, "keys": np.asarray(keys), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state().numpy(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.numpy() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> list[int]:
    """Restore every generator of ``state``; return the CUDA devices skipped (see below)."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"]), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached"]))
    torch.set_rng_state(torch.from_numpy(np.asarray(state["torch"], dtype=np.uint8)))
    return _restore_cuda_rng(state.get("cuda", []))


def _restore_saved(state: Any, rank: int) -> list[int]:
    """``restore_rng`` of saved rank ``rank``'s entry: decoded from a checkpoint, so a value
    of the wrong kind or size is a damaged checkpoint, named, not the generators' own error."""
    try:
        return restore_rng(state)
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, AttributeError,
            RuntimeError) as exc:
        raise CorruptCheckpointError(
            f"the checkpoint's RNG state of rank {rank} is damaged ({exc!r}): load an intact "
            "copy of the checkpoint, or load without the RNG entry") from None


def _restore_cuda_rng(states: list[Any]) -> list[int]:
    """Restore the saved CUDA generators of the devices this process has; return the saved
    device indices it had to skip (saved on more GPUs than there are here), and warn.

    Setting a device that does not exist fails, possibly only later, at CUDA's lazy
    initialisation, far from the load: so only existing devices are touched."""
    present = torch.cuda.device_count() if states and torch.cuda.is_available() else 0
    for index, saved in enumerate(states[:present]):
        torch.cuda.set_rng_state(torch.from_numpy(np.asarray(saved, dtype=np.uint8)), index)
    skipped = list(range(present, len(states)))
    if skipped:
        warnings.warn(
            f"bytecheckpoint: the checkpoint holds CUDA RNG states of {len(states)} device(s) but "
            f"this process has {present}; restored devices 0..{present - 1}, skipped "
            f"{skipped}: random streams on those devices will differ from the saved run"
            if present else
            f"bytecheckpoint: the checkpoint holds CUDA RNG states of {len(states)} device(s) "
            "but this process has no CUDA device; skipped all of them",
            RuntimeWarning, stacklevel=3)
    return skipped


class RNGState:
    """Every random number generator of this rank, as a checkpointable object.

    After a load, ``skipped_cuda_devices`` lists the saved CUDA devices this process lacks
    (their generators were not restored; a warning said so)."""

    def __init__(self) -> None:
        self.skipped_cuda_devices: list[int] = []

    def checkpoint_shards(self) -> dict[str, Any]:
        rank, world = _rank_world()
        return {"world_size": world, f"rank/{rank}": capture_rng()}

    def load_prefixes(self, has_saved: Callable[[str], bool]) -> list[str]:
        # every rank's entry is accepted (a few KiB each): ranks the new world does not
        # have are dropped on purpose, not "unexpected"
        return ["world_size", "rank/"]

    def restore_shards(self, entries: dict[str, Any]) -> None:
        rank, _ = _rank_world()
        own = entries.get(f"rank/{rank}")
        if own is not None:
            self.skipped_cuda_devices = _restore_saved(own, rank)
            return
        base = entries.get("rank/0")
        if base is None:
            raise StateMismatchError("the checkpoint holds no RNG state")
        self.skipped_cuda_devices = _restore_saved(base, 0)
        seed = int(np.frombuffer(np.asarray(base["torch"], dtype=np.uint8).tobytes()[:8], np.uint64)[0])
        seed = (seed + 1_000_003 * rank) % (1 << 63)
        random.seed(seed)
        np.random.seed(seed % (1 << 32))
        torch.manual_seed(seed)
