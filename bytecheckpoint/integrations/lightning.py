"""PyTorch Lightning: ``BytecheckpointIO``, a ``CheckpointIO`` plugin.

    from bytecheckpoint.integrations.lightning import BytecheckpointIO
    trainer = Trainer(plugins=[BytecheckpointIO()], callbacks=[ModelCheckpoint(save_last=True)])
    trainer.fit(model, ckpt_path="last")

Every path Lightning names (``epoch=0-step=8.ckpt``, ``last.ckpt``) becomes a bytecheckpoint
checkpoint directory: the checkpoint dict's tensors are stored as tensors, the rest as a packed
object (bytecheckpoint.integrations.tree); nothing is pickled, so loading runs no code.

Why a ``CheckpointIO`` and what it cannot do: Lightning 2.6 calls a ``CheckpointIO`` on global
rank 0 only (``Strategy.save_checkpoint`` under ``is_global_zero``), with the full state there
(DDP replicas; FSDP with ``state_dict_type="full"``). Its only distributed checkpoint path,
``FSDPStrategy(state_dict_type="sharded")`` and ``ModelParallelStrategy``, bypasses
``CheckpointIO`` and calls torch DCP itself. So rank 0 saves alone, on a process group of its
own (a collective over the job's group would wait forever for ranks Lightning never calls),
and every rank loads on its own group too.
"""

from __future__ import annotations

import os
import posixpath
import warnings
from typing import Any

import bytecheckpoint as bcp
from bytecheckpoint.errors import InvalidArgumentError, NotACheckpointError
from bytecheckpoint.manage.catalog import RootListing
from bytecheckpoint.manage.deletion import DeletionRefusedError, delete_on_storage
from bytecheckpoint.storage import open_storage

from .tree import load_tree, to_state

try:
    from lightning.fabric.plugins import CheckpointIO
except ImportError as exc:  # the extra is not installed
    raise ImportError(
        "bytecheckpoint.integrations.lightning needs PyTorch Lightning: "
        "pip install 'bytecheckpoint[lightning]' (lightning 2.6)") from exc

# docs/format.md: a directory is a checkpoint of this format when it holds this file.
_METADATA_FILE = "metadata.msgpack"


def _own_group() -> Any:
    """A process group of this rank alone (None without torch.distributed): Lightning calls the
    plugin on some ranks only, so a save or load must not wait for the others."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    rank = dist.get_rank()
    groups = _GROUPS.setdefault(id(dist.group.WORLD), {})
    if rank not in groups:
        # Only this rank creates it (local synchronization): the others are not here.
        groups[rank] = dist.new_group([rank], backend="gloo", use_local_synchronization=True)
    return groups[rank]


_GROUPS: dict[int, dict[int, Any]] = {}


class BytecheckpointIO(CheckpointIO):
    """Saves and loads Lightning checkpoints through bytecheckpoint.

    Args:
        async_save: return from a save once the state is copied to host memory; the write
            goes on in the background (the next save, a load, a removal or ``teardown`` waits
            for it and raises its error).
        verify: check the checksum of every byte read on load.
    """

    def __init__(self, *, async_save: bool = False, verify: bool = True) -> None:
        self.async_save = async_save
        self.verify = verify
        self._pending: Any = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise InvalidArgumentError(
                f"BytecheckpointIO takes no storage_options (got {storage_options!r}); give the storage "
                "in the path (a local path, s3://..., hdfs://...)")
        if not isinstance(checkpoint, dict):
            raise InvalidArgumentError(f"a Lightning checkpoint is a dict, got {type(checkpoint).__name__}")
        self.wait()
        step = checkpoint.get("global_step")
        self._pending = bcp.save(
            os.fspath(path), to_state(checkpoint), step=step if isinstance(step, int) else None,
            overwrite=True,  # Lightning saves last.ckpt again at the same path
            async_save=self.async_save, process_group=_own_group())

    def load_checkpoint(self, path: Any, map_location: Any = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        # weights_only is moot: nothing is unpickled, whatever the checkpoint holds.
        self.wait()
        path = os.fspath(path)
        device = self._device(map_location)
        if os.path.isfile(path):
            raise NotACheckpointError(
                f"{path} is a file, not a bytecheckpoint checkpoint (a directory): it was saved without "
                "BytecheckpointIO. Load it with Lightning's default TorchCheckpointIO (drop the plugin), "
                "or convert it once with `bcp convert --from torch`")
        checkpoint = load_tree(path, process_group=_own_group(), verify=self.verify)
        return checkpoint if device is None else _to(checkpoint, device)

    @staticmethod
    def _device(map_location: Any) -> Any:
        import torch

        if map_location is None or callable(map_location):
            return None  # Lightning's own default: tensors stay on the CPU
        try:
            return torch.device(map_location)
        except (TypeError, RuntimeError):
            raise InvalidArgumentError(f"map_location={map_location!r}: BytecheckpointIO takes a device "
                                       "(or None for the CPU)") from None

    def remove_checkpoint(self, path: Any) -> None:
        """Lightning's ``save_top_k`` removing an old checkpoint, on any storage. It goes
        through the library's deletion (under the path's save lock, metadata first), so a
        pinned or being-read checkpoint, or one cooled to another tier, is kept with a warning
        instead of failing training; a path that is no checkpoint is refused by name."""
        self.wait()
        path = os.fspath(path)
        if "://" not in path and (os.path.isfile(path) or os.path.islink(path)):
            os.remove(path)  # a checkpoint file an earlier run wrote without the plugin
            return
        storage, where = open_storage(path)
        where = where.rstrip("/")
        if not storage.exists(where):
            return  # nothing there (Lightning's own CheckpointIO does the same)
        parent, name = posixpath.split(where)
        found = RootListing(storage, parent or ".").find(name, details=False)
        if found is None:
            raise NotACheckpointError(
                f"refusing to remove {path}: it is not a committed bytecheckpoint checkpoint (no "
                f"{_METADATA_FILE}); remove it by hand if it is yours")
        try:
            delete_on_storage(storage, found, requested=True)
        except DeletionRefusedError as exc:
            warnings.warn(f"Lightning asked to remove {path}; kept: {exc}", RuntimeWarning, stacklevel=2)

    def wait(self) -> None:
        """Finish the save in flight, raising its error."""
        pending, self._pending = self._pending, None
        if pending is not None and hasattr(pending, "wait"):
            pending.wait()

    def teardown(self) -> None:
        self.wait()


def _to(value: Any, device: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [_to(v, device) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value
