"""bytecheckpoint: parallelism-agnostic checkpoints for PyTorch training.

    import bytecheckpoint as bcp
    bcp.save("ckpt/step_100", {"model": model, "optimizer": optim}, step=100)
    bcp.load("ckpt", {"model": model, "optimizer": optim})  # latest, resharded to this layout
"""

from typing import TYPE_CHECKING

from ._version import __version__ as __version__
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointReplacedError,
    ConcurrentSaveError,
    CorruptCheckpointError,
    DataLoaderError,
    DtypeMismatchError,
    InvalidArgumentError,
    InvalidSettingError,
    MissingKeysError,
    NewerFormatError,
    NotACheckpointError,
    ProcessGroupError,
    RankFailedError,
    ShapeMismatchError,
    SnapshotChangedError,
    StagingError,
    StateMismatchError,
    StorageError,
    StorageIOError,
    UnsafeCheckpointError,
    UnsupportedStateError,
)

# The torch-importing API loads on first use (PEP 562), so `import bytecheckpoint.cli` for
# `bcp --version` or `bcp --help` does not pay for torch (about 2.5 s).
_LAZY = {
    "save": ".api", "load": ".api", "pipeline_fqn_map": ".api",
    "SaveHandle": ".engine.async_save", "LoadResult": ".engine.load", "SaveResult": ".engine.save",
    "RNGState": ".state.extra", "verify": ".commit.integrity", "TensorShard": ".state.tensor_shard",
    "CheckpointManager": ".manager", "CheckpointInfo": ".manager", "KeepLast": ".manager",
    "KeepEvery": ".manager", "KeepBest": ".manager", "KeepNewerThan": ".manager",
}

if TYPE_CHECKING:
    from .api import load, pipeline_fqn_map, save
    from .commit.integrity import verify
    from .engine.async_save import SaveHandle
    from .engine.load import LoadResult
    from .engine.save import SaveResult
    from .manager import CheckpointInfo, CheckpointManager, KeepBest, KeepEvery, KeepLast, KeepNewerThan
    from .state.extra import RNGState
    from .state.tensor_shard import TensorShard


def __getattr__(name: str) -> object:
    import importlib

    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    try:  # `bytecheckpoint.storage` etc. after a bare `import bytecheckpoint`, as before
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "save", "load", "verify", "pipeline_fqn_map", "TensorShard", "RNGState", "SaveResult", "SaveHandle",
    "LoadResult", "CheckpointManager", "CheckpointInfo", "KeepLast", "KeepEvery", "KeepBest", "KeepNewerThan",
    "CheckpointError",
    "CheckpointExistsError", "CorruptCheckpointError", "DtypeMismatchError", "MissingKeysError",
    "NotACheckpointError", "RankFailedError", "ShapeMismatchError", "StateMismatchError",
    "UnsafeCheckpointError", "CheckpointReplacedError", "ConcurrentSaveError", "InvalidArgumentError",
    "InvalidSettingError", "NewerFormatError",
    "StorageError", "StorageIOError", "StagingError", "SnapshotChangedError", "UnsupportedStateError",
    "DataLoaderError", "ProcessGroupError",
]
